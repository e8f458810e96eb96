"""The keyword options are declared once (``loss_scale/_options.py``) and
everything else follows from that declaration: every factory's and preset's
signature and docstring, the tables of the API overview (docs/api/index.md).
A test fails when any of them drifts."""

import ast
import inspect
import pathlib
import re

import jax.numpy as jnp
import optax
import pytest

import loss_scale as ls
from loss_scale._options import OPTIONS

API = (pathlib.Path(__file__).parents[1] / "docs" / "api" / "index.md").read_text()

TAKE_OPTIONS = {
    "dynamic": ls.dynamic,
    "predictive": ls.predictive,
    "static": ls.static,
    **{f"presets.{name}": getattr(ls.presets, name) for name in ls.presets.__all__},
}
EXCLUDED = {"presets.cerebras": {"max_grad_norm"}}  # it takes Cerebras' own max_gradient_norm


@pytest.mark.parametrize("name", sorted(TAKE_OPTIONS))
def test_every_factory_takes_every_option_with_its_default_and_doc(name):
    function = TAKE_OPTIONS[name]
    parameters = inspect.signature(function).parameters
    expected = {option: spec for option, spec in OPTIONS.items() if option not in EXCLUDED.get(name, set())}
    for option, spec in expected.items():
        assert parameters[option].kind is inspect.Parameter.KEYWORD_ONLY, (name, option)
        assert parameters[option].default == spec.default, (name, option)
        # The docstring documents it (the first words of its doc, wrapped anyhow).
        first_words = " ".join(spec.doc.split()[:4])
        assert first_words in " ".join(function.__doc__.split()), (name, option)
    for option in EXCLUDED.get(name, set()):
        assert option not in parameters


@pytest.mark.parametrize("name", sorted(TAKE_OPTIONS))
def test_every_option_reaches_the_transformation(name):
    # Each option is accepted by keyword and changes what the state keeps.
    function = TAKE_OPTIONS[name]
    args = (optax.sgd(0.1), 2.0) if name == "static" else (optax.sgd(0.1),)
    params = {"w": jnp.zeros(2)}
    state = function(*args, track_grad_norm=True, locate_overflows=True, track_underflow=True).init(params)
    assert state.record.grad_norm is not None and state.record.zero_fraction is not None
    assert state.record.nonfinite_leaves.shape == (1,)
    with pytest.raises(TypeError, match="unexpected keyword argument 'track_grad_nrom'"):
        function(*args, track_grad_nrom=True)


def table_calls():
    """``{name: (parameters, defaults, takes **options)}`` for each row of the
    API overview's table that shows a call."""
    calls = {}
    for row in re.findall(r"^\| `(ls\.[\w.]+\(.*?\))` \|", API, flags=re.MULTILINE):
        node = ast.parse(row.replace(", *,", ","), mode="eval").body  # "*" marks keyword-only parameters
        assert isinstance(node, ast.Call), row
        name = ast.unparse(node.func).removeprefix("ls.")
        names = [ast.unparse(a) for a in node.args]
        defaults = {}
        for keyword in node.keywords:
            if keyword.arg is None:
                names.append("**" + ast.unparse(keyword.value))
            else:
                names.append(keyword.arg)
                defaults[keyword.arg] = eval(ast.unparse(keyword.value), {"jnp": jnp})  # noqa: S307
        calls[name] = names, defaults
    return calls


def actual(name):
    function = ls
    for part in name.split("."):
        function = getattr(function, part)
    parameters = inspect.signature(function).parameters
    names, defaults = [], {}
    takes_options = name in TAKE_OPTIONS
    for parameter in parameters.values():
        if takes_options and parameter.name in OPTIONS:
            continue
        if parameter.kind is inspect.Parameter.VAR_KEYWORD:
            names.append("**" + parameter.name)
            continue
        if parameter.kind is inspect.Parameter.VAR_POSITIONAL:
            names.append("*" + parameter.name)
            continue
        names.append(parameter.name)
        if parameter.default is not inspect.Parameter.empty:
            defaults[parameter.name] = parameter.default
    if takes_options:
        names.append("**options")
    return names, defaults


def test_the_api_table_matches_the_signatures():
    calls = table_calls()
    public = {n for n in ls.__all__ if callable(getattr(ls, n)) and not isinstance(getattr(ls, n), type)}
    public |= {f"presets.{n}" for n in ls.presets.__all__}
    public |= {"Policy"}
    assert public - {"presets"} <= set(calls), f"missing from the API table: {public - set(calls)}"
    for name, (names, defaults) in calls.items():
        assert (names, defaults) == actual(name), name


def test_the_options_table_matches_the_declaration():
    table = API[API.index("| option | default | what it does |") :]
    rows = re.findall(r"^\| `(\w+)` \| `([^`]*)` \|", table[: table.index("\n\n")], flags=re.MULTILINE)
    assert [name for name, _ in rows] == list(OPTIONS)
    for name, default in rows:
        assert eval(default) == OPTIONS[name].default, name  # noqa: S307
