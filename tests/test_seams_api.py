"""What users meet at the library's seams: the exception they catch, the
errors of a misplaced argument, docstring examples that run where they are
copied to, and setup instructions that never install another project."""

import doctest
import importlib
import json
import pathlib
import re

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

import loss_scale as ls
import loss_scale.flax as lsf
from loss_scale import equinox as lsq

ROOT = pathlib.Path(__file__).parents[1]
PARAMS = {"w": jnp.ones(3), "b": jnp.zeros(())}
BAD = {"w": jnp.array([1.0, jnp.inf, 1.0]), "b": jnp.zeros(())}


def loss(params, x):
    return jnp.sum(params["w"] * x) + params["b"]


# SkippedStepsError ------------------------------------------------------------


def test_eagerly_the_documented_exception_is_raised_and_can_be_caught(capfd):
    tx = ls.dynamic(optax.sgd(0.1), initial_scale=8.0, max_consecutive_skips=2)
    state = tx.init(PARAMS)
    _, state = tx.update(BAD, state, PARAMS)
    with pytest.raises(ls.SkippedStepsError, match=r"^loss_scale: 2 consecutive steps skipped") as info:
        tx.update(BAD, state, PARAMS)
    assert "['w']" in str(info.value)
    assert "callback failed" not in capfd.readouterr().err


def test_under_jit_the_runtime_error_carries_the_documented_prefix():
    tx = ls.dynamic(optax.sgd(0.1), initial_scale=8.0, max_consecutive_skips=2)
    update = jax.jit(tx.update)
    _, state = update(BAD, tx.init(PARAMS), PARAMS)
    with pytest.raises(jax.errors.JaxRuntimeError) as info:
        jax.block_until_ready(update(BAD, state, PARAMS))
    assert "SkippedStepsError: loss_scale: 2 consecutive steps skipped" in str(info.value)


@pytest.mark.parametrize("jitted", [False, True], ids=["eager", "jit"])
def test_the_message_claims_only_what_the_counters_show(jitted):
    # One skip at 8192 says nothing about other scales.
    tx = ls.dynamic(optax.sgd(0.1), initial_scale=8192.0, max_consecutive_skips=1)
    update = jax.jit(tx.update) if jitted else tx.update
    with pytest.raises((ls.SkippedStepsError, jax.errors.JaxRuntimeError)) as info:
        jax.block_until_ready(update(BAD, tx.init(PARAMS), PARAMS))
    message = str(info.value)
    assert "1 consecutive step skipped" in message and "the scale is now 4096" in message
    assert "at any scale" not in message and "overflow at every scale" not in message
    assert "reached its minimum" not in message


def test_the_message_says_the_minimum_is_reached_only_when_it_is():
    tx = ls.dynamic(optax.sgd(0.1), initial_scale=4.0, min_scale=2.0, max_consecutive_skips=2)
    state = tx.init(PARAMS)
    _, state = tx.update(BAD, state, PARAMS)  # 4 -> 2, the minimum
    with pytest.raises(ls.SkippedStepsError, match=r"the scale is now 2\. .*reached its minimum \(2\)"):
        tx.update(BAD, state, PARAMS)


def test_check_skips_raises_the_documented_exception_outside_jit():
    tx = ls.dynamic(optax.sgd(0.1), initial_scale=8.0, locate_overflows=True)
    update = jax.jit(tx.update)
    state = tx.init(PARAMS)
    for _ in range(2):
        _, state = update(BAD, state, PARAMS)
        ls.check_skips(state, 3)  # below the limit: nothing
    _, state = update(BAD, state, PARAMS)
    stuck = r"^loss_scale: 3 consecutive steps skipped.*now 1\b.*leaves: leaf 1\b"
    with pytest.raises(ls.SkippedStepsError, match=stuck):
        ls.check_skips((state,), 3)  # any optimizer state that holds one
    with pytest.raises(ValueError, match="max_consecutive_skips must be >= 1"):
        ls.check_skips(state, 0)
    with pytest.raises(TypeError, match="outside jit"):
        jax.jit(lambda s: ls.check_skips(s, 3))(state)


def test_the_docs_say_what_to_catch_under_jit():
    doc = ls.SkippedStepsError.__doc__
    assert "jax.errors.JaxRuntimeError" in doc and "SkippedStepsError: loss_scale:" in doc
    guide = (ROOT / "docs" / "guides" / "debugging.md").read_text()
    section = guide[guide.index("## A run that skips every step") :]
    assert "jax.errors.JaxRuntimeError" in section and "ls.check_skips" in section


# Misplaced arguments ------------------------------------------------------------


def test_value_and_grad_without_the_optimizer_state_says_so():
    with pytest.raises(ValueError, match="first argument must be the optimizer state") as info:
        ls.value_and_grad(loss)(PARAMS, jnp.ones(3))
    assert "a dict of 2 arrays" in str(info.value) and "looks like parameters" in str(info.value)
    with pytest.raises(TypeError, match=r"loss_scale.value_and_grad\(fun\)\(opt_state, \*args"):
        ls.value_and_grad(loss)()


def test_value_grad_and_peak_without_the_optimizer_state_says_so():
    first = r"value_grad_and_peak\(fun\)\(opt_state, .*the first argument must be the optimizer state"
    with pytest.raises(ValueError, match=first) as info:
        ls.value_grad_and_peak(loss)(PARAMS, jnp.ones(3))
    assert "a dict of 2 arrays" in str(info.value)


def test_an_optimizer_state_without_loss_scaling_says_how_to_add_it():
    with pytest.raises(ValueError, match="has no loss-scale state") as info:
        ls.value_and_grad(loss)(optax.adam(1e-3).init(PARAMS), PARAMS, jnp.ones(3))
    assert "loss_scale.dynamic(" in str(info.value)


def test_filter_value_and_grad_without_the_optimizer_state_says_so():
    model = eqx.nn.Linear(2, 1, key=jax.random.key(0))
    fun = lambda model, x: jnp.sum(model(x))  # noqa: E731
    with pytest.raises(ValueError, match="first argument must be the optimizer state") as info:
        lsq.filter_value_and_grad(fun)(model, jnp.ones(2))
    assert "a Linear of 2 arrays" in str(info.value)
    with pytest.raises(TypeError, match=r"filter_value_and_grad\(fun\)\(opt_state, model, \*args"):
        lsq.filter_value_and_grad(fun)(model)


def test_nnx_value_and_grad_without_the_optimizer_says_so():
    model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
    fun = lambda model: jnp.sum(model(jnp.ones(2)))  # noqa: E731
    with pytest.raises(TypeError, match=r"nnx_value_and_grad\(loss_fn\)\(optimizer, model, \*args"):
        lsf.nnx_value_and_grad(fun)(model)
    with pytest.raises(ValueError, match=r"first argument must be the nnx.Optimizer \(or its opt_state\)") as info:
        lsf.nnx_value_and_grad(lambda m, x: jnp.sum(m(x)))(model, jnp.ones(2))
    assert "a Linear" in str(info.value)
    plain = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    with pytest.raises(ValueError, match="has no loss-scale state"):
        lsf.nnx_value_and_grad(fun)(plain, model)


# Docstring examples and stale promises ------------------------------------------------

MODULES = ["loss_scale._errors", "loss_scale._grad", "loss_scale.flax", "loss_scale.equinox"]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run_where_they_are_copied_to(name):
    # doctest runs an example with its module's globals; pasted elsewhere it
    # has only what it imports itself.
    module = importlib.import_module(name)
    tests = [t for t in doctest.DocTestFinder().find(module, name) if t.examples]
    assert tests, f"{name} has no examples"
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    for test in tests:
        test.globs = {}
        runner.run(test)
    assert runner.failures == 0


def test_the_fused_flax_steps_promise_only_one_rounding():
    for doc in (lsf.Optimizer.__doc__, lsf.TrainState.__doc__):
        doc = " ".join(doc.split())
        assert "bit for bit on the CPU)" not in doc and "one float32 rounding" in doc


def test_the_docs_do_not_say_state_step_skips_skipped_steps():
    guide = (ROOT / "docs" / "guides" / "frameworks.md").read_text()
    lines = [line for line in guide.splitlines() if "state.step" in line and "#" in line]
    assert lines and not [line for line in lines if "does not count" in line]


# Installing ------------------------------------------------------------------------

#: ``pip install`` (a shell command, or ``"pip", "install"`` in a Python list)
#: and what follows it on the line.
PIP_INSTALL = re.compile(r"""pip['"]?,?\s*['"]?install\b(?P<rest>.*)""")
#: A requirement naming this project by name: ``loss_scale``, ``loss-scale[examples]``,
#: ``loss_scale==0.2`` or ``loss_scale @ url`` (which pip resolves by name too).
BY_NAME = re.compile(r"""(?<![\w./\\-])loss[-_.]?scale(?![\w./\\-])(\[[^\]]*\])?""", re.I)


def installs_by_name(text: str) -> list[str]:
    """The lines of ``text`` that ``pip install`` this project by its name
    (from the package index, where the name is not this project's)."""
    return [m.group(0) for m in PIP_INSTALL.finditer(text) if BY_NAME.search(m.group("rest"))]


def test_the_scan_sees_an_install_by_name():
    assert installs_by_name('[sys.executable, "-m", "pip", "install", "-q", "loss_scale[examples]"]')
    assert installs_by_name("pip install loss-scale")
    assert installs_by_name('`pip install "loss_scale[examples] @ git+<repository URL>"`')
    assert installs_by_name("!pip install -q loss_scale==0.2.0")
    for local in (
        'pip install -e ".[notebooks]"',
        "pip install ./dist/loss_scale-0.2.0-py3-none-any.whl",
        '[sys.executable, "-m", "pip", "install", "-q", *editable, f"{source}[examples]"]',
        "!pip install -e ./loss_scale_repository",
        "pip install jmp",
    ):
        assert not installs_by_name(local), local


def texts() -> dict[str, str]:
    found = {p: p.read_text() for p in [ROOT / "README.md", ROOT / "CHANGELOG.md", *(ROOT / "docs").rglob("*.md")]}
    found |= {p: p.read_text() for p in (ROOT / "notebooks").glob("*.py")}
    for notebook in (ROOT / "notebooks").glob("*.ipynb"):
        found[notebook] = "\n".join("".join(c["source"]) for c in json.loads(notebook.read_text())["cells"])
    return found


def test_nothing_installs_this_project_by_name_from_the_index():
    found = texts()
    assert any(p.suffix == ".ipynb" for p in found) and ROOT / "README.md" in found
    offending = {str(p.relative_to(ROOT)): hits for p, text in found.items() if (hits := installs_by_name(text))}
    assert offending == {}
