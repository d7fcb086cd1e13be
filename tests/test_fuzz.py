"""Command-line fuzzing: every flag of train.py and eval.py and every config field gets
values of the wrong type, out of range, empty, and a misspelled name. Each invalid
value is one ``error:`` line naming what to change, a non-zero exit and no traceback;
each valid value is accepted.

In-process, through the programs' own ``run(argv)`` (absl parsing, the ``--config``
parser, ``cli.main``'s one catch site, config and mesh validation); only the work
after validation is replaced: training by the mesh check ``TrainSetup`` does first,
joining processes by the check of the cluster flags, loading a checkpoint by a
marker. A few subprocess spot checks run the real programs.
"""

from __future__ import annotations

import os
import pathlib
import shlex
import socket
import subprocess
import sys
import types
import xml.etree.ElementTree

import pytest
from absl import flags

from lexjax import config as cfg
from tests.helpers import leaves

ROOT = pathlib.Path(__file__).resolve().parent.parent
FLAGS = flags.FLAGS

# Per config field: (valid non-default values, invalid values besides the generic
# wrong-type / empty / misspelled cases). sharding_rules is a table set in config
# files, not a command-line value; it has its own test in test_config.py.
FIELDS = {
    "batch_size": (["8"], ["0", "-4", "12"]),  # 12 does not divide the 8-device mesh
    "checkpoint_every": (["5"], ["0", "-1"]),
    "data.data_dir": (["/tmp/lexjax-data"], []),
    "data.files": (["/tmp/*.txt"], [" --config.data.name=textfiles"]),
    "data.name": (["textfiles --config.data.files=/tmp/*.txt"], ["textfiles", ""]),
    "data.text_feature": (["content"], [""]),
    "data.worker_count": (["2"], ["-1"]),
    "data.passkey_fraction": (["0.2", "0"], ["1.0", "-0.1", "nan"]),
    "data.copy_fraction": (["0.3", "0"], ["1.0", "-0.1", "nan"]),
    "data.shuffle_rows": (["0", "4096"], ["-1"]),
    "data.open_documents": (["1", "64"], ["0", "-3"]),
    "data.tokenizer": (["sentencepiece"], ["words", ""]),
    "data.vocab_size": (
        ["4096 --config.data.tokenizer=sentencepiece"],
        ["100 --config.data.tokenizer=sentencepiece", "x"],
    ),
    "data.validation_files": (["/tmp/v/*.txt"], []),
    "data.test_files": (["/tmp/t/*.txt"], []),
    "eval_batches": (["1"], ["0"]),
    "eval_every": (["50"], ["0"]),
    "keep_checkpoints": (["1"], ["0", "-2"]),
    "learning_rate": (["1e-4"], ["0", "-1e-3", "nan"]),
    "log_every": (["1"], ["0"]),
    "mesh.data": (["2 --config.mesh.fsdp=4"], ["0", "-2", "3"]),
    "mesh.fsdp": (["-1 --config.mesh.data=1"], ["0", "3", "-1"]),  # -1 twice
    "mesh.tensor": (["2"], ["0", "3"]),
    "model.attention_impl": (
        ["fused", "splash"],
        ["flash", "splash --config.model.position=alibi"],
    ),
    "model.d_model": (["128"], ["0", "-8", "250"]),  # 250: heads do not divide it
    "model.dtype": (["bfloat16"], ["float64", "fp32"]),
    "model.max_len": (["512"], ["128", "-1"]),  # below train_len
    "model.mlp_dim": (["512"], ["0", "-1"]),
    "model.num_heads": (["8"], ["0", "3"]),
    "model.num_layers": (["2"], ["0", "-1"]),
    "model.param_dtype": (["bfloat16"], ["int8"]),
    "model.position": (
        ["rope", "alibi", "learned", "xpos_norotate", "none"],
        ["relative", "XPOS", "xpos_norotate --config.model.rope_scaling=pi"],
    ),
    "model.rope_scaling": (
        ["pi", "ntk", "dynamic_ntk", "yarn --config.model.position=rope"],
        ["linear", "YARN", "pi --config.model.position=alibi", "ntk --config.model.position=none"],
    ),
    "model.rope_factor": (
        ["4 --config.model.rope_scaling=yarn", "1.5 --config.model.rope_scaling=pi"],
        [
            "0.5 --config.model.rope_scaling=pi",
            "-1 --config.model.rope_scaling=ntk",
            "nan --config.model.rope_scaling=pi",
            "inf --config.model.rope_scaling=pi",
            "2",  # no scaling to apply it to
            "2 --config.model.rope_scaling=dynamic_ntk",
        ],
    ),
    "model.rope_train_len": (["128", "64 --config.model.rope_scaling=yarn"], ["0", "-1"]),
    "model.remat": (["True"], ["True --config.model.remat_policy=dots_except_mlp"]),
    "model.remat_policy": (["full", "dots_except_mlp"], ["dots", "all"]),
    "model.scale_base": (["256"], ["0", "-512"]),
    "model.scan_layers": (["True"], []),
    "model.theta": (["500000"], ["0", "-1"]),
    "model.tie_embeddings": (["False"], []),
    "model.vocab_size": (["512"], ["100", "0"]),
    "num_train_steps": (["10"], ["0", "-1"]),
    "on_corrupt_checkpoint": (["error"], ["ignore"]),
    "optim.b1": (["0.8"], ["1.0", "-0.1"]),
    "optim.b2": (["0.95"], ["1.5"]),
    "optim.end_lr_fraction": (["0.0"], ["1.5", "-0.1"]),
    "optim.eps": (["1e-8"], ["0", "-1e-8"]),
    "optim.grad_accum_steps": (["2"], ["0", "3"]),  # 3 does not divide batch_size 16
    "optim.grad_clip": (["0"], ["-1"]),
    "optim.schedule": (["constant", "polynomial"], ["linear"]),
    "optim.weight_decay": (["0"], ["-0.1"]),
    "peak_flops": (["1e15"], ["0", "-1"]),
    "seed": (["123"], ["-1", str(2**32)]),
    "sharding": (["fsdp", "data"], ["fdsp"]),
    "train_len": (["128"], ["0", "7", "-2"]),
    "warmup_steps": (["0"], ["-1"]),
}

# Per flag of train.py / eval.py: (valid argument lists, invalid values). A value may be
# followed by the other flags it needs, after a space.
# train.py and eval.py join a multi-process run with the same flags.
CLUSTER_FLAGS = {
    "distributed": ([["--distributed=off"]], ["maybe", ""]),
    "coordinator_address": (
        [["--coordinator_address=127.0.0.1:1234", "--num_processes=2", "--process_id=1"]],
        [
            "127.0.0.1",
            "",
            "host:port",
            "h:99999 --num_processes=2 --process_id=1",
            "h:\u00b2 --num_processes=2 --process_id=1",  # a digit to str.isdigit, not to int
            "h:\u0661\u0662 --num_processes=2 --process_id=1",  # Arabic-Indic 12: no port
        ],
    ),
    "num_processes": (
        [["--coordinator_address=h:1", "--num_processes=4", "--process_id=3"]],
        ["0 --coordinator_address=h:1 --process_id=0", "2"],  # 2: without the other two
    ),
    "process_id": (
        [["--coordinator_address=h:1", "--num_processes=2", "--process_id=0"]],
        [
            "-1 --coordinator_address=h:1 --num_processes=2",
            "2 " + "--coordinator_address=h:1 --num_processes=2",
        ],
    ),
    "heartbeat_timeout_s": ([["--heartbeat_timeout_s=10"]], ["0", "-5"]),
    "initialization_timeout_s": ([["--initialization_timeout_s=10"]], ["0", "-1"]),
}
TRAIN_FLAGS = {
    "workdir": ([["--workdir=/tmp/lexjax-fuzz"]], [""]),
    **CLUSTER_FLAGS,
    "lease_timeout_s": ([["--lease_timeout_s=30"]], ["0", "-1", "inf", "1e300"]),
}
EVAL_FLAGS = {
    "workdir": ([["--workdir=/tmp/lexjax-fuzz"]], [""]),
    **CLUSTER_FLAGS,
    "lengths": ([["--lengths=256,64"]], ["", "0", "-5", "abc", "64,x"]),
    "bca": ([["--bca=on"], ["--bca=off"]], ["maybe", ""]),
    "modes": (
        [["--modes=sinks"], ["--modes=bca,full,sinks"], ["--modes=full", "--bca=both"]],
        ["", "dense", "bca,x", "sinks --bca=on"],
    ),
    "sinks": (
        [["--sinks=0", "--modes=sinks"], ["--sinks=8", "--modes=bca,sinks"]],
        ["-1", "8 --passkey", "2", "2 --modes=bca,full"],  # 2: without mode sinks, unused
    ),
    "eval_files": (
        [
            ["--eval_files=/tmp/*.txt"],
            ["--passkey", "--eval_files=/tmp/*.txt", "--passkey_filler=text"],
        ],
        ["", "/tmp/*.txt --passkey"],
    ),
    "max_docs": (
        [["--max_docs=5"], ["--max_docs=5", "--passkey", "--passkey_filler=text"]],
        ["0", "-1", "5 --passkey"],
    ),
    "max_length": (
        [["--max_length=4096"], ["--lengths=64", "--max_length=128"]],
        ["0", "-3", "x", "4096 --passkey"],
    ),
    "resolution": ([["--resolution"], ["--noresolution"]], ["maybe", "true --passkey"]),
    "figure": ([["--figure"]], ["2", "true --passkey --passkey_filler=text"]),
    "generate": (
        [["--generate"], ["--generate", "--bca=off"], ["--generate", "--modes=full"]],
        [
            "yes",
            "true --modes=sinks",
            "true --modes=bca,full",
            "true --lengths=64",
            "true --max_length=64",
            "true --resolution",
            "true --figure",
            "true --eval_files=/tmp/*.txt",
            "true --max_docs=5",
            "true --sinks=2",
        ],
    ),
    # Sampling and passkey flags belong to their runs; given to another, they are refused.
    "prompt": ([["--prompt=def ", "--generate"], ["--prompt="]], ["def"]),
    "max_new_tokens": ([["--max_new_tokens=3", "--generate"]], ["0", "-1", "3"]),
    "temperature": ([["--temperature=0", "--generate"]], ["-0.5", "nan", "inf", "0 --passkey"]),
    "top_k": ([["--top_k=5", "--generate"]], ["-1", "5 --passkey"]),
    "top_p": ([["--top_p=0.9", "--generate"]], ["0", "1.5", "nan", "inf", "0.9"]),
    "seed": (
        [["--seed=7", "--generate"], ["--seed=7", "--passkey"]],
        ["-1", "-1 --passkey", str(10**23) + " --generate", "7"],
    ),
    "rope_scaling": (
        [["--rope_scaling=yarn"], ["--rope_scaling=dynamic_ntk", "--bca=off"]],
        ["linear", "", "pi --generate", "yarn --passkey"],
    ),
    "rope_factor": (
        [["--rope_factor=4", "--rope_scaling=pi"], ["--rope_factor=0", "--rope_scaling=ntk"]],
        ["0.5 --rope_scaling=pi", "-2", "nan", "inf", "3", "2 --rope_scaling=dynamic_ntk"],
    ),
    "passkey": ([["--passkey"], ["--nopasskey"]], ["maybe", "true --generate"]),
    "passkey_depths": (
        [["--passkey_depths=0,0.5,1", "--passkey"], ["--passkey", "--passkey_depths=0.3"]],
        ["", "1.5", "-0.1", "x", "0,nan", "0.3", "0.3 --generate"],
    ),
    "passkey_trials": ([["--passkey", "--passkey_trials=1"]], ["0", "-2", "3"]),
    "passkey_filler": ([["--passkey_filler=text", "--passkey"]], ["words", "", "text"]),
}
GENERIC_BAD = {  # wrong type and empty, by the flag's type
    "int": ["abc", "1.5", ""],
    "float": ["abc", ""],
    "bool": ["maybe", ""],
    "str": [],
    "enum": [],
    "list": [],
}


def _field_type(path: str) -> str:
    *parents, leaf = path.split(".")
    node = cfg.default_configdict()
    for key in parents:
        node = node[key]
    return {int: "int", float: "float", bool: "bool", str: "str"}[node.get_type(leaf)]


def _flag_type(name: str) -> str:
    kind = FLAGS[name].flag_type()
    return {"string": "str", "string enum": "enum", "bool": "bool", "int": "int"}.get(
        kind, "float" if kind == "float" else "list"
    )


def _check(failures, argv, code, err, *, valid: bool, name: str, accepted):
    lines = err.strip().splitlines()
    if valid:
        if code != accepted or any(line.startswith("error:") for line in lines):
            failures.append(f"valid {argv} refused: {code} {err.strip()[-300:]}")
        return
    if code in (0, None, accepted) or "Traceback" in err:
        failures.append(f"invalid {argv} accepted or traceback: {code} {err.strip()[-300:]}")
    elif len(lines) != 1 or not lines[0].startswith("error: "):
        failures.append(f"invalid {argv}: not one error line: {err.strip()[-300:]}")
    elif name.split(".")[-1] not in lines[0]:
        failures.append(f"invalid {argv}: the line does not name {name}: {lines[0]}")


def _flag_cases(table, type_of):
    for name, (valid, bad) in table.items():
        for argv in valid:
            yield argv, True, name
        kind = type_of(name)
        for value in [*GENERIC_BAD[kind], *bad]:
            first, *more = value.split(" ")
            yield [f"--{name}={first}", *more], False, name
        if kind == "bool":
            yield [f"--no{name[:-1]}"], False, name[:-1]
        yield [f"--{name[:-1]}=1"], False, name[:-1]  # misspelled


def test_every_train_flag_and_config_field(program, capsys):
    program("train", ["--workdir=/tmp/lexjax-fuzz"], capsys)  # defines train.py's flags
    own = program.own_flags["train"]
    assert own == set(TRAIN_FLAGS)  # a new flag needs its cases here
    fields = {name for name, _ in leaves(cfg.default_configdict().to_dict())}
    assert fields == set(FIELDS)  # a new field needs its cases here

    cases = list(_flag_cases(TRAIN_FLAGS, _flag_type))
    for name, (valid, bad) in FIELDS.items():
        for value in valid:
            first, *more = value.split(" ")  # a value and the flags it needs
            cases.append(([f"--config.{name}={first}", *more], True, name))
        for value in [*GENERIC_BAD[_field_type(name)], *bad]:
            first, *more = value.split(" ")
            cases.append(([f"--config.{name}={first}", *more], False, name))
        cases.append(([f"--config.{name[:-1]}=1"], False, name[:-1]))
    cases.append((["--config=configs/nope.py"], False, "nope.py"))
    cases.append((["--config.sharding_rules=abc"], False, "sharding_rules"))

    failures = []
    for argv, valid, name in cases:
        code, err = program("train", ["--workdir=/tmp/lexjax-fuzz", *argv], capsys)
        _check(failures, argv, code, err, valid=valid, name=name, accepted=0)
    assert not failures, "\n".join(failures)
    assert len(cases) > 200


def test_every_eval_flag(program, capsys):
    program("eval", [], capsys)
    own = program.own_flags["eval"]
    assert own == set(EVAL_FLAGS)
    failures = []
    cases = list(_flag_cases(EVAL_FLAGS, _flag_type))
    for argv, valid, name in cases:
        code, err = program("eval", ["--workdir=/tmp/lexjax-fuzz", *argv], capsys)
        _check(failures, argv, code, err, valid=valid, name=name, accepted="reached")
    assert not failures, "\n".join(failures)


class _FakeRun:
    """What eval.py loads, recording what each run asks of it."""

    mesh = types.SimpleNamespace(shape={"data": 1, "fsdp": 1, "tensor": 1})

    def __init__(self, calls):
        self.calls = calls

    def evaluate(self, lengths, **settings):
        self.calls.append(("evaluate", lengths, settings))

    def passkey(self, lengths, **settings):
        self.calls.append(("passkey", lengths, settings))

    def generate(self, prompt, **settings):
        settings.pop("on_text")
        self.calls.append(("generate", prompt, settings))
        return ""


@pytest.mark.parametrize(
    "argv, expected",
    [  # what eval.py's docstring and --help say each flag does, written out by hand
        (
            ["--lengths=64,256", "--max_length=512", "--bca=on", "--max_docs=5"],
            ("evaluate", [64, 256], {"max_length": 512, "modes": ("bca",), "max_docs": 5}),
        ),
        (["--modes=bca,sinks", "--sinks=2"], ("evaluate", None, {"modes": ("bca", "sinks")})),
        (
            ["--rope_scaling=pi", "--rope_factor=4", "--resolution", "--figure"],
            (
                "evaluate",
                None,
                {"rope_scaling": "pi", "rope_factor": 4.0, "resolution": True, "figure": True},
            ),
        ),
        (["--eval_files=/tmp/*.txt"], ("evaluate", None, {"eval_files": "/tmp/*.txt"})),
        # --generate decodes with BCA unless told otherwise.
        (["--generate", "--prompt=def "], ("generate", "def ", {"mode": "bca"})),
        (["--generate", "--bca=off"], ("generate", "", {"mode": "full"})),
        (
            ["--generate", "--max_new_tokens=7", "--top_k=3", "--top_p=0.5", "--seed=9"],
            ("generate", "", {"max_new_tokens": 7, "top_k": 3, "top_p": 0.5, "seed": 9}),
        ),
        (["--generate", "--temperature=0"], ("generate", "", {"temperature": 0.0})),
        (
            ["--passkey", "--lengths=80", "--passkey_trials=3", "--seed=4", "--bca=off"],
            # The sentence filler reads no documents: max_docs is the API's None, not 20.
            ("passkey", [80], {"trials": 3, "seed": 4, "modes": ("full",), "max_docs": None}),
        ),
        (
            ["--passkey", "--passkey_filler=text", "--max_docs=2", "--passkey_depths=0,0.5"],
            ("passkey", None, {"filler": "text", "max_docs": 2, "depths": [0.0, 0.5]}),
        ),
    ],
)
def test_each_eval_flag_reaches_the_run_it_asks_for(program, capsys, monkeypatch, argv, expected):
    """A flag that passed validation but never reached the run (eval.py handing a
    default on) gave numbers for settings other than those asked, with no error."""
    from lexjax import cli

    calls = []
    monkeypatch.setattr(cli.api, "load", lambda workdir, check=None: _FakeRun(calls))
    code, err = program("eval", ["--workdir=/tmp/lexjax-fuzz", *argv], capsys)
    assert code == 0, err
    ((verb, what, settings),) = calls
    assert (verb, what) == expected[:2]
    assert {k: settings[k] for k in expected[2]} == expected[2], settings


@pytest.mark.parametrize("terminal", [False, True])
def test_generate_shows_progress_only_where_its_text_is_not_on_a_terminal(
    program, capsys, monkeypatch, terminal
):
    """--generate's text streams to stdout: on a terminal it is the progress, and a
    bar redrawn on stderr (the same screen) would write over it; sent to a file or a
    pipe, stdout shows nothing, so stderr shows the progress."""
    from lexjax import cli

    calls = []
    monkeypatch.setattr(cli.api, "load", lambda workdir, check=None: _FakeRun(calls))
    monkeypatch.setattr(sys.stdout, "isatty", lambda: terminal)
    code, err = program("eval", ["--workdir=/tmp/lexjax-fuzz", "--generate"], capsys)
    assert code == 0, err
    assert calls[0][2]["progress"] is (not terminal)


def test_train_py_hands_its_settings_on_and_counts_the_steps_this_run_trained(
    program, capsys, monkeypatch, tmp_path
):
    """--lease_timeout_s reached the training only by name, and ``--config FILE`` (the
    file as the next argument, as absl reads any flag) was an unexpected argument.
    The summary is of the steps this run trained (after a resume from step 6 to 10:
    four), with a next command a shell reads back as the workdir given (a space in it)."""
    from lexjax import cli

    seen, summary = {}, {"start_step": 6, "step": 10, "stopped_by": None}
    summary.update(loss=2.5, val_loss=2.75, checkpoint_dir="/runs/a b/checkpoints")

    def train(config, workdir, **kwargs):
        seen.update(kwargs, workdir=workdir, num_layers=config.model.num_layers)
        return dict(summary)

    monkeypatch.setattr(cli.api, "train", train)
    file = tmp_path / "three.py"
    file.write_text(
        "from lexjax.config import default_configdict\n\n\ndef get_config():\n"
        "    return default_configdict({'model': {'num_layers': 3}})\n"
    )
    argv = ["--workdir=/runs/a b", "--lease_timeout_s=30", "--config", str(file)]
    code, err = program("train", argv, capsys)
    assert code == 0, err
    assert seen == {"lease_timeout_s": 30.0, "workdir": "/runs/a b", "num_layers": 3}
    monkeypatch.setattr(cli.distributed, "initialize", lambda cluster: None)
    config = cfg.default_configdict({"model": {"num_layers": 2}})
    lines = []
    for start in (6, 9, 0, 10):
        summary["start_step"] = start
        assert cli.run_training(config, "runs/a b", None, lease_timeout_s=30.0) == 0
        lines.append(capsys.readouterr().out.splitlines())
    loss, where = "loss 2.5000, validation loss 2.7500", "checkpoint: /runs/a b/checkpoints"
    assert [said[0] for said in lines] == [
        f"trained 4 steps (6 → 10): {loss}",
        f"trained 1 step (9 → 10): {loss}",  # one step is not "already trained"
        f"trained 10 steps: {loss}",
        "already trained 10 steps; checkpoint: /runs/a b/checkpoints",
    ]
    assert [said[1:-1] for said in lines] == [[f"{where} (step 10)"]] * 3 + [[]]
    for said in lines:
        assert shlex.split(said[-1]) == ["next:", "python", "eval.py", "--workdir=runs/a b"]


def test_an_in_process_run_leaves_the_process_as_it_found_it(capsys):
    """eval.py's main sets the lexjax logger to WARNING and absl's verbosity to ERROR
    for its process; run in-process, that outlived the run: a later test's caplog
    saw no lexjax INFO line."""
    import logging

    from absl import logging as absl_logging

    from tests.programs import invoker

    own, root = logging.getLogger("lexjax"), logging.getLogger()
    state = lambda: (own.level, absl_logging.get_verbosity(), root.handlers[:])
    before = state()
    with pytest.MonkeyPatch.context() as patch:
        runs = invoker(patch)
        code, err = next(runs)("eval", ["--workdir=/tmp/lexjax-fuzz", "--max_docs=0"], capsys)
        assert code == 2 and "--max_docs=0" in err
        assert own.level == logging.WARNING  # what eval.py set
        next(runs, None)  # the fixture's teardown
    assert state() == before


@pytest.mark.parametrize(
    "argv, own_only",
    [
        (["train.py", "--help"], True),
        (["train.py", "-h"], True),
        (["eval.py", "--helpfull"], False),
        # absl's other spellings of its help flags: each still exited 1.
        (["train.py", "--help=true"], True),
        (["eval.py", "--helpshort=1"], True),
        (["eval.py", "-helpfull"], False),
        (["train.py", "--helpxml"], "xml"),  # every module's flags, as XML
    ],
)
def test_help_is_printed_on_stdout_with_exit_0(argv, own_only):
    """absl exited 1 after --help (1: a bug, in the exit statuses) and refused -h."""
    done = subprocess.run(
        [sys.executable, *argv], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert (done.returncode, done.stderr) == (0, ""), done.stderr[-2000:]
    if own_only == "xml":
        root = xml.etree.ElementTree.fromstring(done.stdout)
        names = {flag.findtext("name") for flag in root.iter("flag")}
        assert {"workdir", "config", "logtostderr"} <= names, sorted(names)
        return
    assert "--workdir" in done.stdout
    assert ("absl.flags:" not in done.stdout) == own_only  # other modules' flags
    if argv[0] == "train.py":
        assert "--config=FILE[:PRESET]" in done.stdout


@pytest.mark.parametrize(
    "program",
    [["train.py"], ["eval.py"], ["-m", "lexjax.experiments.extrapolation"], ["train.py", "join"]],
    ids=["train", "eval", "study", "train_joining"],
)
def test_a_backend_jax_platforms_names_and_the_machine_lacks_is_one_line(tmp_path, program):
    """It was JAX's traceback, exit 1 (for cuda a bare AssertionError); also where
    joining a multi-process run starts the backend first."""
    if program[-1] == "join":
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        program = [program[0], f"--coordinator_address=127.0.0.1:{port}", "--num_processes=1"]
        program.append("--process_id=0")
    result = subprocess.run(
        [sys.executable, *program, f"--workdir={tmp_path / 'w'}"]
        if program[0] != "-m"
        else [sys.executable, *program, f"--out={tmp_path / 'w'}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "JAX_PLATFORMS": "bogus"},
    )
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr[-2000:]
    assert lines[0].startswith("error: JAX_PLATFORMS=bogus: JAX cannot start that backend here")
    assert lines[0].endswith("; unset JAX_PLATFORMS, or install JAX for that accelerator")
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize(
    "program_args,expected",
    [
        (["train.py", "--config.optim.b2=1.5"], "error: optim.b2=1.5 must be in [0, 1)"),
        (["train.py", "--lease_timeout_s=abc"], "error: flag --lease_timeout_s=abc:"),
        (["eval.py", "--max_doc=3"], "error: Unknown command line flag 'max_doc'"),
        # An argument that is not a flag was ignored: the programs ran on runs/tiny.
        (
            ["eval.py", "runs/x"],
            "error: unexpected argument 'runs/x': flags are --name=value (did you mean "
            "--workdir=runs/x?)",
        ),
        (["train.py", "runs/x"], "error: unexpected argument 'runs/x': flags are"),
        # Refused before the run is loaded (it was exit 6, after loading).
        (
            ["eval.py", "--max_length=48", "--lengths=32"],
            "error: no length can be evaluated as asked: none of --lengths=32 divides "
            "--max_length=48; give lengths that divide it, or a --max_length they divide such "
            "as 32 or 64",  # 32 too: a document of 48 tokens cannot hold 64
        ),
        (["train.py", "--", "--workdir=x"], "error: unexpected argument '--workdir=x': flags"),
        (["eval.py", "--generate", "--top_p=1.5"], "error: --top_p must be in (0, 1], got 1.5"),
        # Named by its flag, with the range --help gives (it was "[1, 16777217)").
        (
            ["eval.py", "--generate", "--max_new_tokens=0"],
            "error: --max_new_tokens=0 must be an integer in [1, 16,777,216]",
        ),
    ],
)
def test_real_programs_spot_checks(tmp_path, program_args, expected):
    result = subprocess.run(
        [sys.executable, *program_args, f"--workdir={tmp_path}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(expected), result.stderr
    assert not list(tmp_path.iterdir())  # nothing written
