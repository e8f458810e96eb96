"""The notebooks: their percent-format sources and the committed ``.ipynb``.

* each ``.ipynb`` has exactly the cells jupytext reads from its ``NN_name.py``
  source (``notebooks/build.py`` writes them), so an edit to one and not the
  other fails here;
* each is committed with its outputs, and runs top to bottom: it is executed
  again with nbclient in a fresh ``python3`` kernel (jupyter_client starts it
  with this interpreter), so a change to the library or to the examples it
  imports that breaks a notebook fails here;
* the markdown has no LaTeX broken by string escapes (``\\a`` of ``\\approx``
  read as a bell character, ``\\t`` of ``\\times`` as a tab);
* the setup cell installs nothing by name from the package index, and fails
  with a message saying what to do where there is no copy of the repository
  (``tests/test_notebook_setup.py`` runs it in a kernel without loss_scale).
"""

import os
import pathlib
import re
import subprocess
import sys

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
jupytext = pytest.importorskip("jupytext")
for _module in ("ipykernel", "matplotlib", "flax", "equinox", "sklearn", "tqdm"):
    pytest.importorskip(_module)

NOTEBOOK_DIR = pathlib.Path(__file__).parents[1] / "notebooks"
SOURCES = sorted(NOTEBOOK_DIR.glob("[0-9][0-9]_*.py"))
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))


def cells(nb) -> list[tuple[str, str]]:
    return [(cell.cell_type, cell.source) for cell in nb.cells]


def test_every_notebook_has_its_source():
    assert (
        [p.stem for p in SOURCES]
        == [p.stem for p in NOTEBOOKS]
        == [
            "01_why_loss_scaling",
            "02_train_with_flax",
            "03_diagnostics",
            "04_why_did_my_run_fail",
            "05_per_segment_scaling",
            "06_automatic_mixed_precision",
        ]
    )
    assert not (NOTEBOOK_DIR / "_build.py").exists()


@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.stem)
def test_notebook_cells_are_those_of_its_source(source):
    committed = nbformat.read(source.with_suffix(".ipynb"), as_version=4)
    assert cells(committed) == cells(jupytext.read(source)), (
        f"{source.name} and its .ipynb differ: edit the .py source, then run `python notebooks/build.py {source.stem}`"
    )


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_is_committed_with_outputs(path):
    nb = nbformat.read(path, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code[0].source == setup_cell()
    outputs = [o for c in code for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    assert sum("image/png" in o.get("data", {}) for o in outputs) >= 2
    assert all(c.execution_count for c in code), "run every cell before committing: python notebooks/build.py"
    assert nb.metadata["kernelspec"]["name"] == "python3"


def broken_latex(markdown: str) -> list[str]:
    """What in ``markdown`` looks like LaTeX mangled by a string escape: a
    control character, or a math command without its backslash."""
    problems = [repr(m.group()) for m in re.finditer(r"[\x00-\x09\x0b-\x1f\x7f]", markdown)]  # tab included
    for math in re.findall(r"\$+[^$]+\$+", markdown):
        commands = r"approx|times|cdot|l?dots|frac|sqrt|infty|leq|geq|log|exp|to|pm"
        problems += [math for _ in re.finditer(rf"(?<![\\a-zA-Z])({commands})\b", math)]
        problems += [math for _ in re.finditer(r"(?<!\\a)pprox|(?<!\\t)imes\b", math)]
    return problems


def test_the_latex_check_sees_the_escape_bug():
    # What "\approx" and "\times" in a non-raw string became in notebook 01.
    assert broken_latex("below $2^{-25} N / 2 \x07pprox 2.4 \times 10^{-4}$") != []
    assert broken_latex("below $2^{-25} N / 2 pprox 2.4 imes 10^{-4}$") != []
    assert broken_latex(r"below $2^{-25} N / 2 \approx 2.4 \times 10^{-4}$, a few times $10^{-6}$") == []


@pytest.mark.parametrize("path", [*SOURCES, *NOTEBOOKS], ids=lambda p: p.name)
def test_no_broken_latex(path):
    nb = jupytext.read(path) if path.suffix == ".py" else nbformat.read(path, as_version=4)
    markdown = [c.source for c in nb.cells if c.cell_type == "markdown"]
    assert sum("$" in m for m in markdown) >= 1
    assert [p for m in markdown for p in broken_latex(m)] == []


def setup_cell() -> str:
    source = jupytext.read(SOURCES[0])
    return next(c.source for c in source.cells if c.cell_type == "code")


def run_setup(prelude: str, cwd: pathlib.Path, **env: str) -> subprocess.CompletedProcess:
    environment = {k: v for k, v in os.environ.items() if k != "LOSS_SCALE_REPOSITORY"}
    return subprocess.run(
        [sys.executable, "-c", prelude + "\n" + setup_cell()],
        cwd=cwd,
        env={**environment, **env},
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.stem)
def test_every_notebook_has_the_same_setup_cell(source):
    assert next(c.source for c in jupytext.read(source).cells if c.cell_type == "code") == setup_cell()


def test_setup_installs_the_copy_of_the_repository_and_no_name_from_the_index():
    setup = setup_cell()
    code = "\n".join(line.split("#")[0] for line in setup.splitlines())
    assert code.count('"install"') == 1
    assert '[sys.executable, "-m", "pip", "install", "-q", "-e", f"{repository}[examples]"]' in code
    assert "http" not in setup and "<repository URL>" not in setup  # the repository has no public address yet


@pytest.mark.parametrize("where", ["no copy", "a copy without examples/"])
def test_setup_says_what_to_do_without_a_copy_of_the_repository(tmp_path, where):
    if where == "no copy":
        (tmp_path / "notebooks").mkdir()
        result = run_setup("", tmp_path / "notebooks")  # its parent holds no repository
    else:
        (tmp_path / "pyproject.toml").write_text("")
        result = run_setup("", NOTEBOOK_DIR, LOSS_SCALE_REPOSITORY=str(tmp_path))
    assert result.returncode != 0
    message = result.stderr.strip().splitlines()[-1]
    assert message.startswith(f"FileNotFoundError: no copy of the loss_scale repository in {tmp_path}. ")
    assert "not on the package index" in message and "no public address yet" in message
    assert "LOSS_SCALE_REPOSITORY" in message and "run this cell again" in message


def test_setup_puts_the_examples_on_the_import_path():
    result = run_setup("", NOTEBOOK_DIR)
    assert result.returncode == 0, result.stderr
    check = subprocess.run(
        [sys.executable, "-c", setup_cell() + "\nimport _common, nnx_lm\nprint(_common.__file__)"],
        cwd=NOTEBOOK_DIR,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert check.returncode == 0, check.stderr
    assert pathlib.Path(check.stdout.strip()) == NOTEBOOK_DIR.parent / "examples" / "_common.py"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs_top_to_bottom(path):
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(
        nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(NOTEBOOK_DIR)}}
    )
    client.execute()  # raises CellExecutionError, naming the cell, on any error
    images = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if "image/png" in o.get("data", {})]
    assert len(images) >= 2
