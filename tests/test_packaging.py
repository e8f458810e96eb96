"""The minimum versions pyproject.toml declares are the ones CI installs;
the sdist and the wheel hold what they should."""

import importlib.metadata
import pathlib
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+
ROOT = pathlib.Path(__file__).parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _pins(name: str) -> dict[str, str]:
    text = (ROOT / ".ci" / name).read_text()
    return dict(re.findall(r"^([\w-]+)==([\w.]+)$", text, flags=re.M))


def _minimums(requirements: list[str]) -> dict[str, str]:
    """``{name: version}`` of the ``name>=version`` requirements (without
    markers)."""
    found = (re.match(r"^([\w-]+)>=([\w.]+)$", r) for r in requirements)
    return dict(m.groups() for m in found if m)


def test_ci_installs_the_declared_core_minimums():
    declared = _minimums(PROJECT["dependencies"]) | {
        k: v for k, v in _minimums(PROJECT["optional-dependencies"]["test"]).items() if k == "chex"
    }
    assert _pins("minimum-versions.txt") == declared


def test_ci_installs_the_declared_integration_minimums():
    pins = _pins("minimum-versions-integrations.txt")
    extras = PROJECT["optional-dependencies"]
    for extra in ("examples", "test", "bench"):
        for name, version in _minimums(extras[extra]).items():
            if name in ("flax", "equinox"):
                assert pins[name] == version, (extra, name)
    core = _minimums(PROJECT["dependencies"])
    assert all(tuple(map(int, pins[k].split("."))) >= tuple(map(int, core[k].split("."))) for k in core)


def _built(tmp_path: pathlib.Path) -> dict[str, list[str]]:
    """The files of the sdist and the wheel built from a copy of the
    repository (without build isolation: no network), by archive suffix."""
    pytest.importorskip("build")
    setuptools_version = importlib.metadata.version("setuptools")
    if int(setuptools_version.split(".")[0]) < 77:
        pytest.skip(f"setuptools {setuptools_version}: pyproject.toml's build backend needs >= 77")
    copy = tmp_path / "repo"
    ignore = shutil.ignore_patterns(".git", ".venv*", "site", ".cache", "*.egg-info", "build", "dist", "__pycache__")
    shutil.copytree(ROOT, copy, ignore=ignore)
    out = tmp_path / "dist"
    run = subprocess.run(
        [sys.executable, "-m", "build", "--sdist", "--wheel", "--no-isolation", "--outdir", str(out), str(copy)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    (sdist,) = out.glob("*.tar.gz")
    (wheel,) = out.glob("*.whl")
    with tarfile.open(sdist) as archive:
        sdist_files = [name.split("/", 1)[1] for name in archive.getnames() if "/" in name]
    with zipfile.ZipFile(wheel) as archive:
        wheel_files = archive.namelist()
    return {"sdist": sdist_files, "wheel": wheel_files}


def test_the_sdist_is_the_package_without_the_tests_and_the_wheel_the_package(tmp_path):
    # The tests import the examples, the benchmarks and the notebook builder,
    # which the sdist does not ship: they run from a clone, so the sdist
    # leaves them out (MANIFEST.in) rather than shipping tests that fail.
    built = _built(tmp_path)
    sources = {p.relative_to(ROOT).as_posix() for p in (ROOT / "loss_scale").rglob("*.py")}
    assert sources <= set(built["sdist"]) and {"README.md", "LICENSE", "pyproject.toml"} <= set(built["sdist"])
    assert not [name for name in built["sdist"] if name.startswith(("tests/", "benchmarks/", "examples/"))]
    assert sources | {"loss_scale/py.typed"} <= set(built["wheel"])
    assert not [n for n in built["wheel"] if not n.startswith(("loss_scale/", "loss_scale-"))], built["wheel"]
