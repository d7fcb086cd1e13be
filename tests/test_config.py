"""Configuration: one source of defaults, every field overridable, one-line errors, old configs."""

import contextlib
import json
import os
import pathlib
import re
import subprocess
import sys

import jax
import pytest

from configs import extrapolation, paper, tiny
from lexjax import config as cfg
from lexjax import positions, reports, sharding
from lexjax.experiments import extrapolation as study
from tests.helpers import leaves, small_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STORED_V1 = os.path.join(
    ROOT, "tests", "fixtures", "run_v1", "checkpoints", "6", "config", "metadata"
)


def _python(*args, timeout=120):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, cwd=ROOT, env=env, timeout=timeout
    )


def test_tiny_is_the_defaults_and_presets_validate():
    assert cfg.from_configdict(tiny.get_config()) == cfg.from_configdict({})
    assert cfg.from_configdict({}).learning_rate == 2e-3  # what configs/tiny.py always trained with
    for preset in ("small", "text", "tokens", "retrieval", "paper", "smoke"):
        train = cfg.from_configdict(extrapolation.get_config(preset).train)
        assert train.model.max_len == train.train_len
    big = cfg.from_configdict(paper.get_config())
    assert (big.model.num_layers, big.train_len, big.model.max_len) == (24, 1024, 1024)


@pytest.mark.parametrize(
    "folder, preset",
    [
        ("results", "small"),
        ("results_text", "text"),
        ("results_tokens", "tokens"),
        ("results_retrieval", "retrieval"),
    ],
)
def test_each_published_study_is_what_its_preset_runs(folder, preset):
    """docs/results.md names a preset for each folder of results: the settings the study
    recorded in that folder's results.json are the preset's today, so its command still
    makes those numbers."""
    with open(os.path.join(ROOT, "docs", folder, "results.json"), encoding="utf-8") as f:
        written = json.load(f)
    c = extrapolation.get_config(preset)
    train = cfg.from_configdict(c.train)
    recorded = reports.recorded_settings(train)
    assert written["model"] == recorded["model"]
    assert written["train"] == recorded["train"]
    assert written["train_len"] == train.train_len
    assert written["lengths"] == study.eval_lengths(c.multipliers, train.train_len)
    assert written["documents"] == {"perplexity": c.eval_docs, "resolution": c.resolution_docs}
    assert written["tokenizer"].split()[0] == train.data.tokenizer
    passkey = written["passkey"]
    assert passkey["trials"] == c.passkey_trials
    assert passkey["modes"] == c.passkey_modes.split(",")
    assert passkey["depths"] == [float(x) for x in c.passkey_depths.split(",")]
    assert passkey["lengths"] == study.eval_lengths(c.passkey_multipliers, train.train_len)
    specs = study.parse_runs(c.runs, scale_base=train.model.scale_base, seed=train.seed)
    assert sorted(r["name"] for r in written["runs"]) == sorted(spec.name for spec in specs)


def test_paper_states_only_what_differs():
    defaults = dict(leaves(cfg.to_dict(cfg.Config())))
    for name, value in leaves(paper.OVERRIDES):
        assert defaults[name] != value, f"configs/paper.py restates the default {name}={value!r}"


def test_every_field_is_overridable_from_the_command_line():
    """Each leaf of the ConfigDict gets a non-default value on the command line, also the
    None-default ones, with a config file (paper.py) that mentions only some of them."""
    flags, expected = [], {}
    for name, value in leaves(cfg.default_configdict().to_dict()):
        if name == "sharding_rules":  # a table, set in config files
            continue
        hint = cfg._base_type(_hint(name))
        new = {bool: not value, int: 7, float: 1.5, str: "zzz"}[hint]
        flags.append(f"--config.{name}={new}")
        expected[name] = new
    program = (
        "import json, sys; from absl import flags; from lexjax import config; "
        "config.flags_parser('configs/tiny.py')(sys.argv); "
        "print(json.dumps(flags.FLAGS.config.to_dict()))"
    )
    result = _python("-c", program, "--config=configs/paper.py", *flags)
    assert result.returncode == 0, result.stderr
    parsed = dict(leaves(json.loads(result.stdout)))
    assert {name: parsed[name] for name in expected} == expected


def _hint(dotted: str):
    import typing

    cls, *path = cfg.Config, *dotted.split(".")
    for name in path[:-1]:
        cls = typing.get_type_hints(cls)[name]
    return typing.get_type_hints(cls)[path[-1]]


@pytest.mark.parametrize(
    "flag,expected",
    [
        (
            "--config.model.postion=rope",
            "unknown config field model.postion; did you mean model.position?",
        ),
        # A field under a section it is not in: the hint was "did you mean train_len?",
        # and train_len.num_train_steps then had no hint at all.
        (
            "--config.train.num_train_steps=3",
            "unknown config field train.num_train_steps; did you mean num_train_steps?",
        ),
        # Under a section that exists, where the field is top-level: it was "did you mean
        # optim.end_lr_fraction?".
        (
            "--config.optim.learning_rate=1e-3",
            "unknown config field optim.learning_rate; did you mean learning_rate?",
        ),
        ("--config=configs/nope.py", "--config=configs/nope.py: there is no file configs/nope.py"),
        ("--config.batch_size=abc", "flag --config.batch_size=abc: invalid literal for int()"),
        # It ended in absl's tuple "('Non-boolean argument to boolean flag', 'maybe')".
        (
            "--config.model.remat=maybe",
            "flag --config.model.remat=maybe: a switch is true or false (--config.model.remat, "
            "--noconfig.model.remat or --config.model.remat=false)",
        ),
        (  # It was a ValueError traceback, exit 1.
            "--noconfig.model.remat=true",
            "flag --noconfig.model.remat=true: --noconfig.model.remat takes no value; give "
            "--noconfig.model.remat or --config.model.remat=false",
        ),
        ("--config.optim.weight_decay=nan", "optim.weight_decay=nan: expected a finite number"),
        # A field without --config.: absl suggested another flag ("Did you mean:
        # num_processes ?"), which a user then tried.
        (
            "--num_train_steps=3",
            "unknown flag --num_train_steps: config fields are set as --config.FIELD "
            "(did you mean --config.num_train_steps=3?)",
        ),
        (
            "--d_model=64",
            "unknown flag --d_model: config fields are set as --config.FIELD "
            "(did you mean --config.model.d_model=64?)",
        ),
        ("--num_procesess=2", "Unknown command line flag 'num_procesess'. Did you mean"),
    ],
)
def test_command_line_config_errors_are_one_line_exit_2(tmp_path, flag, expected, program, capsys):
    code, err = program("train", [f"--workdir={tmp_path}", flag], capsys)
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {expected}"), err


def test_a_config_error_reaches_the_shell_as_one_line_exit_2(tmp_path):
    """The tests around this one run train.py in-process; a real process shows the
    status and the line reach the shell."""
    result = _python("train.py", f"--workdir={tmp_path}", "--config.model.postion=rope")
    assert result.returncode == 2, result.stderr
    said = "error: unknown config field model.postion; did you mean model.position?\n"
    assert result.stderr == said


@pytest.mark.parametrize(
    "text,suffix,expected",
    [
        ("x = 1\n", "", "{file} defines no get_config()"),
        ("def get_config():\n    return {\n", "", "{file} line 2: '{{' was never closed"),
        ("def get_config():\n    return 1\n", ":small", "{file} has no presets; drop ':small'"),
        # Its own exceptions were tracebacks, exit 1 (a bug's), only a SyntaxError one line.
        ("import nonexistent_mod\n", "", "{file} line 1: ModuleNotFoundError: No module named"),
        ("def get_config():\n    return 1 / 0\n", "", "{file} line 2: ZeroDivisionError: div"),
        (None, "", "{file} is a directory; name a config file in it"),
        (
            "def get_config():\n    return {'train_len': 32}\n",
            "",
            "get_config() returned a dict, not a ConfigDict; start from "
            "lexjax.config.default_configdict()",
        ),
    ],
)
def test_a_bad_config_file_is_one_line_exit_2(tmp_path, text, suffix, expected, program, capsys):
    file = tmp_path / "config.py"
    if text is None:
        file.mkdir()
    else:
        file.write_text(text)
    code, err = program("train", [f"--workdir={tmp_path}/w", f"--config={file}{suffix}"], capsys)
    assert code == 2, err
    expected = f"error: --config={file}{suffix}: " + expected.format(file=file)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(expected), err
    assert not os.path.exists(tmp_path / "w")


def test_a_config_for_another_program_or_no_regular_file_is_named_so(tmp_path, program, capsys):
    """The study's config given to train.py named its first field as a typo ("unknown
    config field eval_docs; did you mean eval_batches?"), and /dev/null was "no file"."""
    study_file = os.path.join(ROOT, "configs", "extrapolation.py")
    like = "; name a config like " + os.path.relpath(os.path.join(ROOT, "configs", "tiny.py"))
    for path, expected in [
        (study_file, "none of its fields is one of this program's (a config for another "),
        (f"{study_file}:small", "none of its fields is one of this program's (a config for "),
        (os.devnull, f"{os.devnull} is not a regular file; name a config file\n"),
    ]:
        code, err = program("train", [f"--workdir={tmp_path}/w", f"--config={path}"], capsys)
        assert code == 2, err
        assert err.startswith(f"error: --config={path}: {expected}") and err.count("\n") == 1
        assert (like in err) == (path != os.devnull), err
    # A bare --config (last, or "=" with nothing) was "--config=: there is no file ".
    tiny = os.path.relpath(os.path.join(ROOT, "configs", "tiny.py"))
    for given in (["--config"], ["--config="], ["--config= "]):
        code, err = program("train", [f"--workdir={tmp_path}/w", *given], capsys)
        assert (code, err) == (
            2,
            f"error: --config needs a file: give --config=FILE[:PRESET], such as "
            f"--config={tiny}, or leave --config out\n",
        )
    assert not os.path.exists(tmp_path / "w")


def test_a_workdir_under_the_home_directory_is_expanded(tmp_path, monkeypatch):
    """A shell expands no ``~`` after ``--workdir=``: train.py made a directory named
    ``~`` in the current one, which invites an ``rm -rf ~``."""
    monkeypatch.setenv("HOME", str(tmp_path))
    assert cfg.check_path("workdir", "~/runs/a") == str(tmp_path / "runs" / "a")
    assert cfg.check_path("workdir", pathlib.Path("~")) == str(tmp_path)
    # Blank is empty too: "--workdir= " made a run directory named " ", unseen in `ls`.
    with pytest.raises(cfg.ConfigError, match="^workdir is empty; give a path$"):
        cfg.check_path("workdir", " \t")


def test_the_data_paths_take_a_pathlib_path_and_other_strings_do_not(tmp_path, monkeypatch):
    """A notebook's ``pathlib.Path`` for the corpus was "expected a string" (the API's
    workdir and out_dir take one): the data's path fields take it as its absolute
    string, ``~`` expanded; a field that is not a path still wants a string."""
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    config = cfg.from_configdict(
        {
            "data": {"name": "textfiles", "files": pathlib.Path("corpus/*.txt")},
            "data.validation_files": pathlib.Path("held/v.txt"),
            "data.test_files": pathlib.Path("~/t.txt"),
            "data.data_dir": pathlib.Path("built"),
        }
    )
    d = config.data
    assert d.files == str(tmp_path / "corpus" / "*.txt")
    assert (d.validation_files, d.test_files, d.data_dir) == (
        str(tmp_path / "held" / "v.txt"),
        str(tmp_path / "t.txt"),
        str(tmp_path / "built"),
    )
    with pytest.raises(cfg.ConfigError, match="^model.position=PosixPath.*expected a string$"):
        cfg.from_configdict({"model.position": pathlib.Path("xpos")})


def test_unknown_field_in_a_dict_names_the_closest():
    with pytest.raises(
        cfg.ConfigError,
        match=r"unknown config field optim\.weight_decy; did you mean optim\.weight_decay\?",
    ):
        cfg.from_configdict({"optim": {"weight_decy": 0.1}})


@pytest.mark.parametrize(
    "values,message",
    [
        ({"train_len": 64, "model": {"max_len": 32}}, "model.max_len=32 is below train_len=64"),
        ({"model": {"vocab_size": 257}}, "model.vocab_size=257 is below the bytes tokenizer's 258"),
        (
            {
                "data": {"tokenizer": "sentencepiece", "vocab_size": 2048},
                "model": {"vocab_size": 1024},
            },
            "model.vocab_size=1024 is below the sentencepiece tokenizer's 2048 ids",
        ),
        ({"data": {"tokenizer": "wordpiece"}}, "data.tokenizer='wordpiece': use bytes or"),
        (
            {"data": {"tokenizer": "sentencepiece", "vocab_size": 100}},
            "data.vocab_size=100 is too small for sentencepiece",
        ),
        # Its trainer failed after the corpus build: cannot parse "2147483648" as int.
        (
            {"data": {"tokenizer": "sentencepiece", "vocab_size": 2**31}},
            "data.vocab_size=2147483648 is beyond sentencepiece's 2^31 - 1",
        ),
        ({"peak_flops": 0}, "peak_flops=0.0 must be positive"),
        ({"batch_size": 1.5}, "batch_size=1.5: expected an integer"),
        # A switch written as text (a notebook, a YAML file) is not read as bool("False").
        (
            {"model": {"tie_embeddings": "False"}},
            "model.tie_embeddings='False': expected True or False",
        ),
        ({"model": {"rope_scaling": "linear"}}, "model.rope_scaling='linear': choose one of"),
        (
            {"model": {"rope_scaling": "pi", "position": "alibi"}},
            "model.rope_scaling=pi extends a rotary encoding",
        ),
        (
            {"model": {"rope_scaling": "yarn", "position": "xpos_norotate"}},
            "position xpos_norotate has no rotation to scale",
        ),
        (
            {"model": {"rope_scaling": "pi", "rope_factor": 0.5}},
            "model.rope_factor=0.5 must be ≥ 1, or 0",
        ),
        ({"model": {"rope_factor": 2}}, "model.rope_factor=2 needs a scaling"),
        (
            {"model": {"rope_scaling": "dynamic_ntk", "rope_factor": 2}},
            "does not apply to dynamic_ntk",
        ),
        ({"model": {"rope_train_len": 0}}, "model.rope_train_len=0 must be positive"),
        ({"optim": {"grad_clip": float("nan")}}, "optim.grad_clip=nan: expected a finite number"),
        ({"learning_rate": float("inf")}, "learning_rate=inf: expected a finite number"),
        ({"peak_flops": float("nan")}, "peak_flops=nan: expected a finite number"),
        # Refused by make_config, not only once training builds the mesh.
        ({"sharding": "bogus"}, "sharding='bogus': choose one of data, fsdp, tensor"),
        ({"mesh": {"data": -5}}, "mesh.data=-5: use a positive size or -1"),
        ({"mesh": {"data": -1, "fsdp": -1}}, "at most one of mesh.data/fsdp/tensor may be -1"),
        ({"mesh": {"data": -1, "tensor": -1}}, "got mesh.data=-1 and mesh.tensor=-1; set the"),
        # One message named neither, nor the value given.
        ({"warmup_steps": -1}, "warmup_steps=-1 must be ≥ 0 (0: no warmup)"),
        ({"optim": {"grad_accum_steps": 0}}, "optim.grad_accum_steps=0 must be ≥ 1 (1: none)"),
        # Accepted, then a NaN loss at step 1 with advice to lower the learning rate.
        (
            {"model": {"position": "rope", "theta": 1e-300}},
            "model.theta=1e-300 turns rotary angles past float32's range (about 1e293 radians "
            "by position 256); use theta ≥ 1",
        ),
    ],
)
def test_bad_values_are_rejected(values, message):
    with pytest.raises(cfg.ConfigError, match=re.escape(message)):
        cfg.from_configdict(values)


def test_rope_scalings_and_their_training_length():
    assert cfg.ROPE_SCALINGS == positions.ROPE_SCALINGS  # the same list on both sides
    assert cfg.from_configdict({"train_len": 64}).model.rope_train_len == 64
    config = cfg.from_configdict({"model": {"rope_scaling": "yarn", "rope_train_len": 32}})
    assert (config.model.rope_scaling, config.model.rope_train_len) == ("yarn", 32)


def test_max_len_follows_train_len_unless_larger():
    assert cfg.from_configdict({"train_len": 64}).model.max_len == 64
    assert cfg.from_configdict({"train_len": 64, "model": {"max_len": 96}}).model.max_len == 96


@pytest.mark.parametrize(
    "data,expected",
    [
        ({}, 320),
        ({"tokenizer": "sentencepiece", "vocab_size": 2048}, 2048),
        ({"tokenizer": "sentencepiece", "vocab_size": 2000}, 2048),
    ],
)
def test_model_vocab_follows_the_tokenizer_padded_to_64(data, expected):
    """258 byte ids → 320 rows (5 × 64); a SentencePiece vocabulary rounds up to 64s."""
    assert cfg.from_configdict({"data": data}).model.vocab_size == expected
    assert "vocab_size" not in tiny.get_config().to_dict()["model"] or (
        tiny.get_config().model.vocab_size is None
    )
    assert "vocab_size" not in paper.OVERRIDES["model"]


def test_tokenizer_vocab_constant_matches_the_tokenizer():
    from lexjax.data import tokenizer

    assert cfg.TOKENIZER_VOCAB_SIZE == tokenizer.VOCAB_SIZE


def test_config_imports_no_compute_code():
    result = _python(
        "-c", "import sys, lexjax.config; print(sorted({'jax', 'flax'} & set(sys.modules)))"
    )
    assert result.stdout.strip() == "[]", result.stderr


def test_config_stored_by_an_older_lexjax_loads_with_a_note(capsys):
    with open(STORED_V1) as f:
        stored = json.load(f)
    config = cfg.from_configdict(stored)
    assert capsys.readouterr().err == "note: ignoring config field poison_step of an older lexjax\n"
    assert (config.train_len, config.model.max_len, config.model.d_model) == (32, 32, 16)
    now = cfg.to_dict(config)
    # Fields added since take their defaults; the stored ones keep their values.
    assert now["data"] | stored["data"] == now["data"]
    assert now["data"]["tokenizer"] == "bytes" and now["model"]["vocab_size"] == 320
    # model.remat (a bool then) is now model.remat_policy: False → none, True → full.
    assert stored["model"].pop("remat") is False
    assert (now["model"].pop("remat"), now["model"].pop("remat_policy")) == (None, "none")
    # The RoPE extensions came later: none, and the stored run's train_len to extend.
    rope = [now["model"].pop(k) for k in ("rope_scaling", "rope_factor", "rope_train_len")]
    assert rope == ["none", 0.0, 32]
    assert {k: v for k, v in stored.items() if k not in ("poison_step", "data")} == {
        k: v for k, v in now.items() if k not in ("peak_flops", "data")
    }
    stored["model"]["remat"] = True
    assert cfg.from_configdict(stored).model.remat_policy == "full"


def test_remat_bool_maps_to_a_policy_and_a_contradiction_is_one_line():
    assert cfg.from_configdict({"model": {"remat": True}}).model.remat_policy == "full"
    assert cfg.from_configdict({"model": {"remat": False}}).model.remat_policy == "none"
    both = {"remat": True, "remat_policy": "dots_except_mlp"}
    with pytest.raises(cfg.ConfigError, match="contradicts model.remat_policy=dots_except_mlp"):
        cfg.from_configdict({"model": both})
    with pytest.raises(cfg.ConfigError, match="choose one of none, full, dots_except_mlp"):
        cfg.from_configdict({"model": {"remat_policy": "dots"}})


def test_mesh_shape_fills_one_axis_and_checks_the_product():
    assert sharding.mesh_shape(cfg.MeshConfig(data=-1, fsdp=2), 8) == (4, 2, 1)
    assert sharding.mesh_shape(cfg.MeshConfig(data=2, fsdp=2, tensor=2), 8) == (2, 2, 2)
    for mesh, message in [
        (cfg.MeshConfig(data=-1, fsdp=-1), "at most one of"),
        (cfg.MeshConfig(tensor=3), "cannot fill 8 devices"),
        (cfg.MeshConfig(data=2), "but there are 8 devices"),
        (cfg.MeshConfig(fsdp=0), "mesh.fsdp=0"),
    ]:
        with pytest.raises(cfg.ConfigError, match=message):
            sharding.mesh_shape(mesh, 8)


def test_rules_are_the_preset_with_overrides():
    config = cfg.from_configdict({"sharding": "fsdp", "sharding_rules": {"mlp": "tensor"}})
    table = dict(sharding.rules(config))
    assert table["embed"] == "fsdp" and table["mlp"] == "tensor" and table["heads"] is None
    with pytest.raises(cfg.ConfigError, match="sharding='fdsp': choose one of data, fsdp, tensor"):
        sharding.rules(cfg.from_configdict({"sharding": "fdsp"}))


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (simulated) devices")
@pytest.mark.parametrize(
    "preset, mesh, d_model, mlp, heads, batch",
    [  # the block of each weight a device holds, and the parts a batch of 8 rows is cut in
        ("data", dict(data=8), 32, 64, 4, 8),  # whole weights, rows over every device
        ("fsdp", dict(data=2, fsdp=4), 8, 64, 4, 8),  # d_model over fsdp, rows over all 8
        ("tensor", dict(data=2, fsdp=2, tensor=2), 16, 32, 2, 4),  # heads, mlp over tensor
    ],
)
def test_each_preset_shards_the_weights_and_the_batch_as_its_kind_of_parallelism(
    preset, mesh, d_model, mlp, heads, batch
):
    """Data parallel keeps every weight whole; FSDP splits d_model over fsdp; tensor
    parallel also splits the MLP's hidden units and the heads over tensor (Megatron);
    the batch is split over every axis but tensor (one copy of a step per data shard).
    A model of d_model 32, 4 heads of 8, MLP 64 (small_config)."""
    config = small_config(sharding=preset, **{f"mesh.{k}": v for k, v in mesh.items()})
    mesh = sharding.make_mesh(config)
    params = sharding.model_param_shardings(config, mesh)["layer_0"]
    assert params["mlp_in"]["kernel"].shard_shape((32, 64)) == (d_model, mlp)
    assert params["mlp_out"]["kernel"].shard_shape((64, 32)) == (mlp, d_model)
    assert params["attention"]["query"]["kernel"].shard_shape((32, 4, 8)) == (d_model, heads, 8)
    batch_sharding = sharding.batch_sharding(mesh, sharding.rules(config))
    assert batch_sharding.shard_shape((8, 16)) == (8 // batch, 16)


@pytest.mark.parametrize(
    "rules,message",
    [
        (
            {"mlp": "tensr"},
            "sharding_rules['mlp']: mesh axis 'tensr' is unknown; did you mean 'tensor'?",
        ),
        ({"mpl": "tensor"}, "sharding_rules: logical axis 'mpl' is unknown; did you mean 'mlp'?"),
        ({"embed": ["data", "x"]}, "mesh axis 'x' is unknown; use one of data, fsdp, tensor"),
        (5, "sharding_rules=5: expected a table such as {'mlp': 'tensor'}"),
        # A JAX DuplicateSpecError traceback when the parameters were sharded.
        (
            {"heads": ["tensor", "tensor"]},
            "sharding_rules['heads']=['tensor', 'tensor'] names mesh axis 'tensor' twice",
        ),
    ],
)
def test_sharding_rules_name_known_axes(rules, message):
    """Checked with the config, not when the mesh is built (a misspelt logical axis
    would silently shard nothing)."""
    with pytest.raises(cfg.ConfigError, match=re.escape(message)):
        cfg.from_configdict({"sharding_rules": rules})
    for table in sharding.SHARDING_PRESETS.values():
        assert set(table) <= set(cfg.LOGICAL_AXES)


def test_check_mesh_needs_the_batch_and_model_to_divide():
    config = cfg.from_configdict({"batch_size": 6, "mesh": {"data": 4}})
    with pytest.raises(cfg.ConfigError, match="batch_size/grad_accum_steps = 6 is not divisible"):
        sharding.check_mesh(config, 4)
    # Advice that works when followed: "change the mesh" led to two more refusals, and
    # "change optim.grad_accum_steps" cannot help 6 rows on 4 shards. (A resumed run
    # keeps its batch_size: grad_accum_steps or the devices are what it can change.)
    advice = "use batch_size=8 (a new run only), or fewer devices (or give some to mesh.tensor)"
    with pytest.raises(cfg.ConfigError, match=re.escape(advice) + "$"):
        sharding.check_mesh(config, 4)
    config = cfg.from_configdict(
        {"batch_size": 48, "mesh": {"data": 8}, "optim": {"grad_accum_steps": 4}}
    )
    with pytest.raises(
        cfg.ConfigError, match=r"use optim\.grad_accum_steps=3, or batch_size=64 \("
    ):
        sharding.check_mesh(config, 8)
    for accum, batch in ((3, 48), (1, 64)):  # what it advised fits
        good = {"batch_size": batch, "mesh": {"data": 8}, "optim": {"grad_accum_steps": accum}}
        sharding.check_mesh(cfg.from_configdict(good), 8)
    config = cfg.from_configdict({"model": {"num_heads": 2, "d_model": 64}, "mesh": {"tensor": 4}})
    with pytest.raises(cfg.ConfigError, match="model heads size 2 is not divisible"):
        sharding.check_mesh(config, 4)
    # A rule the config overrides is checked too (it was an IndivisibleError traceback).
    config = cfg.from_configdict(
        {"model": {"d_model": 48}, "mesh": {"tensor": 8}, "sharding": "data"}
        | {"sharding_rules": {"kv": "tensor"}}
    )
    with pytest.raises(cfg.ConfigError, match=r"model kv size 12 is not divisible .* of size 8"):
        sharding.check_mesh(config, 8)
    config = cfg.from_configdict(
        {"batch_size": 4, "mesh": {"tensor": 8}, "sharding": "data"}
        | {"sharding_rules": {"batch": "tensor"}}
    )
    with pytest.raises(cfg.ConfigError, match=r"= 4 is not divisible by mesh tensor = 8"):
        sharding.check_mesh(config, 8)
    # Per process, the batch a step takes (it said "batch_size=8 is not divisible by the 4
    # processes", of a batch_size 4 divides).
    config = cfg.from_configdict(
        {"batch_size": 8, "optim": {"grad_accum_steps": 4}, "mesh": {"data": 1, "tensor": 4}}
        | {"model": {"d_model": 32, "num_heads": 4, "mlp_dim": 64}, "sharding": "tensor"}
    )
    said = "batch_size/grad_accum_steps = 2 is not divisible by the 4 processes"
    with pytest.raises(cfg.ConfigError, match=re.escape(said)):
        sharding.check_mesh(config, 4, num_processes=4)


@pytest.mark.parametrize("preset", ["data", "fsdp"])
def test_a_training_mesh_axis_no_rule_uses_is_refused(preset):
    """mesh.tensor=2 under a preset that shards nothing over tensor trained, exit 0, with
    half the devices repeating the other half's work. Evaluation re-fits a stored mesh
    without this check (a run may have trained so)."""
    config = cfg.from_configdict({"sharding": preset, "mesh": {"data": -1, "tensor": 2}})
    said = f"mesh.tensor=2 under sharding='{preset}' shards nothing (no rule names 'tensor')"
    with pytest.raises(cfg.ConfigError, match=re.escape(said)):
        sharding.check_mesh(config, 8)
    assert sharding.check_mesh(config, 8, check_batch=False) == (4, 1, 2)
    tensor = cfg.from_configdict({"sharding": "tensor", "mesh": {"data": -1, "tensor": 2}})
    assert sharding.check_mesh(tensor, 8) == (4, 1, 2)


def test_a_changed_model_is_named_by_the_field_the_user_sets():
    def config(**overrides):
        return small_config(**{"model.max_len": None, **overrides})

    stored = cfg.to_dict(config())
    assert cfg.model_differences(stored, config(**{"model.remat_policy": "full"})) == []
    assert cfg.model_differences(stored, config(**{"model.dtype": "bfloat16"})) == []
    assert cfg.model_differences(stored, config(**{"model.param_dtype": "bfloat16"})) == []
    # model.max_len and model.rope_train_len follow train_len: name train_len.
    assert cfg.model_differences(stored, config(train_len=32)) == ["train_len"]
    assert cfg.model_differences(stored, config(**{"model.max_len": 32})) == ["model.max_len"]
    assert cfg.model_differences(stored, config(**{"model.d_model": 64})) == ["model.d_model"]
    assert cfg.model_differences({"seed": 0}, config(train_len=32)) == []  # no model stored
    # A field added since (absent from an older lexjax's record) takes its default, a
    # derived one follows its source: not "differs in model.rope_factor, model.max_len".
    older = cfg.to_dict(config())
    for added in ("rope_scaling", "rope_factor", "rope_train_len", "max_len"):
        del older["model"][added]
    assert cfg.model_differences(older, config()) == []
    assert cfg.model_differences(older, config(**{"model.d_model": 64})) == ["model.d_model"]


def test_a_changed_model_is_said_with_the_value_to_resume_with():
    """The refusal said only "differs in model.d_model": a user who forgot the value
    the run was trained with had no way to learn it from the message."""
    stored = cfg.to_dict(small_config(**{"model.max_len": None}))
    d_model = stored["model"]["d_model"]
    changed = small_config(**{"model.max_len": None, "model.d_model": 2 * d_model})
    assert cfg.model_changes(stored, changed) == [
        f"model.d_model is {d_model} there, {2 * d_model} here"
    ]
    train_len = stored["train_len"]
    changed = small_config(**{"model.max_len": None, "train_len": 2 * train_len})
    assert cfg.model_changes(stored, changed) == [
        f"train_len is {train_len} there, {2 * train_len} here"
    ]
    older = cfg.to_dict(small_config(**{"model.max_len": None, "model.position": "rope"}))
    del older["model"]["max_len"]  # an older lexjax's record: the default follows train_len
    assert cfg.model_changes(older, small_config(**{"model.max_len": None})) == [
        "model.position is rope there, xpos here"
    ]


def test_dotted_field_names_as_the_flags_and_messages_write_them():
    """``make_config({"model.num_layers": 1})`` was "unknown config field
    model.num_layers; known: model, data, …", though every message names fields so."""
    config = cfg.from_configdict(
        {"model.num_layers": 1, "model": {"d_model": 64}, "optim.learning_rate": 0.01}
    )
    assert (config.model.num_layers, config.model.d_model, config.learning_rate) == (1, 64, 0.01)
    # A field named on its own overrides the same field in its section, as a
    # --config.model.num_layers flag overrides a config file's model section.
    both = {"model": {"num_layers": 2, "d_model": 64}, "model.num_layers": 1}
    assert cfg.from_configdict(both).model.num_layers == 1
    with pytest.raises(cfg.ConfigError, match="^unknown config field model.num_layer; did you"):
        cfg.from_configdict({"model.num_layer": 1})
    # A name below a field that is not a section: as the flags say it, not "expected an integer".
    with pytest.raises(cfg.ConfigError, match="^unknown config field train_len.x$"):
        cfg.from_configdict({"train_len.x": 1})


@pytest.mark.parametrize(
    "path,hint",
    [
        # The shared "model." made model.rope_factor the closest name to model.dropout.
        ("model.dropout", "; known: model."),
        ("model.rope_factr", "; did you mean model.rope_factor?"),
        # Near a name in no section: optim.learning_rat had no hint.
        ("optim.learning_rat", "; did you mean learning_rate?"),
        # The start of a name, in this section or another.
        ("model.pos", "; did you mean model.position?"),
        ("optim.warmup", "; did you mean warmup_steps?"),
        ("model.num", "; did you mean model.num_heads or model.num_layers?"),  # each
    ],
)
def test_a_misspelt_flag_is_matched_by_its_own_name_not_its_section(path, hint):
    with pytest.raises(cfg.ConfigError) as raised:
        cfg._check_field(cfg.default_configdict(), path)
    assert str(raised.value).startswith(f"unknown config field {path}{hint}"), raised.value


def test_an_older_lexjaxs_field_names_still_load():
    """Until 2026-11-30 the peak rate and warmup were optim fields; checkpoints of then
    (and dicts written for then) were refused: "unknown config field
    optim.learning_rate; did you mean optim.end_lr_fraction?"."""
    old = {"optim": {"learning_rate": 0.01, "warmup_steps": 3, "b2": 0.9}, "poison_step": -1}
    config = cfg.from_configdict(old)
    assert (config.learning_rate, config.warmup_steps, config.optim.b2) == (0.01, 3, 0.9)
    both = {"learning_rate": 0.02, "optim": {"learning_rate": 0.01}}
    assert cfg.from_configdict(both).learning_rate == 0.02  # the new name wins
    assert old["optim"]["learning_rate"] == 0.01 and "poison_step" in old  # not changed


def test_an_error_line_keeps_its_advice_after_long_paths(capsys):
    """The advice comes last, after paths: a 300-character cut removed it where the
    paths were long (CI's pytest directories were enough)."""
    from lexjax import errors

    path = "/very/long/directory" * 20
    message = f"data.data_dir={path}: cannot create {path}/x (Read-only file system); choose …"

    def program():
        raise errors.DataError(message)

    assert errors.report(program) == 3
    assert capsys.readouterr().err == f"error: {message}\n"


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts /proc/self/fd")
def test_a_failed_stdout_and_stderr_leave_no_descriptor_open(monkeypatch):
    """Each failure pointed the stream at /dev/null through a descriptor it never
    closed: two leaked per failed stdout and stderr."""
    from lexjax import errors

    def closed_pipe():
        read, write = os.pipe()
        os.close(read)
        return open(write, "w")

    before = len(os.listdir("/proc/self/fd"))
    for _ in range(3):
        out, err = closed_pipe(), closed_pipe()
        monkeypatch.setattr(sys, "stdout", out)
        monkeypatch.setattr(sys, "stderr", err)
        with errors.stdout_failures(to_stderr=True):
            print("step 1/2", flush=True)
            print("step 2/2", flush=True)
        for stream in (out, err):
            with contextlib.suppress(OSError):
                stream.close()
    monkeypatch.undo()
    assert len(os.listdir("/proc/self/fd")) == before


def test_a_closed_stdout_sends_a_trainings_lines_to_stderr_then_nowhere(monkeypatch, request):
    """train.py's stdout (errors.stdout_failures(to_stderr=True)): the lines since the
    last flush and every later one go to stderr; should stderr fail too, nowhere."""
    import io

    from lexjax import errors

    def stream(fd, **kwargs):  # closed when the test ends (else ResourceWarnings)
        f = open(fd, "w", **kwargs)  # noqa: SIM115

        def close():
            with contextlib.suppress(OSError):  # a broken pipe's last flush
                f.close()

        request.addfinalizer(close)
        return f

    def closed_pipe():
        read, write = os.pipe()
        os.close(read)
        return stream(write)

    err = io.StringIO()
    monkeypatch.setattr(sys, "stdout", closed_pipe())
    monkeypatch.setattr(sys, "stderr", err)
    with errors.stdout_failures(to_stderr=True):
        print("model: 0.02 M parameters")
        print("step 1/2", flush=True)
        print("step 2/2")
    note = "stdout failed (Broken pipe); printing to stderr from here on\n"
    assert err.getvalue() == note + "model: 0.02 M parameters\nstep 1/2\nstep 2/2\n"
    monkeypatch.setattr(sys, "stdout", closed_pipe())
    monkeypatch.setattr(sys, "stderr", closed_pipe())
    with errors.stdout_failures(to_stderr=True):
        print("step 1/2", flush=True)
        print("step 2/2", flush=True)
    # Lines a line-buffered stdout delivered before its reader went are not repeated.
    read, write = os.pipe()
    err = io.StringIO()
    monkeypatch.setattr(sys, "stdout", stream(write, buffering=1))
    monkeypatch.setattr(sys, "stderr", err)
    with errors.stdout_failures(to_stderr=True):
        print("step 1/3")
        os.close(read)
        print("step 2/3")
    assert err.getvalue() == note + "step 2/3\n"
    # A block-buffered pipe (train.py | tee): each line goes as it is written, so none
    # is repeated on stderr or lost past a buffer's worth (a guess at the pending lines
    # repeated some and lost others).
    read, write = os.pipe()
    err = io.StringIO()
    monkeypatch.setattr(sys, "stdout", stream(write))
    monkeypatch.setattr(sys, "stderr", err)
    lines = [f"step {i}/401 loss 1.234 tokens/s 12,345 eta 10s".ljust(49) for i in range(401)]
    with errors.stdout_failures(to_stderr=True):
        for line in lines[:400]:
            print(line)
        got = os.read(read, 1 << 20).decode()
        os.close(read)
        print(lines[400])
    assert got == "".join(f"{line}\n" for line in lines[:400])
    assert err.getvalue() == f"{note}{lines[400]}\n"
    # An error: the lines a buffer held still reach stderr, before the error's line.
    err = io.StringIO()
    monkeypatch.setattr(sys, "stdout", closed_pipe())
    monkeypatch.setattr(sys, "stderr", err)
    with pytest.raises(errors.DataError), errors.stdout_failures(to_stderr=True):
        print("step 1/2")
        raise errors.DataError("the corpus is gone")
    assert err.getvalue() == note + "step 1/2\n"
    # eval.py's stdout, whose lines are the product: a quiet exit.
    monkeypatch.setattr(sys, "stdout", closed_pipe())
    with pytest.raises(errors.StdoutClosed), errors.stdout_failures():
        print("| mode | 256 |", flush=True)


def test_an_interrupt_or_error_during_a_progress_bar_starts_a_line_of_its_own(monkeypatch):
    """On a terminal the bar is one line redrawn in place, ended by its close: a Ctrl-C
    or an error between two redraws printed its line after the bar's, on the same line."""
    import io

    from lexjax import errors
    from lexjax.progress import Progress

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    monkeypatch.setattr(sys, "excepthook", sys.excepthook)  # report() quiets it on Ctrl-C
    for raised, last in (
        (KeyboardInterrupt(), "interrupted (Ctrl-C)"),
        (errors.DataError("the corpus is gone; build it again"), "error: the corpus is gone; "),
    ):
        terminal = Terminal()
        monkeypatch.setattr(sys, "stderr", terminal)

        def program(raised=raised):
            Progress(10, label="tokens").update(3, "bca 16")
            raise raised

        with contextlib.suppress(KeyboardInterrupt):
            errors.report(program)
        lines = terminal.getvalue().split("\n")
        assert lines[0].startswith("\r[#########") and "tokens 3/10 bca 16" in lines[0]
        assert lines[1].startswith(last) and lines[2:] == [""], lines
    # A bug's traceback (printed by Python after report() re-raises) starts a line too.
    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)

    def buggy():
        Progress(10, label="tokens").update(3, "bca 16")
        raise ValueError("a bug")

    with pytest.raises(ValueError):
        errors.report(buggy)
    assert terminal.getvalue().endswith(" \n") and terminal.getvalue().count("\n") == 1
    # A bar already closed adds no empty line.
    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    bar = Progress(10, label="tokens")
    bar.update(10)
    bar.close()
    errors.report(lambda: (_ for _ in ()).throw(errors.DataError("gone")))
    assert terminal.getvalue().split("\n")[1:] == ["error: gone", ""]


def test_a_shorter_progress_line_leaves_nothing_of_the_longer_one_on_the_screen(monkeypatch):
    """Redrawn in place, a line shorter than the one before (a rate one digit shorter)
    left the end of that line on the screen: "... 999 tok/s eta 0s ta 0s"."""
    import io

    from lexjax.progress import Progress

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    terminal = Terminal()
    bar = Progress(100, label="step", stream=terminal)
    bar.update(50, "loss 2.345 1,234,567 tok/s")
    bar.update(51, "loss 2.344 999 tok/s")
    screen = ""  # what a terminal shows: each carriage return writes from column 0 again
    for part in terminal.getvalue().split("\r"):
        screen = part + screen[len(part) :]
    assert re.fullmatch(r"\[#+-+\] step 51/100 loss 2\.344 999 tok/s eta \d+s *", screen), screen


def test_refused_by_names_whose_file_this_user_may_not_read(tmp_path, monkeypatch):
    import pwd

    from lexjax import errors

    path, uid = tmp_path / "lease.json", os.getuid()
    path.write_text("{}")
    assert errors.refused_by(path) == "" and errors.refused_by(tmp_path / "none") == ""
    monkeypatch.setattr(os, "access", lambda p, mode: False)  # (root may read anything)
    assert errors.refused_by(path) == " (Permission denied; it is yours)"
    assert errors.refused_by(tmp_path / "none") == ""  # missing is not refused
    monkeypatch.setattr(os, "getuid", lambda: uid + 1)
    assert errors.refused_by(path) == f" (Permission denied: user {pwd.getpwuid(uid).pw_name}'s)"


def test_a_config_file_whose_path_holds_a_colon_or_a_bracket(tmp_path):
    """`FILE:PRESET` was split at the first ':', so a file under `c:fg/` was "there is
    no file .../c"; and the did-you-mean globbed a directory like `cfg[1]` unescaped."""
    import shutil

    for name in ("c:fg", "cfg[1]"):
        (tmp_path / name).mkdir()
        shutil.copy(os.path.join(ROOT, "configs", "extrapolation.py"), tmp_path / name / "e.py")
    colon = tmp_path / "c:fg" / "e.py"
    assert cfg._load_file(str(colon)).train.num_train_steps > 0
    assert cfg._load_file(f"{colon}:smoke").train.num_train_steps < 100  # the preset
    presets = tmp_path / "p.py"  # a preset that holds a ':' (ml_collections' own split)
    presets.write_text("def get_config(preset):\n    return {'preset': preset}\n")
    assert cfg._load_file(f"{presets}:a:b") == {"preset": "a:b"}
    with pytest.raises(cfg.ConfigError, match=r"there is no file .*cfg\[1\]/f\.py; did you mean"):
        cfg._load_file(str(tmp_path / "cfg[1]" / "f.py"))


def test_a_message_too_long_for_its_line_is_cut_in_the_middle():
    """A workdir near PATH_MAX filled the 4,000 characters of the error line: its end,
    the reason (File name too long) and the advice, was cut."""
    from lexjax.errors import one_line

    path = "/runs/" + "y" * 5000
    said = one_line(
        OSError(f"cannot write {path} (File name too long); use a shorter path"), limit=200
    )
    assert len(said) == 200 and said.startswith("cannot write /runs/yyy")
    assert "yyy...yyy" in said and said.endswith(" (File name too long); use a shorter path")
    assert one_line(ValueError("short"), limit=200) == "short"


@pytest.mark.parametrize(
    "kind,status",
    [  # README, "Errors and exit statuses": written out here, not read from the classes
        ("ConfigError", 2),
        ("DataError", 3),
        ("CheckpointError", 4),
        ("TrainingError", 5),
        ("EvaluationError", 6),
        ("DistributedError", 7),
    ],
)
def test_each_kind_of_error_ends_a_program_with_its_documented_status(kind, status, capsys):
    """A shell script tells a stopped training (5) from an evaluation that cannot be done
    (6) or a run that cannot join (7) by the status alone; of these files' tests only 2
    and 3 were checked, 5 to 7 only by slow subprocess tests elsewhere."""
    from lexjax import errors

    def program():
        raise getattr(errors, kind)("what to change")

    assert errors.report(program) == status
    assert capsys.readouterr().err == "error: what to change\n"


def test_a_progress_display_off_a_terminal_always_prints_its_last_line():
    """Off a terminal (a log, nohup) at most one line per min_interval_s, and always the
    last one (lexjax/progress.py): a run whose end came before the interval had passed
    left its log at an earlier count."""
    import io

    from lexjax.progress import Progress

    log = io.StringIO()
    bar = Progress(4, label="step", stream=log, min_interval_s=1e9)
    for done in range(1, 5):
        bar.update(done, "loss 1.5")
    bar.close()
    lines = [line.split(" eta ")[0] for line in log.getvalue().split("\n")]
    assert lines == ["step 1/4 loss 1.5", "step 4/4 loss 1.5", ""], log.getvalue()
    # A process other than 0 (enabled=False) prints nothing: one line per step, not one per host.
    quiet = Progress(4, label="step", stream=log, enabled=False)
    quiet.update(4, "loss 1.5")
    quiet.close()
    assert log.getvalue().count("\n") == 2


def test_an_unquoted_glob_the_shell_expanded_is_told_to_be_quoted(tmp_path):
    """``--config.data.files novels/*.txt``: the shell gave the flag the first file and
    left the others over, which were taken for a workdir ("did you mean
    --workdir=novels/b.txt?")."""
    for name in ("a.txt", "b.txt"):
        (tmp_path / name).write_text("text\n")
    rest = ["train.py", str(tmp_path / "b.txt")]
    with pytest.raises(cfg.ConfigError) as e:
        cfg.no_arguments(rest)
    said = str(e.value)
    assert "--workdir" not in said and "\n" not in said
    assert f"quote it, --FLAG='{tmp_path}/*.txt'" in said
    with pytest.raises(cfg.ConfigError, match=r"did you mean --workdir=runs/x\?"):
        cfg.no_arguments(["eval.py", "runs/x"])  # not a file: still a workdir


def test_a_progress_display_or_note_on_a_gone_stderr_stops_no_work(monkeypatch):
    """`eval.py 2>&1 | head`: a progress line or a note written after the reader went
    away raised BrokenPipeError from inside the evaluation (exit 1, results lost). The
    display ends there instead, silently, and a note is dropped."""
    import io

    from lexjax import progress
    from lexjax.progress import Progress

    class Gone(io.StringIO):
        writes = 0

        def isatty(self):
            return self.tty

        def write(self, text):
            Gone.writes += 1
            raise BrokenPipeError(32, "Broken pipe")

    for tty in (False, True):
        stream = Gone()
        stream.tty = tty
        bar = Progress(4, label="tokens", stream=stream, min_interval_s=0)
        for done in range(1, 5):
            bar.update(done, "bca 16")
        bar.close()
        assert Gone.writes == 1, tty  # the first failed; none was tried after it
        Gone.writes = 0
    monkeypatch.setattr(sys, "stderr", Gone())
    progress.note("note: 1 of 2 documents is shorter than the budget")
    closed = io.StringIO()
    closed.close()
    monkeypatch.setattr(sys, "stderr", closed)
    progress.note("note: a closed stderr")


def test_an_error_line_stderr_cannot_take_still_ends_with_its_kinds_status(monkeypatch):
    """`eval.py --eval_files=GONE 2>&1 | head -n 1`: the error line, written after the
    reader went away, raised BrokenPipeError inside report(): exit 1 (a bug) instead of
    the error's own status (3)."""
    import io

    from lexjax import errors

    class Gone(io.StringIO):
        def write(self, text):
            raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(sys, "stderr", Gone())

    def program():
        raise errors.DataError("--eval_files='gone/*' matches no files")

    assert errors.report(program) == 3


def test_a_guarded_stdouts_own_error_is_not_taken_for_a_gone_reader(tmp_path):
    """A display on a guarded stdout with no fallback (errors.stdout_failures; a full
    disk) meets its one-line EvaluationError, a ValueError: that error is the program's
    and is raised, where only a closed stream's ValueError ends the display quietly."""
    import io

    from lexjax import errors
    from lexjax.progress import Progress

    full = open("/dev/full", "w")  # noqa: SIM115 (its close fails too: what it holds)
    guarded = errors._GuardedStdout(full)
    with pytest.raises(errors.EvaluationError, match="^cannot write to stdout"):
        Progress(2, label="step", stream=guarded, min_interval_s=0).update(1)
    with contextlib.suppress(OSError):
        full.close()
    closed = io.StringIO()
    bar = Progress(2, label="step", stream=closed, min_interval_s=0)
    closed.close()
    bar.update(1)
    bar.update(2)
    assert not bar.enabled


def test_without_a_stderr_the_display_and_notes_go_nowhere(monkeypatch, capsys):
    """`eval.py 2>&- | tail`: sys.stderr is None, and the display's first question
    (is it a terminal?) was an AttributeError, exit 1; a note went to stdout, among
    the tables (print with file=None writes there)."""
    from lexjax import progress
    from lexjax.progress import Progress

    monkeypatch.setattr(sys, "stderr", None)
    bar = Progress(2, label="tokens", min_interval_s=0)
    bar.update(1)
    bar.update(2)
    bar.close()
    progress.note("note: 1 of 2 documents is shorter than the budget")
    assert not bar.enabled and capsys.readouterr().out == ""
