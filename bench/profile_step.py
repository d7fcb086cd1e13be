"""Where the tiny config's train step (or block scan) spends its time, from a JAX profiler trace.

    python bench/profile_step.py [--program train] [--dtype float32] [--position xpos]
                                 [--steps 3] [--top 15]

``--program scan`` profiles the block-scan evaluation that ``xpos_overhead``
times instead: 4 rows of 8 × train_len tokens, a step being one whole scan.
Traces a few warm steps with ``jax.profiler.trace(...,
create_perfetto_trace=True)``, reads the Perfetto JSON it writes, and sums
the durations of the XLA operations by name and by kind (matmuls, fused
elementwise loops, reductions, copies...). Prints a table; ``--json`` writes
the numbers.
"""

from __future__ import annotations

import collections
import gzip
import json
import pathlib
import re
import sys
import tempfile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

if __name__ == "__main__":
    from lexjax import hugepages

    hugepages.reexec_with_hugepages()  # as train.py does; see lexjax/hugepages.py

import jax

from bench import common
from lexjax.errors import ConfigError

# What an operation (or the body of a fusion) contains → kind; first match wins.
KINDS = (
    ("matmul", re.compile(r"\bdot\(|convolution\(|gemm|matmul")),
    ("transcendental", re.compile(r"\b(sine|cosine|exponential|tanh|log)\(")),
    ("reduction", re.compile(r"\breduce\(")),
    ("scatter/gather", re.compile(r"\b(scatter|gather)\(")),
    ("copy/transpose", re.compile(r"\b(copy|transpose)\(")),
    ("elementwise", re.compile(r".")),
)


def computations(hlo_text: str) -> dict[str, list[str]]:
    """``{computation name: its instruction lines}`` from compiled HLO text."""
    found, current = {}, None
    for line in hlo_text.splitlines():
        header = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$", line)
        if header:
            current = header.group(1)
            found[current] = []
        elif line.startswith("}"):
            current = None
        elif current:
            found[current].append(line)
    return found


def fusion_bodies(hlo_text: str) -> dict[str, str]:
    """``{instruction name: text of what it computes}`` from compiled HLO text:
    a fusion's called computation, or the instruction's own line."""
    texts = {name: "\n".join(lines) for name, lines in computations(hlo_text).items()}
    bodies = {}
    for text in texts.values():
        for line in text.splitlines():
            m = re.match(r"\s*(?:ROOT )?%([\w.\-]+) = .*", line)
            if not m:
                continue
            called = re.search(r"calls=%([\w.\-]+)", line)
            bodies[m.group(1)] = texts.get(called.group(1), line) if called else line
    return bodies


def described(hlo_text: str) -> dict[str, dict[str, str]]:
    """``{instruction name: {"shape": its result, "source": the JAX operation it came
    from}}`` of every instruction in compiled HLO text (what a fusion computes is
    named by its metadata: e.g. ``…/layer_3/attention/concatenate``)."""
    found = {}
    for line in hlo_text.splitlines():
        m = re.match(r"\s*(?:ROOT )?%([\w.\-]+) = (\S+) ", line)
        if m:
            source = re.search(r'op_name="([^"]*)"', line)
            found[m.group(1)] = {"shape": m.group(2), "source": source.group(1) if source else ""}
    return found


def kind_of(name: str, bodies: dict[str, str]) -> str:
    body = bodies.get(name, name)
    for kind, pattern in KINDS:
        if pattern.search(body):
            return kind
    return "elementwise"


def trace_events(log_dir: pathlib.Path) -> list[dict]:
    path = next(log_dir.rglob("perfetto_trace.json.gz"))
    with gzip.open(path, "rt", encoding="utf-8") as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def train_timer(config, steps: int):
    """(the train step's compiled HLO, a timer of ``steps`` warm steps)."""
    batches = common.train_batches(config.batch_size, config.train_len, 2)
    setup, timer = common.train_timer(config, batches, steps)
    with jax.set_mesh(setup.mesh):
        lowered = setup.train_step.lower(setup.init_state(), setup.global_batch(batches[0]))
        return lowered.compile().as_text(), timer


def scan_timer(config, steps: int):
    """(the block scan's compiled HLO, a timer of ``steps`` warm scans): the
    evaluation ``xpos_overhead`` times, 4 rows of 8 × train_len tokens."""
    import flax.linen as nn

    from lexjax.blockwise import compiled_scan
    from lexjax.model import Decoder

    model = Decoder(config.model)
    tokens = common.text_tokens(4 * (8 * config.train_len + 1), seed=2).reshape(4, -1)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    params = nn.unbox(jax.jit(model.init)(jax.random.key(0), inputs[:, :8]))["params"]
    scan = compiled_scan(model, config.block)
    hlo = scan.lower(params, inputs, targets).compile().as_text()

    def run():
        for _ in range(steps):
            scan(params, inputs, targets).block_until_ready()

    run()  # compiled and warm before the timed window
    return hlo, lambda: common.timed(run)


def main(argv=None) -> int:
    p = common.ArgumentParser(description=__doc__.split("\n\n")[0])  # errors: one line
    p.add_argument("--program", choices=("train", "scan"), default="train")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--position", default="xpos")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--json")
    args = p.parse_args(argv)
    p.check_counts(args, "steps", "top")
    p.check_json(args.json)

    try:
        config = common.tiny_config(dtype=args.dtype, position=args.position)
    except ConfigError as e:  # --position=bogus: was a traceback
        p.error(str(e))
    started = common.Provenance()
    hlo, timer = (scan_timer if args.program == "scan" else train_timer)(config, args.steps)
    bodies = fusion_bodies(hlo)
    with tempfile.TemporaryDirectory() as tmp:
        with jax.profiler.trace(tmp, create_perfetto_trace=True):
            seconds = timer()
        events = trace_events(pathlib.Path(tmp))
    # Complete events with a duration, from the XLA runtime rather than Python.
    ops = [
        e
        for e in events
        if e.get("ph") == "X"
        and "dur" in e
        and not str(e.get("name", "")).startswith(("$", "<"))
        and "python" not in str(e.get("cat", "")).lower()
    ]
    by_name = collections.Counter()
    for e in ops:
        by_name[e["name"]] += e["dur"] / 1e6
    # Nested events (a thunk inside an executable) would count twice: keep the
    # leaves, i.e. drop names whose total exceeds the traced wall time, and the thunk
    # runtime's own spans (``ThunkExecutor::Execute``), which contain the operations.
    leaves = {
        n: s for n, s in by_name.items() if s < 0.9 * seconds and not n.startswith("ThunkExecutor")
    }
    total = sum(leaves.values())
    by_kind = collections.Counter()
    for n, s in leaves.items():
        by_kind[kind_of(n, bodies)] += s
    print(
        f"{args.steps} {args.program} steps, {seconds:.2f} s wall; {total:.2f} s in "
        f"{len(leaves)} traced operations (summed over threads)"
    )
    for kind, s in by_kind.most_common():
        print(f"  {kind:<22} {s:7.2f} s  {100 * s / total:5.1f} %")
    print("top operations:")
    about = described(hlo)
    top = []
    for n, s in sorted(leaves.items(), key=lambda kv: -kv[1])[: args.top]:
        what = about.get(n, {"shape": "", "source": ""})
        top.append({"name": n, "kind": kind_of(n, bodies), "seconds": s, **what})
        print(
            f"  {n[:40]:<40} {top[-1]['kind']:<16} {s:7.3f} s  {100 * s / total:5.1f} %  "
            f"{what['shape']}"
        )
    if args.json:
        pathlib.Path(args.json).write_text(
            json.dumps(
                {
                    "program": args.program,
                    "seconds": seconds,
                    "steps": args.steps,
                    "by_kind": dict(by_kind),
                    "by_name": dict(sorted(leaves.items(), key=lambda kv: -kv[1])),
                    "top": top,
                    **started.record(),
                },
                indent=1,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
