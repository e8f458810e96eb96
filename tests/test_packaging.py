"""The minimum versions pyproject.toml declares are the ones CI installs."""

import pathlib
import re

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+
ROOT = pathlib.Path(__file__).parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _pins(name: str) -> dict[str, str]:
    text = (ROOT / ".ci" / name).read_text()
    return dict(re.findall(r"^([\w-]+)==([\w.]+)$", text, flags=re.M))


def _minimums(requirements: list[str]) -> dict[str, str]:
    """``{name: version}`` of the ``name>=version`` requirements, without the
    ones for older Pythons only (typing_extensions)."""
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
