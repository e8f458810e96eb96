"""The package's imports run one way: from the numerics up through the rules,
the state, the update and the public factories to the integrations on top
(docs/architecture.md draws it). An import that runs upward, or two modules
of one layer that import each other (a cycle), fails here with the line
that does it.

The unit is a top-level module or subpackage of ``loss_scale``: imports
inside a subpackage (``_rules/predictive.py`` importing ``_rules``) are the
subpackage's own business. Every import counts, including those inside
functions and under ``TYPE_CHECKING``.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "loss_scale"

# Bottom to top. A unit may import units of its own layer (without a cycle)
# and of the layers below it.
LAYERS: dict[str, tuple[str, ...]] = {
    # The one interpreter of jaxprs: it imports nothing of the package.
    "engine": ("_jaxpr",),
    "numerics": (
        "_types",
        "_saturating",
        "_trees",
        "_sharding",
        "_grid",
        "_unscale",
        "_check_gpu",
        "_check",
        "_validate",
        "_signatures",
        "_skip",
        "_autocast",
    ),
    "rules": ("_rules",),
    "state": ("_state", "_packed", "_serialization", "_settings", "_find", "_errors"),
    "update": ("_update", "_low_precision"),
    "factories": ("_options", "_factories", "_precision"),
    "on top": (
        "_grad",
        "_fused",
        "_metrics",
        "_migrate",
        "_probe",
        "_peak",
        "_range_rows",
        "_range_segments",
        "_range_report",
        "_segments",
        "presets",
        "flax",
        "equinox",
        "__init__",
    ),
}
RANK = {unit: rank for rank, units in enumerate(LAYERS.values()) for unit in units}
LAYER_OF = {unit: name for name, units in LAYERS.items() for unit in units}


def unit_of(module: str) -> str | None:
    """``loss_scale._rules.dynamic`` -> ``_rules``; ``loss_scale`` -> ``__init__``;
    ``None`` for modules of other packages."""
    parts = module.split(".")
    if parts[0] != "loss_scale":
        return None
    return parts[1] if len(parts) > 1 else "__init__"


def module_name(path: pathlib.Path, root: pathlib.Path) -> str:
    relative = path.relative_to(root.parent).with_suffix("")
    parts = list(relative.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports(source: str, module: str, is_package: bool) -> list[tuple[int, str, str]]:
    """``(line, imported module, the line's text)`` for every import of a
    ``loss_scale`` module in ``source``; ``from loss_scale import x`` counts
    as importing ``loss_scale.x`` (a submodule, or a name of the package
    itself), relative imports are resolved against ``module``."""
    found = []
    lines = source.splitlines()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = module.split(".") if is_package else module.split(".")[:-1]
                package = package[: len(package) - (node.level - 1)]
                base = ".".join([*package, base] if base else package)
            targets = [f"{base}.{alias.name}" for alias in node.names] if base == "loss_scale" else [base]
        else:
            continue
        found += [(node.lineno, target, lines[node.lineno - 1].strip()) for target in targets]
    return found


def violations(root: pathlib.Path) -> list[str]:
    """Every upward import, every unit without a layer, and every cycle
    between units, described with file, line and text."""
    problems, edges = [], {}
    for path in sorted(root.rglob("*.py")):
        module = module_name(path, root)
        importer = unit_of(module)
        if importer not in RANK:
            problems.append(f"{path.relative_to(root.parent)}: unit {importer!r} has no layer in tests/test_layers.py")
            continue
        for line, target, text in imports(path.read_text(), module, path.name == "__init__.py"):
            imported = unit_of(target)
            if imported is None or imported == importer:
                continue
            if imported not in RANK:
                # ``from loss_scale import x`` where x is a name of the package, not a module.
                imported = "__init__"
            where = f"{path.relative_to(root.parent)}:{line}: {text}"
            if RANK[imported] > RANK[importer]:
                problems.append(
                    f"{where}: {importer} ({LAYER_OF[importer]}) imports {imported} ({LAYER_OF[imported]}), "
                    "a layer above it"
                )
            edges.setdefault(importer, {}).setdefault(imported, where)
    problems += [f"import cycle {' -> '.join(cycle)}: {where}" for cycle, where in _cycles(edges)]
    return problems


def _cycles(edges: dict[str, dict[str, str]]) -> list[tuple[list[str], str]]:
    """One cycle through each unit that lies on one, with the import that
    closes it."""
    found, reported = [], set()
    for start in sorted(edges):
        stack = [(start, [start])]
        seen = set()
        while stack:
            unit, path = stack.pop()
            for nxt, where in sorted(edges.get(unit, {}).items()):
                if nxt == start:
                    key = frozenset(path)
                    if key not in reported:
                        reported.add(key)
                        found.append(([*path, start], where))
                elif nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, [*path, nxt]))
    return found


def test_imports_run_one_way_and_form_no_cycle():
    problems = violations(PACKAGE)
    assert not problems, "\n".join(problems)


def test_every_layer_names_existing_units():
    units = {
        p.stem if p.is_file() else p.name
        for p in PACKAGE.iterdir()
        if p.suffix == ".py" or (p / "__init__.py").exists()
    }
    assert set(RANK) == units, (
        f"in LAYERS but not in the package: {set(RANK) - units}; not in LAYERS: {units - set(RANK)}"
    )


def test_rules_import_nothing_above_the_numerics():
    # Rules are pure functions of arrays: no state, update, options or factories.
    for path in (PACKAGE / "_rules").rglob("*.py"):
        module = module_name(path, PACKAGE)
        for line, target, text in imports(path.read_text(), module, path.name == "__init__.py"):
            unit = unit_of(target)
            assert unit is None or unit == "_rules" or RANK[unit] <= RANK["_check"], f"{path.name}:{line}: {text}"


def write_package(tmp_path: pathlib.Path, files: dict[str, str]) -> pathlib.Path:
    root = tmp_path / "loss_scale"
    for name, source in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(source)
    for unit in RANK:
        if unit == "__init__":
            (root / "__init__.py").touch()
        elif unit in ("_rules", "presets"):
            (root / unit).mkdir(exist_ok=True)
            (root / unit / "__init__.py").touch()
        elif not (root / f"{unit}.py").exists() and unit not in ("flax", "equinox"):
            (root / f"{unit}.py").touch()
    (root / "flax.py").touch()
    (root / "equinox.py").touch()
    return root


@pytest.mark.parametrize(
    ("files", "expected"),
    [
        # A rule importing the update: upward, named with its line.
        (
            {"_rules/dynamic.py": "import jax\nfrom loss_scale._update import loss_scaled\n"},
            "loss_scale/_rules/dynamic.py:2: from loss_scale._update import loss_scaled: _rules (rules) imports "
            "_update (update), a layer above it",
        ),
        # Relative and in-function imports count too.
        (
            {"_check.py": "def f():\n    from . import _state\n"},
            "loss_scale/_check.py:2: from . import _state: _check (numerics) imports _state (state)",
        ),
        ({"_rules/static.py": "from .. import _factories\n"}, "_rules (rules) imports _factories (factories)"),
        # Two units of one layer importing each other.
        (
            {"_state.py": "from loss_scale._find import find_state\n", "_find.py": "import loss_scale._state\n"},
            "import cycle _find -> _state -> _find",
        ),
        # A new module must be placed in a layer.
        ({"_new.py": "x = 1\n"}, "unit '_new' has no layer"),
    ],
)
def test_the_check_finds_what_it_must(tmp_path, files, expected):
    problems = violations(write_package(tmp_path, files))
    assert any(expected in problem for problem in problems), problems


def test_the_check_accepts_downward_imports(tmp_path):
    files = {
        "_update.py": "from loss_scale._rules import Rule\nfrom loss_scale._state import LossScaleState\n",
        "_rules/dynamic.py": "from loss_scale._rules import RuleState\nfrom loss_scale._saturating import increment\n",
        "presets/_torch.py": "from loss_scale.presets._common import x\nfrom loss_scale._update import loss_scaled\n",
    }
    assert violations(write_package(tmp_path, files)) == []
