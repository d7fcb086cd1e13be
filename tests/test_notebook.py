"""notebooks/quickstart: the jupytext pair agrees and is stored without outputs, and the
notebook runs top to bottom headless at smoke size (LEXJAX_SMOKE=1), as CI runs it."""

import importlib.util
import os

import jupytext
import nbformat
import pytest

from tests import processes as P

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOKS = os.path.join(ROOT, "notebooks")


def _executor():
    spec = importlib.util.spec_from_file_location("execute", os.path.join(NOTEBOOKS, "execute.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_pair_agrees_and_outputs_are_stripped():
    stored = nbformat.read(os.path.join(NOTEBOOKS, "quickstart.ipynb"), as_version=4)
    script = jupytext.read(os.path.join(NOTEBOOKS, "quickstart.py"))
    assert [(c.cell_type, c.source) for c in stored.cells] == [
        (c.cell_type, c.source) for c in script.cells
    ], "run: jupytext --sync notebooks/quickstart.py"
    for cell in stored.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, cell.source[:60]


def test_notebook_runs_at_smoke_size_from_another_directory(tmp_path):
    env = dict(os.environ, XLA_FLAGS=P.xla_flags())  # one CPU device: faster
    notebook, _ = _executor().execute(
        smoke=True, cwd=str(tmp_path), env=env
    )  # raises on a failing cell
    outputs = {i: cell.outputs for i, cell in enumerate(notebook.cells) if cell.cell_type == "code"}
    images = [i for i, out in outputs.items() if any("image/png" in o.get("data", {}) for o in out)]
    assert len(images) == 3, images  # Figure 1, the loss, perplexity by length
    text = "".join(o.get("text", "") for out in outputs.values() for o in out)
    # The mesh training lays, as the cell's comment says (it printed a mesh of "data"
    # alone with Explicit axes, which docs/api.md says the Decoder refuses).
    assert "Mesh('data': 1, 'fsdp': 1, 'tensor': 1, axis_types=(Auto, Auto, Auto))" in text
    assert "same scores at positions + 100: True" in text
    assert "step 10/10 loss" in text and "xpos with BCA" in text
    assert "characters after the prompt" in text
    assert os.path.isdir(tmp_path / "runs" / "quickstart-smoke" / "checkpoints")


def test_output_directories_are_made_before_the_run_and_a_bad_one_is_one_line(tmp_path, capsys):
    # A full-size execution takes minutes and writes --out only at its end: a missing
    # directory must not cost the run, and one that cannot be made must stop it first.
    execute = _executor()
    cwd = execute.prepare(str(tmp_path / "kernel"), str(tmp_path / "a" / "nb.ipynb"), None)
    assert cwd == str(tmp_path / "kernel") and os.path.isdir(cwd)
    assert os.path.isdir(tmp_path / "a")
    assert os.path.isdir(execute.prepare(None, str(tmp_path / "b" / "c" / "t.json")))
    assert os.path.isdir(tmp_path / "b" / "c")
    (tmp_path / "file").write_text("x")
    with pytest.raises(SystemExit) as stop:
        execute.prepare(None, str(tmp_path / "file" / "out" / "nb.ipynb"))
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: cannot make the directory") and err.count("\n") == 1
    # An existing directory is no file to write the notebook into (it was found after
    # the whole run, an IsADirectoryError).
    with pytest.raises(SystemExit) as stop:
        execute.prepare(None, str(tmp_path / "a"))
    assert stop.value.code == 2
    assert (
        capsys.readouterr().err
        == f"error: {tmp_path / 'a'} is a directory; name the file to write\n"
    )
