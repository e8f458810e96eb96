"""Importing the repository's scripts (examples, benchmarks, the notebook
builder), which are files rather than packages, in the tests."""

import importlib.util
import pathlib
import sys
from types import ModuleType

ROOT = pathlib.Path(__file__).parents[1]


def load_script(path: pathlib.Path, name: str) -> ModuleType:
    """The script at ``path`` imported as module ``name``, once per session.

    It is registered in ``sys.modules`` before it runs, because dataclasses
    (and flax modules) look their defining module up there.
    """
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module
