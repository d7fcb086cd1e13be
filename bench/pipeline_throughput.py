"""Does the SentencePiece data pipeline keep up with training? Tokens/s of both.

    python bench/pipeline_throughput.py [--json docs/pipeline_throughput.json] [--quick]
        [--note TEXT]

Pipeline: ``lexjax.data.make_train_iterator`` (read ArrayRecord, tokenize,
chunk, pack, batch) in this process, no worker processes, over the first
``--files`` files of the ``python_stdlib`` corpus with a SentencePiece
tokenizer of ``--vocab_size`` ids learned from its train split (and with the
byte tokenizer, for reference). Training: ``configs/tiny.py``'s jitted train
step at that vocabulary, on one device, fed batches from the same pipeline.
Both are timed in alternating rounds (``bench.common.alternate``); the headline
is the median per-round ratio pipeline tokens/s ÷ training tokens/s, which
must be above 1 for the pipeline not to slow training (with ``worker_count``
> 0 the pipeline also runs beside the step rather than before it).
"""

from __future__ import annotations

import json
import pathlib
import sys
import tempfile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from bench import common


def _pipeline_rate(source, tokenizer, config, batches: int):
    """``rate()``: tokens/s of ``batches`` fresh batches from a new iterator."""
    from lexjax import data

    seed = [0]

    def rate() -> float:
        seed[0] += 1  # a new shuffle each round: no document is cached from the last one
        iterator = data.make_train_iterator(
            source,
            seq_len=config.train_len,
            batch_size=config.batch_size,
            seed=seed[0],
            tokenizer=tokenizer,
            shuffle_rows=config.data.shuffle_rows,  # as train.py's, and recorded
            open_documents=config.data.open_documents,
        )
        seconds = common.timed(lambda: [next(iterator) for _ in range(batches)])
        return batches * config.batch_size * config.train_len / seconds

    return rate


def run(args) -> dict:
    from lexjax import data
    from lexjax.data import pipeline

    with tempfile.TemporaryDirectory() as data_dir:
        corpus = dict(data_dir=data_dir, max_files=args.files)
        source = data.load_source("python_stdlib", "train", **corpus)
        piece = data.load_tokenizer("sentencepiece", args.vocab_size, "python_stdlib", **corpus)
        config = common.make_config(
            common.config_dict("tiny"),
            data={"tokenizer": "sentencepiece", "vocab_size": args.vocab_size},
        )
        batches = next_batches(source, piece, config, 4)
        _, train_timer = common.train_timer(config, batches, args.steps)
        train_tokens = args.steps * config.batch_size * config.train_len
        sides = {
            "pipeline_sentencepiece": _pipeline_rate(source, piece, config, args.batches),
            "pipeline_bytes": _pipeline_rate(source, data.BYTES, config, args.batches),
            "train_step": lambda: train_tokens / train_timer(),
        }
        rounds = common.alternate(sides, args.rounds)
        bytes_per_token = sum(len(source[i]) for i in range(len(source))) / sum(
            len(piece.encode(source[i])) for i in range(len(source))
        )
    ratio = common.ratios(rounds["pipeline_sentencepiece"], rounds["train_step"])
    return common.result(
        ratio.median,
        "pipeline tokens/s ÷ training tokens/s",
        "> 1 (the pipeline does not slow training)",
        ratio.median > 1,
        ratio=ratio.as_dict(),
        tokens_per_sec={k: common.Summary.of(v).as_dict() for k, v in rounds.items()},
        settings={
            "corpus": f"python_stdlib, first {args.files} files, train split",
            "documents": len(source),
            "vocab_size": args.vocab_size,
            "bytes_per_sentencepiece_token": bytes_per_token,
            "train_len": config.train_len,
            "batch_size": config.batch_size,
            "model": "configs/tiny.py",
            "rounds": args.rounds,
            "pipeline_batches_per_round": args.batches,
            "train_steps_per_round": args.steps,
            "worker_count": 0,
            # The data order measured (lexjax.data.pipeline's stream, the config's settings):
            "stream": pipeline.STREAM_VERSION,
            "open_documents": config.data.open_documents,
            "shuffle_rows": config.data.shuffle_rows,
        },
        machine=common.machine(),
        note=args.note,
    )


def next_batches(source, tokenizer, config, count: int) -> list[dict]:
    from lexjax import data

    iterator = data.make_train_iterator(
        source, seq_len=config.train_len, batch_size=config.batch_size, seed=0, tokenizer=tokenizer
    )
    return [next(iterator) for _ in range(count)]


def main(argv=None) -> int:
    p = common.ArgumentParser(description=__doc__.split("\n\n")[0])  # errors: one line
    p.add_argument("--json", help="write the result here")
    p.add_argument(
        "--quick", action="store_true", help="a smoke test, not a measurement: small defaults"
    )
    counts = dict(  # (default, --quick's default)
        files=(400, 60), vocab_size=(2048, 512), rounds=(5, 1), batches=(20, 2), steps=(5, 1)
    )
    helps = dict(
        files="python_stdlib files in the corpus",
        batches="pipeline batches per round",
        steps="train steps per round",
    )
    for name, (default, quick) in counts.items():
        p.add_argument(
            f"--{name}",
            type=int,
            help=f"{helps.get(name, '')} (default {default}; --quick {quick})",
        )
    p.add_argument(
        "--note", default="", help="where it ran (e.g. a shared machine), kept in the JSON"
    )
    args = p.parse_args(argv)
    for name, defaults in counts.items():  # --quick no longer overrides one given
        if getattr(args, name) is None:
            setattr(args, name, defaults[args.quick])
    p.check_counts(args, *counts)
    p.check_json(args.json)
    started = common.Provenance()
    entry = run(args)
    entry.update(started.record())
    text = json.dumps({"pipeline_throughput": entry}, indent=2)
    if args.json:
        pathlib.Path(args.json).write_text(text + "\n")
    tps = entry["tokens_per_sec"]
    print(
        f"pipeline (sentencepiece {args.vocab_size}) {common.fmt(tps['pipeline_sentencepiece'])}"
        f" tok/s, pipeline (bytes) {common.fmt(tps['pipeline_bytes'])} tok/s, "
        f"train step {common.fmt(tps['train_step'])} tok/s; ratio {common.fmt(entry['ratio'])}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
