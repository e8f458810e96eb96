"""``flax.serialization`` (``to_bytes``, ``to_state_dict``) for the
state's ``PackedFields``, without importing flax.

flax serializes only the types in its registry. ``PackedFields`` is
registered when ``flax.serialization`` is imported, before or after
``loss_scale``: at once if it already is, otherwise by a finder on
``sys.meta_path`` that registers it right after flax's module runs (and
then removes itself).
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from typing import Any

from loss_scale._packed import PackedFields

_MODULE = "flax.serialization"


def _state_dict(packed: PackedFields) -> dict[str, Any]:
    from flax import serialization

    return {"data": serialization.to_state_dict(packed.data)}


def _from_state_dict(target: PackedFields, state: dict[str, Any]) -> PackedFields:
    from flax import serialization

    return PackedFields(serialization.from_state_dict(target.data, state["data"], name="data"), target.layout)


def _register(module: Any) -> None:
    module.register_serialization_state(PackedFields, _state_dict, _from_state_dict, override=True)


class _Loader(importlib.abc.Loader):
    """flax's own loader, then the registration."""

    def __init__(self, loader: importlib.abc.Loader):
        self._loader = loader

    def create_module(self, spec: Any) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self._loader.exec_module(module)
        _register(module)


class _Finder(importlib.abc.MetaPathFinder):
    def __init__(self) -> None:
        self._finding = False

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != _MODULE or self._finding:
            return None
        self._finding = True
        try:
            spec = importlib.util.find_spec(name)
        finally:
            self._finding = False
        if spec is None or spec.loader is None:
            return spec
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        spec.loader = _Loader(spec.loader)
        return spec


def register_with_flax() -> None:
    """Make ``PackedFields`` serializable by ``flax.serialization``, now or
    when it is imported."""
    if _MODULE in sys.modules:
        _register(sys.modules[_MODULE])
    elif not any(isinstance(finder, _Finder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
