"""The notebooks' setup cell as a reader meets it: a new kernel, in a Python
environment that has the dependencies but not loss_scale, runs the setup cell
and then the cell after it, which imports loss_scale and the examples.

pip's editable install writes a ``.pth`` file (a finder for the package) that
Python reads at start-up: it takes effect in the next kernel, not in the one
that ran pip, so a setup cell that only installs leaves the next cell's
``import loss_scale`` failing with ``ModuleNotFoundError`` until the kernel is
restarted. These tests run the cells in a real ``ipykernel`` of such an
environment, the way Jupyter and Colab run them.

The environment is a ``venv`` whose site directory links to this one's
packages except loss_scale's own (its distribution metadata and editable
finder), so that nothing is downloaded: pip runs with ``PIP_NO_INDEX`` and
builds the package with this environment's setuptools.
"""

import os
import pathlib
import shutil
import subprocess
import sys
import sysconfig

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
jupytext = pytest.importorskip("jupytext")
kernelspec = pytest.importorskip("jupyter_client.kernelspec")
manager = pytest.importorskip("jupyter_client.manager")
for _module in ("ipykernel", "pip", "setuptools", "matplotlib", "flax", "tqdm"):
    pytest.importorskip(_module)

pytestmark = pytest.mark.skipif(os.name != "posix", reason="links the environment's packages with symlinks")

ROOT = pathlib.Path(__file__).parents[1]
SOURCE = ROOT / "notebooks" / "01_why_loss_scaling.py"


def first_code_cells(n: int) -> list:
    """The first ``n`` code cells of a notebook: the setup cell, then the imports."""
    return [cell for cell in jupytext.read(SOURCE).cells if cell.cell_type == "code"][:n]


@pytest.fixture(scope="module")
def packages(tmp_path_factory) -> pathlib.Path:
    """A site directory of links to this environment's packages, loss_scale's left out."""
    site = tmp_path_factory.mktemp("packages")
    for entry in pathlib.Path(sysconfig.get_paths()["purelib"]).iterdir():
        if "loss_scale" not in entry.name and entry.name != "__pycache__":
            (site / entry.name).symlink_to(entry)
    return site


@pytest.fixture
def python(tmp_path, packages, monkeypatch) -> pathlib.Path:
    """The interpreter of a new environment without loss_scale."""
    env = tmp_path / "env"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env)], check=True, timeout=120)
    interpreter = env / "bin" / "python"
    purelib = subprocess.run(
        [interpreter, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    # addsitedir also reads the .pth files there; pip sees these packages as
    # outside its environment, so it never uninstalls them.
    (pathlib.Path(purelib) / "packages.pth").write_text(f"import site; site.addsitedir({str(packages)!r})\n")
    monkeypatch.delenv("PYTHONPATH", raising=False)
    monkeypatch.delenv("LOSS_SCALE_REPOSITORY", raising=False)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_NO_BUILD_ISOLATION", "0")  # pip's spelling of --no-build-isolation
    check = subprocess.run([interpreter, "-c", "import loss_scale"], cwd=tmp_path, capture_output=True, text=True)
    assert "No module named 'loss_scale'" in check.stderr, check.stderr
    return interpreter


@pytest.fixture
def repository(tmp_path) -> pathlib.Path:
    """A copy of the repository: what a clone has that installing and the notebooks need."""
    copy = tmp_path / "loss_scale_repository"
    copy.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, copy / name)
    for name in ("loss_scale", "examples", "notebooks"):
        shutil.copytree(ROOT / name, copy / name, ignore=shutil.ignore_patterns("__pycache__", "*.ipynb"))
    return copy


def run_in_kernel(python: pathlib.Path, cells: list, cwd: pathlib.Path) -> tuple[list[str], str]:
    """Runs ``cells`` in order in one new ipykernel of ``python`` started in
    ``cwd``; returns the errors they raised (``"Name: message"``) and what they printed."""
    kernels = cwd.parent / "kernels"
    kernel = kernelspec.KernelSpec(
        argv=[str(python), "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        display_name="without loss_scale",
        language="python",
    )
    (kernels / "fresh").mkdir(parents=True, exist_ok=True)
    (kernels / "fresh" / "kernel.json").write_text(kernel.to_json())
    specs = kernelspec.KernelSpecManager(kernel_dirs=[str(kernels)])
    km = manager.KernelManager(kernel_name="fresh", kernel_spec_manager=specs)
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(cell.source) for cell in cells])
    client = nbclient.NotebookClient(
        nb, km=km, timeout=300, allow_errors=True, resources={"metadata": {"path": str(cwd)}}
    )
    client.execute()
    outputs = [output for cell in nb.cells for output in cell.outputs]
    errors = [f"{o.ename}: {o.evalue}" for o in outputs if o.output_type == "error"]
    printed = "".join(o.text for o in outputs if o.output_type == "stream")
    return errors, printed


#: Where the kernel imported loss_scale and the examples from.
WHERE = "import loss_scale, nnx_lm\nprint('FROM', loss_scale.__file__, nnx_lm.__file__)"


def test_the_setup_cell_installs_and_imports_in_the_same_kernel(python, repository, tmp_path):
    # A kernel in the notebooks/ folder of a clone, as Jupyter starts it.
    errors, printed = run_in_kernel(
        python, [*first_code_cells(2), nbformat.v4.new_code_cell(WHERE)], repository / "notebooks"
    )
    assert errors == [], "\n".join([*errors, printed])
    assert "| loss_scale 0." in printed
    assert f"FROM {repository}/loss_scale/__init__.py {repository}/examples/nnx_lm.py" in printed
    # The install is a real one: a new interpreter of the environment imports it without the cell.
    after = subprocess.run(
        [python, "-c", "import loss_scale; print(loss_scale.__file__)"], cwd=tmp_path, capture_output=True, text=True
    )
    assert after.stdout.strip() == f"{repository}/loss_scale/__init__.py", after.stderr


def test_the_setup_cell_finds_the_repository_the_environment_variable_names(python, repository, tmp_path, monkeypatch):
    # As on Colab: the notebook alone in the working directory, the repository
    # unpacked beside it in a folder named loss_scale, which the kernel sees as
    # a namespace package of that name until the real one is on the path.
    alone = tmp_path / "content"
    alone.mkdir()
    repository = repository.rename(alone / "loss_scale")
    monkeypatch.setenv("LOSS_SCALE_REPOSITORY", str(repository))
    errors, printed = run_in_kernel(python, [*first_code_cells(2), nbformat.v4.new_code_cell(WHERE)], alone)
    assert errors == [], "\n".join([*errors, printed])
    assert f"FROM {repository}/loss_scale/__init__.py {repository}/examples/nnx_lm.py" in printed
