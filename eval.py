"""Evaluates a trained LEX model at lengths beyond its training length, or samples from it.

    python eval.py --workdir=runs/tiny                       # perplexity at 1×…16× train_len
    python eval.py --workdir=runs/tiny --lengths=256,1024 --bca=on --resolution --figure
    python eval.py --workdir=runs/tiny --modes=bca,full,sinks --sinks=4
    python eval.py --workdir=runs/tiny --eval_files='/data/books/*.txt' --max_docs=50
    python eval.py --workdir=runs/tiny --generate --prompt='def ' --max_new_tokens=2000
    python eval.py --workdir=runs/tiny --generate --bca=off --prompt='def '   # without BCA
    python eval.py --workdir=runs/rope --bca=off --rope_scaling=yarn   # s = length/train_len
    python eval.py --workdir=runs/tiny --passkey --lengths=256,1024 --passkey_trials=20

Uses the latest good checkpoint in WORKDIR/checkpoints and the config stored
with it. Held-out text: the run dataset's test split (validation if it has
none), or --eval_files.

Which tokens are scored: the first --max_length tokens (the budget; default
16 × train_len, or the largest --lengths if larger) of the first --max_docs
documents that have that many (+1 for the last target). Every length cuts those
same tokens into segments of its length, so every cell of the table scores the
same tokens, and at a given --max_length a length gives the same number whatever
other lengths are asked. A cell that cannot (a length that does not divide the
budget, a length the mode cannot evaluate) is shown as missing, with the reason.

Results go to stdout and WORKDIR/eval/: perplexity.json/.png hold the latest
run, and a copy named after the settings
(perplexity-step…-MODES-budget…[-SCALING]-HASH.json) keeps every run's results;
--resolution writes resolution.json (and its settings' copy), --figure
expectation.png (Figure 1's curve).

--rope_scaling extends a trained xpos or rope model without retraining
(lexjax/positions.py): pi (position interpolation), ntk (NTK-aware base),
dynamic_ntk (NTK with the factor of the positions processed so far) or yarn
(ramped interpolation and attention temperature); --rope_factor=0 uses each
evaluated length / train_len. The scaling is in every result row and the file name.

Multi-process, as train.py (one process per host, all over the run's mesh;
process 0 alone prints and writes): on a Cloud TPU VM, under SLURM, mpirun or
a Kubernetes Indexed Job the processes find each other; elsewhere start each with

    python eval.py --workdir=DIR --coordinator_address=HOST0:PORT --num_processes=N --process_id=I

--passkey measures passkey retrieval instead (lexjax/passkey.py): a random
5-digit key hidden at each depth of filler text, asked for at the end; the
accuracy of the greedy answer per length (--lengths, default 1,2,4,8 ×
train_len), depth and mode (--bca), keys from --seed, filler a sentence or, with
--passkey_filler=text, the first --max_docs documents of --eval_files (else the
test split). It writes WORKDIR/eval/passkey.json and a heat map per mode,
passkey-MODE.png.

--generate writes the prompt and the text as the model writes it, a chunk of up
to 64 tokens at a time (until its end-of-document or --max_new_tokens), then a
newline; Ctrl-C stops it there (exit 130, `interrupted (Ctrl-C)` on stderr). Its
mesh line goes to stderr.

Each of the three runs (perplexity, --generate, --passkey) refuses a flag set to
other than its default that only another uses (e.g. --temperature with --passkey,
which decodes greedily), and greedy --generate (--temperature=0) refuses --top_k,
--top_p and --seed. --helpfull lists every flag, the multi-process ones too.
"""

from __future__ import annotations

import io
import logging as py_logging
import os
import sys

if __name__ == "__main__":
    from lexjax import errors, signals

    errors.closed_std_streams_to_devnull()  # before anything opens a file
    signals.end_on_interrupt()  # while JAX loads; run() hands Ctrl-C back to Python

from absl import app, flags, logging

from lexjax import cli, distributed, evaluation, generation, passkey
from lexjax.config import ROPE_SCALINGS

_HERE = os.path.dirname(os.path.abspath(__file__))
_WORKDIR = flags.DEFINE_string(
    "workdir",
    os.path.join("runs", "tiny"),
    "Training workdir (checkpoints/ inside); results go to WORKDIR/eval.",
)
_LENGTHS = flags.DEFINE_list(
    "lengths",
    None,
    "Evaluation lengths in tokens (default: 1,2,4,8,16 × train_len); one that does not "
    "divide --max_length is shown as missing (at least one must). With --passkey: sample "
    "lengths (default: 1,2,4,8 × train_len; at most "
    f"{passkey.MAX_LENGTH:,}).",
)
_MAX_LENGTH = flags.DEFINE_integer(
    "max_length",
    None,
    "Token budget: tokens scored per document, the same for every length and mode "
    "(default: 16 × train_len, or the largest --lengths if larger).",
)
_BCA = flags.DEFINE_enum(
    "bca",
    "both",
    ["both", "on", "off"],
    "Blockwise causal attention: both modes, only with, only without (or give --modes instead).",
)
_MODES = flags.DEFINE_list(
    "modes",
    None,
    "Evaluation modes, some of bca (blockwise causal attention), full (plain causal "
    "attention) and sinks (StreamingLLM: --sinks attention sinks + a sliding window of "
    "train_len − sinks tokens); default: as --bca says.",
)
_SINKS = flags.DEFINE_integer(
    "sinks",
    evaluation.DEFAULT_SINKS,
    "Attention sinks of mode sinks: the first tokens every query keeps (0 … train_len/2).",
)
_EVAL_FILES = flags.DEFINE_string(
    "eval_files", None, "Glob of text files to evaluate on instead of the run's held-out split."
)
_MAX_DOCS = flags.DEFINE_integer(
    "max_docs",
    evaluation.DEFAULT_MAX_DOCS,
    "At most this many documents (with --passkey: of --passkey_filler=text).",
)
_RESOLUTION = flags.DEFINE_bool(
    "resolution", False, "Also measure attention resolution at 1× and 2× train_len (paper Table 3)."
)
_FIGURE = flags.DEFINE_bool(
    "figure", False, "Also draw paper Figure 1 (expected score by distance, RoPE vs XPOS)."
)
_ROPE_SCALING = flags.DEFINE_enum(
    "rope_scaling",
    "none",
    list(ROPE_SCALINGS),
    "Inference-time RoPE extension of an xpos/rope model (no retraining).",
)
_ROPE_FACTOR = flags.DEFINE_float(
    "rope_factor",
    0.0,
    "Its factor s ≥ 1; 0: each evaluated length / train_len (dynamic_ntk: always 0).",
)
_GENERATE = flags.DEFINE_bool(
    "generate",
    False,
    "Sample a continuation of --prompt instead, with BCA (--bca=off or --modes=full: without); "
    "the perplexity's other flags are refused.",
)
_PROMPT = flags.DEFINE_string("prompt", "", "Prompt text for --generate.")
_SAMPLING = generation.SAMPLING
_MAX_NEW_TOKENS = flags.DEFINE_integer(
    "max_new_tokens",
    _SAMPLING["max_new_tokens"],
    f"Tokens to generate (at most {generation.MAX_NEW_TOKENS:,}).",
)
_TEMPERATURE = flags.DEFINE_float(
    "temperature",
    _SAMPLING["temperature"],
    "Sampling temperature; 0 is greedy (then --top_k, --top_p and --seed are refused).",
)
_TOP_K = flags.DEFINE_integer(
    "top_k", _SAMPLING["top_k"], "Sample among the k most likely tokens (0: all)."
)
_TOP_P = flags.DEFINE_float("top_p", _SAMPLING["top_p"], "Nucleus sampling mass (1: all).")
_SEED = flags.DEFINE_integer(
    "seed", _SAMPLING["seed"], "Sampling seed; with --passkey, the keys' seed."
)
_PASSKEY = flags.DEFINE_bool("passkey", False, "Measure passkey retrieval instead.")
_PASSKEY_DEPTHS = flags.DEFINE_list(
    "passkey_depths",
    None,
    "Depths of the key in the filler, in [0, 1] (0: first; default 0,0.25,0.5,0.75,1).",
)
_PASSKEY_TRIALS = flags.DEFINE_integer(
    "passkey_trials", passkey.DEFAULT_TRIALS, "Keys per length and depth."
)
_PASSKEY_FILLER = flags.DEFINE_enum(
    "passkey_filler",
    passkey.FILLERS[0],
    list(passkey.FILLERS),
    "Filler: a sentence repeated, or held-out text (--eval_files, else the test split).",
)
_CLUSTER = distributed.define_flags()  # as train.py: --coordinator_address, --num_processes, ...


def main(argv):
    del argv
    # orbax reports every file it opens, and warns that a read-only directory is
    # read-only; lexjax's own warnings (a damaged checkpoint skipped) still show.
    logging.set_verbosity(logging.ERROR)
    py_logging.getLogger("lexjax").setLevel(py_logging.WARNING)
    # Text a terminal's encoding cannot show (e.g. U+FFFD for bytes the model wrote
    # that are not UTF-8) is shown as "?", not a traceback after the whole run.
    if isinstance(sys.stdout, io.TextIOWrapper):  # not a notebook's stream
        sys.stdout.reconfigure(errors="replace")
    return cli.run_eval(
        _WORKDIR.value,
        lengths=_LENGTHS.value,
        max_length=_MAX_LENGTH.value,
        bca=_BCA.value,
        modes=_MODES.value,
        sinks=_SINKS.value,
        eval_files=_EVAL_FILES.value,
        max_docs=_MAX_DOCS.value,
        resolution=_RESOLUTION.value,
        figure=_FIGURE.value,
        rope_scaling=_ROPE_SCALING.value,
        rope_factor=_ROPE_FACTOR.value,
        generate=_GENERATE.value,
        prompt=_PROMPT.value,
        passkey_run=_PASSKEY.value,
        passkey_depths=_PASSKEY_DEPTHS.value,
        passkey_trials=_PASSKEY_TRIALS.value,
        passkey_filler=_PASSKEY_FILLER.value,
        max_new_tokens=_MAX_NEW_TOKENS.value,
        temperature=_TEMPERATURE.value,
        top_k=_TOP_K.value,
        top_p=_TOP_P.value,
        seed=_SEED.value,
        cluster=_CLUSTER(),
    )


def run(argv: list[str] | None = None) -> int:
    """The program on ``argv`` (default ``sys.argv``); raises SystemExit like ``app.run``."""
    # Flag parsing runs inside cli.main: a bad flag is one line, exit status 2.
    return cli.main(app.run, main, argv=argv, flags_parser=cli.parse_flags)


if __name__ == "__main__":
    sys.path.insert(0, _HERE)
    signals.restore_interrupt()
    sys.exit(run())
