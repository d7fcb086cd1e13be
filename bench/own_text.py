"""Training on your own text, measured: 1, 3 and 300 files, bytes and SentencePiece tokens.

    python bench/own_text.py --out=runs/own_text --heldout='BOOKS/heldout/*' \\
        --corpus=1:'BOOKS/c1/*' --corpus=3:'BOOKS/c3/*' --corpus=300:'BOOKS/c300/*' \\
        --json=docs/own_text.json

For each corpus and tokenizer (``bytes``; ``sentencepiece`` with 2048 ids) it runs
``train.py`` with ``configs/tiny.py`` at its default steps, then ``eval.py
--eval_files=HELDOUT`` (perplexity and bits per byte at 1×–16× train_len, with and
without BCA), and ``eval.py --generate`` on the largest corpus's SentencePiece run
(``--prompt``) and, with ``--prompt_smallest``, on the smallest's. Every step is a
separate process, exactly the commands a user types; a step whose output exists is
not run again, so the command resumes. ``--json`` collects what the programs wrote:
the last training loss and validation loss (``metrics.jsonl``), every perplexity row
(``eval/perplexity.json``), bits per byte at 8× over 1× with BCA, the generated texts
with their commands, the corpora's file counts and sizes, the commit each run trained
at, and the machine.
"""

from __future__ import annotations

import glob
import json
import os
import platform
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench import common  # noqa: E402  (needs ROOT on sys.path)

TOKENIZERS = {
    "bytes": [],
    "sentencepiece": ["--config.data.tokenizer=sentencepiece", "--config.data.vocab_size=2048"],
}


def _run(command: list[str], log: str) -> float:
    """Runs one program with its output in ``log``; returns its wall seconds."""
    start = time.perf_counter()
    with open(log, "w", encoding="utf-8") as f:
        done = subprocess.run(command, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT)
    if done.returncode:
        sys.exit(f"error: {' '.join(command)} exited {done.returncode}; see {log}")
    return time.perf_counter() - start


def _files(pattern: str) -> dict:
    """How many files ``pattern`` matches and their size on disk."""
    paths = [p for p in glob.glob(pattern, recursive=True) if os.path.isfile(p)]
    return {"pattern": pattern, "files": len(paths), "bytes": sum(map(os.path.getsize, paths))}


def _generate(python: str, workdir: str, prompt: str) -> dict:
    """``eval.py --generate`` on ``workdir``; its text is kept in WORKDIR.generate.txt
    (as the other steps' outputs are, so the command resumes without it), written
    under another name and renamed once the program succeeded: a failed or stopped
    run leaves no text that the next one would take as the sample."""
    command = [python, "eval.py", f"--workdir={workdir}", "--generate", f"--prompt={prompt}"]
    command += ["--max_new_tokens=600", "--temperature=0.8", "--top_k=40", "--seed=0"]
    path = workdir + ".generate.txt"
    if not os.path.exists(path):
        partial, log = path + ".partial", workdir + ".generate.log"
        with open(partial, "w", encoding="utf-8") as f, open(log, "w", encoding="utf-8") as err:
            done = subprocess.run(command, cwd=ROOT, stdout=f, stderr=err)
        if done.returncode:
            os.remove(partial)
            sys.exit(f"error: {' '.join(command)} exited {done.returncode}; see {log}")
        os.replace(partial, path)
    with open(path, encoding="utf-8") as f:
        text = f.read()
    shown = ["python", *command[1:]]
    return {"run": os.path.basename(workdir), "prompt": prompt, "command": shown, "text": text}


def _metrics(workdir: str) -> dict:
    last = {}
    with open(os.path.join(workdir, "metrics.jsonl"), encoding="utf-8") as f:
        for line in f:
            row = json.loads(line)
            for key in ("step", "loss", "val_loss"):
                if key in row:
                    last[key] = row[key]
    return last


def main() -> int:
    parser = common.ArgumentParser(description=__doc__.split("\n")[0])  # errors: one line
    parser.add_argument("--out", required=True, help="directory of the runs and logs")
    parser.add_argument("--heldout", required=True, help="glob of the held-out books")
    parser.add_argument(
        "--corpus", action="append", required=True, help="NAME:GLOB, e.g. 3:'books/c3/*'"
    )
    parser.add_argument("--prompt", default="The option")
    parser.add_argument(
        "--prompt_smallest", help="also generate from the smallest corpus's SentencePiece run"
    )
    parser.add_argument("--json", help="write the collected figures here")
    args = parser.parse_args()
    corpora = [item.split(":", 1) for item in args.corpus]
    if any(len(c) != 2 or not c[1] for c in corpora):
        parser.error("--corpus takes NAME:GLOB")
    os.makedirs(args.out, exist_ok=True)
    python = sys.executable
    workdir_of = lambda tokenizer, name: os.path.abspath(
        os.path.join(args.out, f"{tokenizer}_{name}")
    )
    runs = []
    for tokenizer, flags in TOKENIZERS.items():
        for name, pattern in corpora:
            workdir = workdir_of(tokenizer, name)
            train = [python, "train.py", "--config=configs/tiny.py", f"--workdir={workdir}"]
            train += ["--config.data.name=textfiles", f"--config.data.files={pattern}", *flags]
            done = os.path.join(workdir, "train.done")
            if not os.path.exists(done):
                _run(train, workdir + ".train.log")
                with open(done, "w", encoding="utf-8") as f:
                    f.write(common.git_commit() or "")  # the code it trained with
            with open(done, encoding="utf-8") as f:
                commit = f.read().strip() or None
            result = os.path.join(workdir, "eval", "perplexity.json")
            if not os.path.exists(result):
                evaluate = [python, "eval.py", f"--workdir={workdir}"]
                _run([*evaluate, f"--eval_files={args.heldout}"], workdir + ".eval.log")
            with open(result, encoding="utf-8") as f:
                perplexity = json.load(f)
            rows = perplexity["results"]
            train_len = perplexity["train_len"]
            bca = {r["length"]: r["bits_per_byte"] for r in rows if r["mode"] == "bca"}
            runs.append(
                {
                    "tokenizer": tokenizer,
                    "corpus": name,
                    "files": _files(pattern),
                    "commit": commit,
                    "train": _metrics(workdir),
                    "train_len": train_len,
                    "source": perplexity["source"],
                    "perplexity": [
                        {k: r[k] for k in ("mode", "length", "perplexity", "bits_per_byte")}
                        for r in rows
                    ],
                    "bpb_8x_over_1x_bca": bca[8 * train_len] / bca[train_len],
                }
            )
    samples = [_generate(python, workdir_of("sentencepiece", corpora[-1][0]), args.prompt)]
    if args.prompt_smallest is not None:
        smallest = workdir_of("sentencepiece", corpora[0][0])
        samples.append(_generate(python, smallest, args.prompt_smallest))
    if args.json:
        summary = {
            "command": " ".join(sys.argv),
            "python": platform.python_version(),
            # Perplexities and texts, not timings: the load does not change them.
            "machine": common.machine(),
            "heldout": _files(args.heldout),
            "runs": runs,
            "samples": samples,
        }
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(summary, f, indent=2, ensure_ascii=False)
            f.write("\n")
    for r in runs:
        print(
            f"{r['tokenizer']:>13} {r['corpus']:>4} files: loss {r['train'].get('loss', 0):.3f}, "
            f"bits per byte 8×/1× with BCA {r['bpb_8x_over_1x_bca']:.3f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
