"""The notebooks run top to bottom, and are committed with their outputs.

Each notebook is executed again with nbclient in a fresh ``python3`` kernel
(jupyter_client starts it with this interpreter), so that a change to the
library that breaks a notebook fails here; any cell error fails the test.
"""

import pathlib

import pytest

from tests._scripts import load_script

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
for _module in ("ipykernel", "matplotlib", "flax", "sklearn"):
    pytest.importorskip(_module)

NOTEBOOK_DIR = pathlib.Path(__file__).parents[1] / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))


def load_builder():
    return load_script(NOTEBOOK_DIR / "_build.py", "notebooks_build")


def test_every_notebook_is_there():
    assert [p.name for p in NOTEBOOKS] == [
        "01_why_loss_scaling.ipynb",
        "02_train_with_flax.ipynb",
        "03_diagnostics.ipynb",
    ]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_is_committed_with_outputs_from_its_builder(path):
    nb = nbformat.read(path, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert "except ImportError" in code[0].source and "%pip install" in code[0].source
    outputs = [o for c in code for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    assert sum("image/png" in o.get("data", {}) for o in outputs) >= 2
    assert all(c.execution_count for c in code), "run every cell before committing"
    # The committed cells are the ones notebooks/_build.py writes.
    built = load_builder().NOTEBOOKS[path.name]
    assert [(c.cell_type, c.source) for c in nb.cells] == list(built)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs_top_to_bottom(path):
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(
        nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(NOTEBOOK_DIR)}}
    )
    client.execute()  # raises CellExecutionError, naming the cell, on any error
    images = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if "image/png" in o.get("data", {})]
    assert len(images) >= 2
