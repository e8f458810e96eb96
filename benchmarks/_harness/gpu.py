"""The program XLA:GPU would run on a given GPU, compiled on a machine
without one (deviceless ahead-of-time compilation).

XLA:GPU needs no GPU and no driver to compile: the CUDA PJRT plugin
(``pip install jax-cuda12-plugin==V jax-cuda12-pjrt==V``, V the installed
jaxlib's version, about 460 MB, no NVIDIA libraries; for a jaxlib with no
CUDA 12 plugin, such as 0.12.1, ``jax-cuda13-plugin`` and
``jax-cuda13-pjrt``) compiles for a *target
config*, the figures of one device (``benchmarks/gpu_targets/NAME.txtpb``,
written from the devices' published figures). The CPU stays jax's default
backend: the plugin is only asked for a topology, and programs lowered on a
mesh of that topology are compiled for it. Nothing here runs on a GPU: the
result is a compiled program to read (kernels, GEMM dtypes, temporary
memory), never to execute.

Usage::

    from _harness import gpu
    gpu.require()                                  # SystemExit with the reason when it cannot compile
    compiled = gpu.compile_for("h100", fn, args)   # args: arrays or jax.ShapeDtypeStructs
    compiled.as_text(), compiled.memory_analysis()

Set ``JAX_PLATFORMS=cpu,cuda`` and ``JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1``
before jax is imported (``configure_environment()`` does it for a script
that calls it first), so that jax loads the plugin beside the CPU without
looking for a GPU.
"""

from __future__ import annotations

import functools
import os
import pathlib
from collections.abc import Callable, Sequence
from typing import Any

TARGETS_DIR = pathlib.Path(__file__).resolve().parent.parent / "gpu_targets"
TARGETS = ("h100", "h200", "b200", "a100", "t4")
PLUGINS = ("cuda12", "cuda13")
INSTALL = (
    'V=$(python -c "import jaxlib; print(jaxlib.__version__)"); '
    'pip install "jax-cuda12-plugin==$V" "jax-cuda12-pjrt==$V" (or jax-cuda13-*, where only those exist)'
)


def configure_environment() -> None:
    """Ask jax for the CUDA plugin beside the CPU (the CPU stays the default
    backend) without a GPU: call before jax is first imported."""
    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
    platforms = [p for p in os.environ.get("JAX_PLATFORMS", "").split(",") if p] or ["cpu"]
    if "cuda" not in platforms:
        os.environ["JAX_PLATFORMS"] = ",".join([*platforms, "cuda"])


def target_config(name: str) -> str:
    """The text of the target config ``name`` (one of ``TARGETS``)."""
    path = TARGETS_DIR / f"{name}.txtpb"
    if not path.exists():
        raise ValueError(f"unknown GPU target {name!r}; choose from {', '.join(TARGETS)}")
    return path.read_text()


def unavailable() -> str | None:
    """Why programs cannot be compiled for a GPU here, or ``None`` when they
    can: the plugin is missing, of another version than jax, or jax was
    imported without it."""
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for cuda in PLUGINS:
        try:
            found[cuda] = version(f"jax-{cuda}-plugin")
        except PackageNotFoundError:
            continue
    if not found:
        return f"the CUDA plugin is not installed (deviceless GPU compilation needs it: {INSTALL})"
    if version("jaxlib") not in found.values():
        plugins = ", ".join(f"jax-{cuda}-plugin {v}" for cuda, v in found.items())
        return f"{plugins} does not match jaxlib {version('jaxlib')}: {INSTALL}"
    if "cuda" not in os.environ.get("JAX_PLATFORMS", "").split(","):
        return "JAX_PLATFORMS does not list cuda (set JAX_PLATFORMS=cpu,cuda before jax is imported)"
    try:
        _topology("h100")
    except Exception as error:  # any failure of the plugin is the reason
        return f"the CUDA plugin did not compile for a target config: {type(error).__name__}: {error}"
    return None


def require() -> None:
    """Exit with the reason when programs cannot be compiled for a GPU."""
    reason = unavailable()
    if reason is not None:
        raise SystemExit(f"cannot compile for a GPU here: {reason}")


@functools.cache
def _topology(name: str, devices: int = 1) -> Any:
    from jax.experimental import topologies

    return topologies.get_topology_desc(platform="cuda", target_config=target_config(name), topology=f"1x1x{devices}")


@functools.cache
def mesh(name: str, devices: int = 1) -> Any:
    """A mesh of ``devices`` GPUs of target ``name`` (one axis, ``"d"``)."""
    from jax.experimental import topologies

    return topologies.make_mesh(_topology(name, devices), (devices,), ("d",))


def device_kind(name: str) -> str:
    return mesh(name).devices.flat[0].device_kind


def specs(tree: Any, name: str) -> Any:
    """``tree``'s array leaves (arrays or ``ShapeDtypeStruct``s) as
    ``ShapeDtypeStruct``s replicated on target ``name``'s one-GPU mesh;
    other leaves as they are."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    sharding = NamedSharding(mesh(name), PartitionSpec())

    def spec(x: Any) -> Any:
        if hasattr(x, "shape") and hasattr(x, "dtype"):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
        return x

    return jax.tree.map(spec, tree)


def compile_for(name: str, fn: Callable, args: Sequence[Any], donate_argnums: Sequence[int] = ()) -> Any:
    """``jax.jit(fn)`` compiled for target ``name`` with ``args`` given as
    shapes: the ``jax.stages.Compiled`` (``as_text()``,
    ``memory_analysis()``)."""
    import jax

    return jax.jit(fn, donate_argnums=tuple(donate_argnums)).lower(*specs(tuple(args), name)).compile()
