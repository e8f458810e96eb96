"""Every public name has a runnable ``>>>`` example in its own docstring:
everything in ``loss_scale.__all__`` (the ``presets`` module included, in
its module docstring), the presets, and the public names of
``loss_scale.flax`` and ``loss_scale.equinox``. pytest runs them all
(``--doctest-modules`` over ``loss_scale/``, in ``pyproject.toml``); this
file checks that each public name has one, in a docstring that doctest
collects from the module that defines it."""

from __future__ import annotations

import doctest
import importlib
import importlib.util
import types

import pytest

import loss_scale
import loss_scale.presets

MODULES = ["loss_scale", "loss_scale.presets", "loss_scale.flax", "loss_scale.equinox"]
NEEDS = {"loss_scale.flax": "flax", "loss_scale.equinox": "equinox"}


def public_names() -> list[str]:
    names = []
    for module_name in MODULES:
        if module_name in NEEDS and importlib.util.find_spec(NEEDS[module_name]) is None:
            continue
        module = importlib.import_module(module_name)
        names += [f"{module_name}.{name}" for name in module.__all__]
    return names


def resolve(name: str) -> object:
    module_name, _, attribute = name.rpartition(".")
    return getattr(importlib.import_module(module_name), attribute)


def collected_examples(obj: object) -> list[doctest.DocTest]:
    """The doctests of ``obj``'s own docstring, as pytest's doctest
    collection finds them in the module that defines ``obj`` (a module's
    own, in the module)."""
    if isinstance(obj, types.ModuleType):
        module, name = obj, obj.__name__
    else:
        module = importlib.import_module(obj.__module__)
        name = f"{module.__name__}.{obj.__qualname__}"
    return [test for test in doctest.DocTestFinder().find(module) if test.name == name and test.examples]


def missing_example(obj: object) -> str | None:
    """Why ``obj`` has no runnable example, or ``None`` when it has one."""
    doc = obj.__dict__.get("__doc__") if isinstance(obj, type) else getattr(obj, "__doc__", None)
    if not doc or ">>>" not in doc:
        return "its docstring has no >>> example"
    if not collected_examples(obj):
        where = obj.__name__ if isinstance(obj, types.ModuleType) else obj.__module__
        return f"doctest does not collect its example from {where}"
    return None


def test_every_module_is_listed():
    assert {"dynamic", "range_report", "RangeRow", "scale_loss", "Float16StateWarning"} <= set(loss_scale.__all__)
    assert "loss_scale.presets" in public_names()
    assert len(public_names()) >= len(loss_scale.__all__) + len(loss_scale.presets.__all__)


@pytest.mark.parametrize("name", public_names())
def test_public_name_has_a_runnable_example(name):
    assert missing_example(resolve(name)) is None, f"{name}: {missing_example(resolve(name))}"


def test_a_name_without_an_example_fails():
    module = types.ModuleType("planted")

    def documented_only() -> None:
        """Says what it does, shows nothing."""

    class Inherits(ValueError):
        pass  # ValueError's docstring is not an example either

    for obj in (documented_only, Inherits):
        obj.__module__ = module.__name__
        setattr(module, obj.__name__, obj)
    assert missing_example(documented_only) == "its docstring has no >>> example"
    assert missing_example(Inherits) == "its docstring has no >>> example"

    def elsewhere() -> None:
        """An example doctest never sees: not defined in the module it names.

        >>> 1 + 1
        2
        """

    elsewhere.__module__ = "loss_scale"
    assert missing_example(elsewhere) == "doctest does not collect its example from loss_scale"


def test_a_module_without_an_example_fails():
    described = types.ModuleType("planted", "Says what the module holds, shows nothing.")
    assert missing_example(described) == "its docstring has no >>> example"
    assert missing_example(types.ModuleType("planted")) == "its docstring has no >>> example"
    shown = types.ModuleType("planted", "Shows it.\n\n>>> 1 + 1\n2\n")
    assert missing_example(shown) is None
