"""Training on your own text, measured: 1, 3 and 300 files, bytes and SentencePiece tokens.

    python bench/own_text.py --out=runs/own_text --heldout='BOOKS/heldout/*' \\
        --corpus=1:'BOOKS/c1/*' --corpus=3:'BOOKS/c3/*' --corpus=300:'BOOKS/c300/*' \\
        --json=docs/own_text.json

For each corpus and tokenizer (``bytes``; ``sentencepiece`` with 2048 ids) it runs
``train.py`` with ``configs/tiny.py`` at its default steps, then ``eval.py
--eval_files=HELDOUT`` (perplexity and bits per byte at 1×–16× train_len, with and
without BCA), and for the largest SentencePiece corpus ``eval.py --generate``. Every
step is a separate process, exactly the commands a user types; a step whose output
exists is not run again, so the command resumes. ``--json`` collects what the programs
wrote: the last training loss and validation loss (``metrics.jsonl``), every
perplexity row (``eval/perplexity.json``), bits per byte at 8× over 1× with BCA, and
the generated text.
"""

from __future__ import annotations

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
    parser.add_argument("--json", help="write the collected figures here")
    args = parser.parse_args()
    corpora = [item.split(":", 1) for item in args.corpus]
    if any(len(c) != 2 or not c[1] for c in corpora):
        parser.error("--corpus takes NAME:GLOB")
    os.makedirs(args.out, exist_ok=True)
    python = sys.executable
    runs = []
    for tokenizer, flags in TOKENIZERS.items():
        for name, pattern in corpora:
            workdir = os.path.abspath(os.path.join(args.out, f"{tokenizer}_{name}"))
            train = [python, "train.py", "--config=configs/tiny.py", f"--workdir={workdir}"]
            train += ["--config.data.name=textfiles", f"--config.data.files={pattern}", *flags]
            if not os.path.exists(os.path.join(workdir, "train.done")):
                _run(train, workdir + ".train.log")
                open(os.path.join(workdir, "train.done"), "w").close()
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
                    "files": pattern,
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
    name, pattern = corpora[-1]
    workdir = os.path.abspath(os.path.join(args.out, f"sentencepiece_{name}"))
    sample_path = workdir + ".generate.txt"
    if not os.path.exists(sample_path):
        generate = [python, "eval.py", f"--workdir={workdir}", "--generate"]
        generate += [f"--prompt={args.prompt}", "--max_new_tokens=600", "--temperature=0.8"]
        generate += ["--top_k=40", "--seed=0"]
        with open(sample_path, "w", encoding="utf-8") as f:
            subprocess.run(generate, cwd=ROOT, stdout=f, stderr=subprocess.DEVNULL, check=True)
    with open(sample_path, encoding="utf-8") as f:
        sample = f.read()
    if args.json:
        summary = {
            "command": " ".join(sys.argv),
            "python": platform.python_version(),
            "runs": runs,
            "generated": {"run": f"sentencepiece_{name}", "prompt": args.prompt, "text": sample},
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
