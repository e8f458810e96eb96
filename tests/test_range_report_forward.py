"""``ls.range_report`` when the forward pass is what went wrong, and on the
models people write: a forward overflow named first (no loss scale fixes
it), the whole module path in the table, the user's file:line rather than
the framework's, notes in words, and a loss with a named axis
(``axis_name``).

Float16: the forward overflows here are infinities (a float16 square of
1000, a float16 product of 120000), the same in every program; the safe
scale is compared with a brute-force scan only where the deciding
cotangent is a power of two times an exact float16 value far from the
overflow boundary."""

import math
import pathlib
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import loss_scale as ls
from loss_scale._range_rows import format_report

F16 = jnp.float16
HERE = pathlib.Path(__file__)


def line_of(marker: str) -> int:
    """The line of this file that holds ``marker`` (once)."""
    lines = [i for i, text in enumerate(HERE.read_text().splitlines(), 1) if marker in text and "line_of(" not in text]
    assert len(lines) == 1, (marker, lines)
    return lines[0]


def table_rows(text: str) -> list[str]:
    """The ``where`` cells of the rows ``str(report)`` prints, each put back
    together from its wrapped lines (a line starting with two spaces
    continues the one above: broken after ``/`` or ``]``, or at a space)."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("where "))
    width = lines[start].index("  op ") + 2
    cells = []
    for line in lines[start + 1 :]:
        if not line or line.startswith(("... ", "with the boundaries")):
            break
        cell = line[:width].rstrip()
        if cell.startswith("  "):
            piece = cell.strip()
            cells[-1] += piece if cells[-1].endswith(("/", "]")) else " " + piece
        else:
            cells.append(cell)
    return cells


# --- 1. forward overflows first -----------------------------------------------------------


def square_loss(x, w):
    """``x**2`` in float16 (inf for |x| >= 256), then a chain of 25 float16
    products of ``w`` whose cotangents are the loss scale itself (headroom
    2 at 2**15): they sort first by headroom."""
    h = jnp.sum((x.astype(F16) ** 2).astype(jnp.float32))  # the square that overflows
    v = w.astype(F16)
    for _ in range(25):
        v = v * F16(1.0)
    return h + jnp.sum(v.astype(jnp.float32))


def test_a_float16_square_that_overflows_is_named_first_and_always_printed():
    x, w = jnp.full((4,), 1000.0), jnp.full((4,), 0.5)
    report = ls.range_report(square_loss, x, w, argnums=(0, 1), scale=2.0**15)
    square = [r for r in report.rows if r.primitive == "integer_pow"]
    assert report.forward_overflowing == square, str(report)
    (row,) = square
    assert row.forward_overflows and row.forward_max == math.inf and row.dtype == "float16"
    # What it makes non-finite downstream is inf without the flag.
    after = [r for r in report.rows if r.index > row.index and r.forward_max == math.inf]
    assert after and not any(r.forward_overflows for r in after)

    text = str(report)
    head = text.splitlines()
    where = f"{HERE.name}:{line_of('# the square that overflows')} (square_loss)"
    assert head[0].startswith("forward overflow: 1 operation overflows in the forward pass"), head[0]
    assert "no loss scale fixes" in head[0] and f"first: integer_pow at {where}" in head[0]
    assert head[1].startswith("range report at scale 32768") and "(of the backward pass alone)" in head[1]
    # The cause is the table's first row, though 25 rows have less headroom
    # and the table shows 20; and it is printed at any limit.
    assert len(report.rows) > 25 and row.headroom > 2 * min(r.headroom for r in report.rows)
    assert (
        table_rows(text)[0] == where
        and "FORWARD OVERFLOW"
        in text.splitlines()[head.index(next(line for line in head if line.startswith("where "))) + 1]
    )
    assert table_rows(format_report(report, limit=1)) == [where]
    # max_safe_scale is the backward pass's: d(x**2) = 2x * scale overflows
    # float16 above 2**5 (2000 * 2**5 = 64000 < 65504 < 128000), as jax.grad says.
    assert report.max_safe_scale == 2.0**5
    for k, finite in ((5, True), (6, False)):
        g = jax.grad(lambda x, k=k: square_loss(x, w) * 2.0**k)(x)
        assert bool(jnp.all(jnp.isfinite(g))) == finite


def test_a_flax_dense_whose_float16_product_overflows_under_autocast():
    nn = pytest.importorskip("flax.linen")

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.Dense(4, kernel_init=nn.initializers.constant(100.0), name="wide")(x)  # the product that overflows
            return nn.Dense(1, name="head")(x)

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            return Block(name="block")(x)

    model = Model()
    x = jnp.full((2, 4), 300.0)  # 4 * 300 * 100 = 120000 > 65504: finite in float32, inf in float16
    params = model.init(jax.random.key(0), x)
    loss_fn = lambda p, x: jnp.mean(model.apply(p, x))  # noqa: E731
    assert bool(jnp.isfinite(loss_fn(params, x)))
    report = ls.range_report(ls.autocast(loss_fn), params, x)
    causes = report.forward_overflowing
    assert [(r.primitive, r.dtype) for r in causes] == [("dot_general", "float16")], str(report)
    where = f"Model/block/wide {HERE.name}:{line_of('# the product that overflows')} (Block.__call__)"
    assert causes[0].where == where and causes[0].library.startswith("flax/linen/linear.py:")
    head = str(report).splitlines()[0]
    assert head.startswith("forward overflow: 1 operation") and f"first: dot_general at {where}" in head
    assert table_rows(str(report))[0] == where
    # The head's product reads the inf: not finite, not a cause.
    assert any(r.forward_max == math.inf and "head" in r.where for r in report.rows)


def test_an_argument_that_is_not_finite_in_the_compute_dtype_and_a_data_input():
    loss_fn = lambda w, x: jnp.sum(w * x)  # noqa: E731
    big, ones = jnp.full((3,), 1e5), jnp.ones(3)
    report = ls.range_report(loss_fn, big, ones, compute_dtype="float16")  # 1e5 is inf in float16
    assert [(r.primitive, r.where) for r in report.forward_overflowing] == [("argument", "args[0]")]
    assert str(report).startswith("forward overflow: 1 operation")
    # The data (not differentiated, no row) is not finite: every value that
    # reads it is, from an input of the loss function.
    report = ls.range_report(loss_fn, ones, big, compute_dtype="float16")
    assert not report.forward_overflowing
    head = str(report).splitlines()[0]
    assert head.startswith("forward pass not finite: 4 values are inf or nan because an input of the loss function")
    assert f"first: mul at {HERE.name}:" in head


def _causal_lm_loss(fill):
    """A causal attention row's log-softmax in float16, the masked scores
    set to ``fill``, and the loss read from the diagonal (never masked)."""

    def loss_fn(w, x, fill=fill):
        scores = (x @ w).astype(jnp.float16)
        masked = jnp.where(jnp.tril(jnp.ones((8, 8), bool)), scores, fill)
        return -jnp.mean(jnp.diagonal(jax.nn.log_softmax(masked, axis=-1)).astype(jnp.float32))

    return loss_fn


def test_a_mask_constant_that_is_inf_in_float16_is_reported_as_absorbed_not_as_a_bad_input():
    # -2.38e38 is beyond float16's range: the fill is -inf, deliberately,
    # and the softmax after it is finite.
    w, x = jnp.full((4, 8), 0.1), jnp.ones((8, 4))
    with warnings.catch_warnings():  # numpy's overflow warning, where jax casts the fill eagerly
        warnings.simplefilter("ignore", RuntimeWarning)
        report = ls.range_report(_causal_lm_loss(-2.38e38), w, x)
    assert report.loss_finite and report.inputs_finite and not report.forward_overflowing
    assert any(r.forward_max == math.inf for r in report.rows)
    lines = str(report).splitlines()
    assert lines[0].startswith("range report at scale") and "(of the backward pass alone)" not in lines[0]
    # (jax 0.10.2 evaluates log_softmax inside, 3 values; from 0.12.1 it is
    # one custom_jvp row, 2 values.)
    assert re.match(r"masked: [23] values are inf or nan from a constant of the program", lines[1]), lines[1]
    assert "absorbed before the loss, which is finite" in lines[1] and "first: select_n" in lines[1]
    assert "input of the loss function" not in str(report)
    # The same mask with a finite fill has nothing to report.
    finite = ls.range_report(_causal_lm_loss(float(jnp.finfo(jnp.float16).min)), w, x)
    assert finite.loss_finite and not any(line.startswith("masked") for line in str(finite).splitlines())


def test_a_mask_that_reaches_the_loss_is_a_failure_and_an_absorbed_input_mask_is_not():
    w, x = jnp.full((4, 8), 0.1), jnp.ones((8, 4))

    def unabsorbed(w, x):  # the masked scores are averaged into the loss
        scores = (x @ w).astype(jnp.float16)
        return jnp.mean(jnp.where(jnp.tril(jnp.ones((8, 8), bool)), scores, -2.38e38).astype(jnp.float32))

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        report = ls.range_report(unabsorbed, w, x)
    assert not report.loss_finite and report.inputs_finite
    head = str(report).splitlines()[0]
    assert re.match(r"forward pass not finite: \d+ values are inf or nan from a constant of the program", head), head
    assert "and so is the loss" in head and "input of the loss function" not in head

    def with_bias(w, x, bias):  # an additive mask passed in, -inf where masked
        scores = (x @ w).astype(jnp.float16) + bias
        return -jnp.mean(jnp.diagonal(jax.nn.log_softmax(scores, axis=-1)).astype(jnp.float32))

    bias = jnp.where(jnp.tril(jnp.ones((8, 8), bool)), 0.0, -jnp.inf).astype(jnp.float16)
    report = ls.range_report(with_bias, w, x, bias)
    assert report.loss_finite and not report.inputs_finite
    (masked,) = [line for line in str(report).splitlines() if line.startswith("masked:")]
    assert "because an input of the loss function is, and absorbed before the loss" in masked


# --- 2. the whole module path ---------------------------------------------------------------


def test_a_deep_linen_module_path_is_printed_whole():
    nn = pytest.importorskip("flax.linen")

    class Projection(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(3, name="output_projection_with_a_long_name")(x)

    class Attention(nn.Module):
        @nn.compact
        def __call__(self, x):
            return Projection(name="multi_head_attention_block")(x)

    class Layer(nn.Module):
        @nn.compact
        def __call__(self, x):
            return Attention(name="self_attention_sublayer")(x)

    class Encoder(nn.Module):
        @nn.compact
        def __call__(self, x):
            return Layer(name="transformer_encoder_layer_0")(x)

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            return Encoder(name="encoder_stack")(x)

    model = Model()
    params = model.init(jax.random.key(0), jnp.ones((2, 4)))
    report = ls.range_report(lambda p, x: jnp.mean(model.apply(p, x)), params, jnp.ones((2, 4)))
    path = (
        "Model/encoder_stack/transformer_encoder_layer_0/self_attention_sublayer/"
        "multi_head_attention_block/output_projection_with_a_long_name"
    )
    deep = [r for r in report.rows if r.where.startswith(path + " ")]
    assert {r.primitive for r in deep} >= {"dot_general", "add"}, str(report)
    text = str(report)
    cells = table_rows(text)
    # Every row printed whole: the table's cells are the rows' where, in order.
    assert len(cells) == len(report.rows) and sorted(cells) == sorted(r.where for r in report.rows)
    assert sum(cell.startswith(path + " ") for cell in cells) == len(deep)
    where_width = next(line for line in text.splitlines() if line.startswith("where ")).index("  op ")
    assert where_width <= 60 and "..." not in text


# --- 3. the user's line, not the framework's ------------------------------------------------


def test_a_linen_dense_row_is_at_the_users_line():
    nn = pytest.importorskip("flax.linen")

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(3)(x)  # the user's call: linen

    model = Model()
    params = model.init(jax.random.key(0), jnp.ones((2, 4)))
    report = ls.range_report(lambda p, x: jnp.mean(model.apply(p, x)), params, jnp.ones((2, 4)))
    (row,) = [r for r in report.rows if r.primitive == "dot_general"]
    assert (
        row.where == f"Model/Dense_0 {HERE.name}:{line_of('# the user' + chr(39) + 's call: linen')} (Model.__call__)"
    )
    assert row.library.startswith("flax/linen/linear.py:") and row.library.endswith("(Dense.__call__)")


def test_an_nnx_linear_row_is_at_the_users_line():
    nnx = pytest.importorskip("flax.nnx")

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.linear = nnx.Linear(4, 3, rngs=rngs)

        def __call__(self, x):
            return self.linear(x)  # the user's call: nnx

    graphdef, state = nnx.split(Model(nnx.Rngs(0)))
    report = ls.range_report(lambda s, x: jnp.mean(nnx.merge(graphdef, s)(x)), state, jnp.ones((2, 4)))
    (row,) = [r for r in report.rows if r.primitive == "dot_general"]
    assert row.where.endswith(f"{HERE.name}:{line_of('# the user' + chr(39) + 's call: nnx')} (Model.__call__)")
    assert row.library.startswith("flax/nnx/nn/linear.py:") and row.library.endswith("(Linear.__call__)")


def test_an_equinox_linear_row_is_at_the_users_line():
    eqx = pytest.importorskip("equinox")

    class Model(eqx.Module):
        linear: eqx.nn.Linear

        def __init__(self, key):
            self.linear = eqx.nn.Linear(4, 3, key=key)

        def __call__(self, x):
            return self.linear(x)  # the user's call: equinox

    report = ls.range_report(
        lambda m, x: jnp.mean(jax.vmap(m)(x)), Model(jax.random.key(0)), jnp.ones((2, 4)), compute_dtype="float16"
    )
    (row,) = [r for r in report.rows if r.primitive == "dot_general"]
    assert row.where.endswith(f"{HERE.name}:{line_of('# the user' + chr(39) + 's call: equinox')} (Model.__call__)")
    assert row.library.startswith("equinox/nn/_linear.py:") and row.dtype == "float16"


def test_a_row_made_in_the_users_own_code_has_no_library_line():
    report = ls.range_report(lambda w: jnp.sum(jnp.tanh(w)), jnp.ones(3))
    assert all(r.library == "" for r in report.rows)


# --- 4. notes in words ----------------------------------------------------------------------


def test_the_notes_say_what_was_looked_into_and_what_the_numbers_mean():
    @jax.jit
    def block(w, x):
        return jnp.tanh(x @ w)

    def loss_fn(w, x):
        h = jax.nn.relu(jax.checkpoint(block)(w, x))
        h, _ = jax.lax.scan(lambda c, _: (c * 0.5, None), h, None, length=2)
        h = jax.lax.cond(True, lambda h: h * 2.0, lambda h: h, h)
        return jnp.mean(h)

    report = ls.range_report(loss_fn, jnp.ones((4, 3)), jnp.ones((2, 4)))
    inside, whole, *meaning = report.notes.splitlines()
    assert inside.startswith("looked into (each operation inside has a row of its own): ")
    assert "jit (jax.jit functions" in inside and "jax.checkpoint" in inside
    assert whole.startswith("kept whole (a row per output, none for the operations inside): ")
    for words in ("custom_jvp_call (functions with their own derivative rule, jax.custom_jvp", "scan (lax.scan"):
        assert words in whole
    assert "cond (lax.cond" in whole
    meaning = " ".join(line.strip() for line in meaning)
    assert "an overflow inside shows only where it comes out: in the forward pass as an output that is not" in meaning
    assert report.notes in str(report)


def test_every_call_the_report_can_meet_has_words():
    # The calls the engine knows (its table of structured primitives): each
    # is looked into or kept whole, and the notes name it in words.
    from loss_scale._jaxpr._structured import TABLE
    from loss_scale._range_report import _INSIDE, _WHOLE, _notes

    assert set(TABLE) <= set(_INSIDE) | set(_WHOLE)
    for name in TABLE:
        assert f"{name} (" in _notes({name}, set()) + _notes(set(), {name})


# --- 5. a named axis ------------------------------------------------------------------------


def centred_loss(w, x, axis_name=None):
    """A mean-centred square; with ``axis_name`` the mean is also averaged
    over that axis (``pmean``), as a data-parallel step does."""
    h = x @ w
    mean = jnp.mean(h, axis=0, keepdims=True)
    if axis_name is not None:
        mean = jax.lax.pmean(mean, axis_name)
    return jnp.mean((h - mean) ** 2)


def test_a_pmean_over_a_named_axis_needs_axis_name_and_works_with_it():
    w = jax.random.normal(jax.random.key(0), (4, 3))
    x = jax.random.normal(jax.random.key(1), (8, 4))
    with pytest.raises(
        NameError, match=r"reduces over the named axis 'batch'.*range_report\(\.\.\., axis_name='batch'\)"
    ):
        ls.range_report(lambda w, x: centred_loss(w, x, "batch"), w, x)
    report = ls.range_report(lambda w, x: centred_loss(w, x, "batch"), w, x, axis_name="batch")
    plain = ls.range_report(centred_loss, w, x)
    # One member of the axis: the pmean returns its operand, and the
    # argument's gradient and the safe scale are those without it.
    assert any(r.primitive == "psum" for r in report.rows)
    assert report.max_safe_scale == plain.max_safe_scale == 2.0**127
    np.testing.assert_allclose(report.rows[0].backward_max, plain.rows[0].backward_max, rtol=1e-6)
    two = ls.range_report(lambda w, x: jax.lax.psum(centred_loss(w, x, ("a", "b")), "a"), w, x, axis_name=("a", "b"))
    np.testing.assert_allclose(two.rows[0].backward_max, plain.rows[0].backward_max, rtol=1e-6)


def test_a_linen_batch_norm_with_axis_name():
    nn = pytest.importorskip("flax.linen")

    class Model(nn.Module):
        axis_name: str | None = None

        @nn.compact
        def __call__(self, x):
            x = nn.Dense(8)(x)
            x = nn.BatchNorm(use_running_average=False, axis_name=self.axis_name)(x)
            return nn.Dense(1)(x)

    x = jax.random.normal(jax.random.key(1), (16, 4))
    variables = Model().init(jax.random.key(0), x)

    def loss_of(model):
        def loss_fn(params, x):
            out, updates = model.apply(
                {"params": params, "batch_stats": variables["batch_stats"]}, x, mutable=["batch_stats"]
            )
            return jnp.mean(out**2), updates

        return loss_fn

    with pytest.raises(NameError, match="axis_name='batch'"):
        ls.range_report(loss_of(Model("batch")), variables["params"], x, has_aux=True)
    report = ls.range_report(loss_of(Model("batch")), variables["params"], x, has_aux=True, axis_name="batch")
    plain = ls.range_report(loss_of(Model()), variables["params"], x, has_aux=True)
    arguments = lambda r: {row.where: row.backward_max for row in r.rows if row.primitive == "argument"}  # noqa: E731
    got, want = arguments(report), arguments(plain)
    assert got.keys() == want.keys() and len(got) == 6
    # Dense_0's bias has a gradient of exactly 0 in exact arithmetic (the
    # norm subtracts the batch mean): what is left is rounding noise, whose
    # size depends on how the program is fused (2x apart on jax 0.12 with
    # and without the pmean), so it is compared within a millionth of the
    # largest gradient.
    atol = 1e-6 * max(want.values())
    np.testing.assert_allclose([got[k] for k in want], list(want.values()), rtol=1e-5, atol=atol)
    assert got["args[0]['Dense_0']['bias']"] <= atol
    assert report.max_safe_scale == plain.max_safe_scale
    assert any("BatchNorm_0" in r.where for r in report.rows)
