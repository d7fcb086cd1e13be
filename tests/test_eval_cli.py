"""eval.py on a tiny trained workdir: outputs, schema, and one-line errors."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = [
    "--config=configs/tiny.py",
    "--config.model.num_layers=1",
    "--config.model.d_model=32",
    "--config.model.num_heads=2",
    "--config.model.mlp_dim=64",
    "--config.train_len=32",
    "--config.batch_size=2",
    "--config.num_train_steps=2",
    "--config.eval_batches=1",
]


def _run(script, *args):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    return subprocess.run(
        [sys.executable, script, *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("run"))
    done = _run("train.py", *TINY, f"--workdir={path}")
    assert done.returncode == 0, done.stderr[-2000:]
    return path


def test_eval_writes_the_table_json_and_figures(workdir, tmp_path):
    texts = tmp_path / "texts"
    texts.mkdir()
    for i in range(3):
        (texts / f"doc{i}.txt").write_text("lexjax " * (20 + 5 * i))  # 142+ tokens
    done = _run(
        "eval.py", f"--workdir={workdir}", f"--eval_files={texts}/*.txt", "--resolution", "--figure"
    )
    assert done.returncode == 0, done.stderr[-2000:]
    # Default lengths 32 … 512; documents of 142–212 tokens serve 32, 64 and 128.
    assert "dropping lengths 256, 512" in done.stderr
    assert "| xpos BCA |" in done.stdout and "| xpos without BCA |" in done.stdout
    with open(os.path.join(workdir, "eval", "perplexity.json")) as f:
        summary = json.load(f)
    assert summary["train_len"] == 32
    rows = summary["results"]
    assert {(r["mode"], r["length"]) for r in rows} == {
        (m, n) for m in ("bca", "full") for n in (32, 64, 128)
    }
    for r in rows:
        assert isinstance(r["perplexity"], float) and r["perplexity"] > 1
        assert r["tokens"] == 3 * 128 and r["documents"] == 3
    with open(os.path.join(workdir, "eval", "resolution.json")) as f:
        resolution = json.load(f)
    assert {(r["mode"], r["length"]) for r in resolution["results"]} == {
        (m, n) for m in ("bca", "full") for n in (32, 64)
    }
    for name in ("perplexity.png", "expectation.png"):
        assert os.path.getsize(os.path.join(workdir, "eval", name)) > 0

    done = _run(
        "eval.py",
        f"--workdir={workdir}",
        "--generate",
        "--prompt=def ",
        "--max_new_tokens=40",
        "--temperature=0",
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("def ")


def _one_line_error(done, *fragments):
    assert done.returncode != 0
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), done.stderr[-2000:]
    for fragment in fragments:
        assert fragment in lines[0]


def test_bad_input_is_one_line(workdir, tmp_path):
    import jax

    from lexjax import checkpoint
    from lexjax import config as config_lib
    from lexjax.steps import TrainSetup

    _one_line_error(_run("eval.py", f"--workdir={tmp_path}"), "no checkpoint")
    _one_line_error(_run("eval.py", f"--workdir={workdir}", "--lengths=64,0"), "positive")
    _one_line_error(
        _run("eval.py", f"--workdir={workdir}", f"--eval_files={tmp_path}/*.nope"),
        "matches no files",
    )
    short = tmp_path / "short.txt"
    short.write_text("x" * 50)
    _one_line_error(
        _run("eval.py", f"--workdir={workdir}", f"--eval_files={short}", "--lengths=32,64"),
        "1 documents",
        "longest 52 tokens",
        "length 64",
    )

    # A checkpoint whose stored config does not describe its arrays.
    stored = checkpoint.Checkpointer(os.path.join(workdir, "checkpoints"), read_only=True)
    config_dict = stored.restore_config()
    stored.close()
    state = TrainSetup(config_lib.from_configdict(config_dict), jax.devices()[:1]).init_state()
    config_dict["model"]["d_model"] = 64
    other = tmp_path / "other"
    writer = checkpoint.Checkpointer(str(other / "checkpoints"))
    writer.save(1, state, config=config_dict)
    writer.close()
    _one_line_error(_run("eval.py", f"--workdir={other}"), "different model shape")
