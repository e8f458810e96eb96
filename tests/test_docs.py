"""The documentation site builds in strict mode: a broken cross-reference, a
docstring that does not match its signature or a missing page fails here."""

import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).parents[1]
pytest.importorskip("mkdocs")


def build(root: pathlib.Path, site: pathlib.Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(root / "mkdocs.yml"), "-d", str(site)],
        capture_output=True,
        text=True,
        cwd=root,
        env={"NO_MKDOCS_2_WARNING": "1", "PATH": "", "HOME": str(site.parent)},
        timeout=300,
    )


def test_the_site_builds_in_strict_mode(tmp_path):
    result = build(ROOT, tmp_path / "site")
    assert result.returncode == 0, result.stderr[-3000:]
    pages = {p.relative_to(tmp_path / "site").as_posix() for p in (tmp_path / "site").rglob("index.html")}
    assert {"api/transformations/index.html", "notebooks/02_train_with_flax/index.html"} <= pages
    # The keyword options are documented on each factory (attached at import time).
    html = (tmp_path / "site" / "api" / "transformations" / "index.html").read_text()
    assert "max_consecutive_skips" in html and "track_underflow" in html


def test_a_broken_reference_fails_the_build(tmp_path):
    copy = tmp_path / "repo"
    shutil.copytree(ROOT, copy, ignore=shutil.ignore_patterns(".git", ".venv", "site", ".cache", "*.egg-info"))
    page = copy / "docs" / "api" / "gradients.md"
    page.write_text(page.read_text() + "\nSee [the nowhere function][loss_scale.nowhere].\n")
    result = build(copy, tmp_path / "site")
    assert result.returncode != 0 and "loss_scale.nowhere" in result.stderr
