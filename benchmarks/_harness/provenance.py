"""What a result depends on: versions, device, CPUs, allocator, date, the
command line and the code that produced it."""

from __future__ import annotations

import datetime
import hashlib
import importlib.metadata
import os
import pathlib
import platform
import shlex
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

import jax
import optax

import loss_scale as ls

from .timing import MALLOC_ENV_VARS, persistent_cache_dir

ROOT = pathlib.Path(__file__).resolve().parents[2]  # the repository
# Distributions whose versions the header reports when they are installed.
PEERS = ("jaxlib", "flax", "equinox", "jmp", "mixed-precision-for-JAX")


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def source_digest() -> str:
    """A short hash of loss_scale's sources (every ``.py`` file under the
    package): ties a result to the code that produced it."""
    package = pathlib.Path(ls.__file__).parent
    digest = hashlib.sha256()
    for path in sorted(package.rglob("*.py")):
        digest.update(str(path.relative_to(package)).encode() + path.read_bytes())
    return digest.hexdigest()[:12]


def git_commit() -> str | None:
    """The checkout's commit, with ``+dirty`` when files differ from it;
    ``None`` outside a git checkout (read-only git commands)."""
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short=12", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10
        )
        if commit.returncode != 0:
            return None
        dirty = subprocess.run(
            # --no-optional-locks: never take the index lock (others may be committing).
            ["git", "--no-optional-locks", "status", "--porcelain", "--untracked-files=no"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return commit.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def environment(script: str, argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Versions, device, CPUs, allocator settings, date (UTC) and the command
    line: ``script`` (a path) and ``argv`` (its arguments; ``sys.argv[1:]``
    if ``None``)."""
    device = jax.devices()[0]
    try:
        usable_cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        usable_cpus = os.cpu_count()
    script_path = pathlib.Path(script).resolve()
    if script_path.is_relative_to(ROOT):
        script = str(script_path.relative_to(ROOT))
    args = list(sys.argv[1:] if argv is None else argv)
    return {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "command": shlex.join(["python", script, *args]),
        "jax": jax.__version__,
        "optax": optax.__version__,
        "peers": {name: v for name in PEERS if (v := _version(name)) is not None},
        "loss_scale": f"{ls.__version__} (sources {source_digest()})",
        "git": git_commit(),
        "python": platform.python_version(),
        "backend": jax.default_backend(),
        "device": str(device),
        "device_kind": device.device_kind,
        "device_count": jax.device_count(),
        "cpu_count": os.cpu_count(),
        "usable_cpus": usable_cpus,
        "machine": platform.machine(),
        "processor": platform.processor(),
        "malloc_env": {k: os.environ[k] for k in MALLOC_ENV_VARS if k in os.environ},
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "compilation_cache": persistent_cache_dir(),
    }


def header(env: dict[str, Any]) -> str:
    """Two lines: what ran where, and the versions."""
    malloc = " ".join(f"{k}={v}" for k, v in env["malloc_env"].items()) or "glibc defaults"
    peers = "".join(f" | {name} {version}" for name, version in env["peers"].items())
    return (
        f"{env['date']} | `{env['command']}` | backend {env['backend']} | device {env['device']} "
        f"({env['device_kind']}) | CPUs {env['usable_cpus']}/{env['cpu_count']} | malloc: {malloc}"
        + (f" | XLA_FLAGS={env['xla_flags']}" if env["xla_flags"] else "")
        + (
            f" | persistent compilation cache {env['compilation_cache']}: compile times may be cache hits"
            if env.get("compilation_cache")
            else ""
        )
        + f"\njax {env['jax']} | optax {env['optax']}{peers} | loss_scale {env['loss_scale']}"
        + (f" | git {env['git']}" if env["git"] else "")
        + f" | python {env['python']}"
    )
