"""Constructor validation, property-tested against an independent oracle.

For every setting of ``dynamic``, ``predictive``, ``static`` and the presets,
any value (a number of any size, inf, nan, a numeric string, a bool, None, a
complex, a NumPy scalar...) is either rejected when the optimizer is built,
with an error naming the argument, or trains without an error: nothing out
of range or not representable in the dtype the rule computes in (float32
scales and factors, int32 counters) gets through.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import loss_scale as ls

F32_MAX = float(np.finfo(np.float32).max)
F32_TINY = float(np.finfo(np.float32).tiny)
I32_MAX = 2**31 - 1


def f32(x):
    with np.errstate(over="ignore"):
        return float(np.float32(x))


def is_real(v):
    return isinstance(v, int | float | np.integer | np.floating) and not isinstance(v, bool | np.bool_)


# The oracle: what each kind of setting accepts, written from its definition.
def scale(v):
    return is_real(v) and math.isfinite(float(v)) and v > 0 and math.isfinite(f32(v)) and f32(v) >= F32_TINY


def ceiling(v):
    return scale(v) or (is_real(v) and float(v) == math.inf)


def growth(v):
    return is_real(v) and not math.isnan(float(v)) and math.isfinite(f32(v)) and f32(v) > 1


def backoff(v):
    return is_real(v) and not math.isnan(float(v)) and v > 0 and F32_TINY <= f32(v) < 1


def count(low=1, high=I32_MAX, integral_float=False):
    def check(v):
        if integral_float and isinstance(v, float | np.floating) and float(v).is_integer():
            v = int(v)
        return isinstance(v, int | np.integer) and not isinstance(v, bool | np.bool_) and low <= v <= high

    def right_type(v):
        if isinstance(v, bool | np.bool_):
            return False
        integral = isinstance(v, float | np.floating) and math.isfinite(float(v)) and float(v).is_integer()
        return isinstance(v, int | np.integer) or (integral_float and integral)

    check.right_type = right_type
    return check


def flag(v):
    return isinstance(v, bool | np.bool_)


def optional(kind):
    def check(v):
        return v is None or kind(v)

    if hasattr(kind, "right_type"):
        check.right_type = lambda v: v is None or kind.right_type(v)
    else:
        check.right_type = lambda v: v is None or not wrong_type(kind, v)
    return check


def wrong_type(kind, v):
    """Whether a rejection of ``v`` should be a TypeError (not a ValueError)."""
    if kind is flag:
        return True
    if hasattr(kind, "right_type"):  # counts take ints (and integral floats where a peer types them as floats)
        return not kind.right_type(v)
    return isinstance(v, bool | np.bool_) or v is None or not is_real(v)


SPECIAL = [0, 1, 2, -1, 0.5, 2.0**15, 1e38, 3.5e38, 1e39, 1e-38, 1e-39, 1e-45, 1e-46, 1 + 1e-9, 1 - 1e-9]
SPECIAL += [1 + 1e-7, 1 - 1e-7, 2**31 - 1, 2**31, 2**40, 1000.0, 2.5, math.inf, -math.inf, math.nan, 64, 65, -64]
VALUES = st.one_of(
    st.sampled_from(SPECIAL),
    st.floats(allow_nan=True, allow_infinity=True),
    st.integers(-(2**40), 2**40),
    st.sampled_from([None, True, False, "1024", "2", "1.0", b"1", 1 + 2j, [1.0], np.bool_(True)]),
    st.sampled_from([np.float32(2.0), np.float64(1e39), np.int64(3), np.int32(2000), np.float16(0.5)]),
)

FACTORIES = {
    "dynamic": (
        ls.dynamic,
        {
            "initial_scale": scale,
            "growth_factor": growth,
            "backoff_factor": backoff,
            "growth_interval": count(),
            "min_scale": scale,
            "max_scale": ceiling,
            "hysteresis": count(),
            "consecutive_hysteresis": flag,
            "max_grad_norm": optional(scale),
            "track_grad_norm": flag,
            "locate_overflows": flag,
            "max_consecutive_skips": optional(count()),
            "track_underflow": flag,
        },
        {"initial_scale": 2.0**15, "min_scale": 1.0, "max_scale": 2.0**24},
        lambda a: f32(a["min_scale"]) <= f32(a["initial_scale"]) <= f32(a["max_scale"]),
    ),
    "predictive": (
        ls.predictive,
        {
            "initial_scale": scale,
            "min_headroom": count(-64, 64),
            "headroom_interval": count(),
            "peak_half_life": lambda v: is_real(v) and 1 <= float(v) < math.inf,
            "min_scale": scale,
            "max_scale": ceiling,
            "initial_headroom": count(-64, 64),
        },
        {"initial_scale": 2.0**15, "min_scale": 1.0, "max_scale": 2.0**24, "min_headroom": 1, "initial_headroom": 12},
        lambda a: (
            f32(a["min_scale"]) <= f32(a["initial_scale"]) <= f32(a["max_scale"])
            and a["initial_headroom"] >= a["min_headroom"]
        ),
    ),
    "static": (lambda inner, **kw: ls.static(inner, **kw), {"scale": scale}, {"scale": 1.0}, lambda a: True),
    "torch": (
        ls.presets.torch,
        {
            "init_scale": scale,
            "growth_factor": growth,
            "backoff_factor": backoff,
            "growth_interval": count(),
            "enabled": flag,
        },
        {},
        lambda a: True,
    ),
    "keras": (ls.presets.keras, {"initial_scale": scale, "dynamic_growth_steps": count()}, {}, lambda a: True),
    "deepspeed": (
        ls.presets.deepspeed,
        {
            "initial_scale_power": count(-126, 127),
            "loss_scale_window": count(1, I32_MAX - 1),
            "hysteresis": count(),
            "consecutive_hysteresis": flag,
            "min_loss_scale": scale,
        },
        {"initial_scale_power": 16, "min_loss_scale": 1.0},
        lambda a: f32(a["min_loss_scale"]) <= 2.0 ** a["initial_scale_power"],
    ),
    "megatron": (
        ls.presets.megatron,
        {
            "initial_loss_scale": scale,
            "min_loss_scale": scale,
            "loss_scale_window": count(integral_float=True),
            "hysteresis": count(),
        },
        {"initial_loss_scale": 2.0**32, "min_loss_scale": 1.0},
        lambda a: f32(a["min_loss_scale"]) <= f32(a["initial_loss_scale"]),
    ),
    "jmp": (
        ls.presets.jmp,
        {
            "loss_scale": scale,
            "period": count(),
            "factor": count(2, 2**126, integral_float=True),
            "min_loss_scale": scale,
        },
        {"loss_scale": 2.0**15, "min_loss_scale": 1.0},
        lambda a: f32(a["min_loss_scale"]) <= f32(a["loss_scale"]),
    ),
    "flax": (
        ls.presets.flax,
        {
            "scale": scale,
            "growth_factor": growth,
            "backoff_factor": backoff,
            "growth_interval": count(0, I32_MAX - 1),
            "minimum_scale": optional(scale),
        },
        {"scale": 65536.0, "minimum_scale": None},
        lambda a: (F32_TINY if a["minimum_scale"] is None else f32(a["minimum_scale"])) <= f32(a["scale"]),
    ),
}


def check_construction(name, arguments):
    """Build with ``arguments``; compare with the oracle. Returns the
    transformation when it was accepted."""
    factory, kinds, defaults, combined = FACTORIES[name]
    bad = [arg for arg, value in arguments.items() if not kinds[arg](value)]
    if not bad:
        settings_ = {**defaults, **arguments}
        valid = combined({k: v for k, v in settings_.items() if k in kinds})
    else:
        valid = False
    if valid:
        return factory(optax.sgd(0.1), **arguments)
    with pytest.raises((TypeError, ValueError)) as info:
        factory(optax.sgd(0.1), **arguments)
    others = {**defaults, **{k: v for k, v in arguments.items() if k not in bad}}
    if len(bad) == 1 and combined({k: v for k, v in others.items() if k in kinds or k in defaults}):
        # One bad setting among consistent others: the error is about it.
        arg = bad[0]
        assert arg in str(info.value), (name, arguments, info.value)
        expected = TypeError if wrong_type(kinds[arg], arguments[arg]) else ValueError
        assert info.type is expected, (name, arguments, info.value)
    return None


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(name=st.sampled_from(sorted(FACTORIES)), data=st.data())
def test_any_setting_is_accepted_exactly_when_the_oracle_says_so(name, data):
    _, kinds, _, _ = FACTORIES[name]
    chosen = data.draw(st.lists(st.sampled_from(sorted(kinds)), min_size=1, max_size=3, unique=True))
    arguments = {arg: data.draw(VALUES, label=arg) for arg in chosen}
    check_construction(name, arguments)


# Values that are valid for their kind, to find accepted settings that fail
# later: extremes of every range.
VALID = {
    scale: st.sampled_from([F32_TINY, 2.0**-100, 1e-30, 0.5, 1.0, 3.0, 2.0**15, 2.0**100, 1e38, F32_MAX]),
    ceiling: st.sampled_from([1.0, 2.0**24, 2.0**127, F32_MAX, math.inf]),
    growth: st.sampled_from([1 + 2**-23, 1.5, 2.0, 1000.0, 2.0**100]),
    backoff: st.sampled_from([F32_TINY, 2.0**-60, 0.1, 0.5, 1 - 2**-24]),
    flag: st.booleans(),
}


def valid_values(kind):
    if kind in VALID:
        return VALID[kind]
    samples = [v for v in [None, 0, 1, 2, 3, 64, -64, 1000, 2.0, 2**31 - 2, 2**31 - 1] if kind(v)]
    return st.sampled_from(samples)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(name=st.sampled_from(sorted(FACTORIES)), data=st.data())
def test_anything_accepted_trains_without_an_error(name, data):
    _, kinds, defaults, combined = FACTORIES[name]
    arguments = {arg: data.draw(valid_values(kind), label=arg) for arg, kind in kinds.items()}
    assume(combined({**defaults, **arguments}))
    if arguments.get("max_consecutive_skips") is not None:  # more than this run's steps: it must not fire
        arguments["max_consecutive_skips"] = max(arguments["max_consecutive_skips"], 10)
    tx = check_construction(name, arguments)
    params = {"w": jnp.ones(3), "b": jnp.zeros(1)}
    state = tx.init(params)
    update = jax.jit(tx.update)
    for poison in [None, jnp.inf, None, jnp.nan, None, None]:
        g = {"w": jnp.array([1e-3, -2.0, 0.5]) * state.scale, "b": jnp.ones(1)}
        if poison is not None:
            g["w"] = g["w"].at[0].set(poison)
        overflow = not all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(g))  # a huge scale overflows
        updates, state = update(g, state, params)
        assert bool(state.skipped) == overflow, (name, arguments)
        scale_ = float(state.scale)
        assert math.isfinite(scale_) and scale_ > 0, (name, arguments, scale_)
        assert all(bool(jnp.all(jnp.isfinite(u))) for u in jax.tree.leaves(updates))
        params = optax.apply_updates(params, updates)


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: ls.static(optax.sgd(1.0), 1e39), "scale must be at most float32's largest value"),
        (lambda: ls.static(optax.sgd(1.0), 1e-46), "scale must be at least float32's smallest normal"),
        (lambda: ls.static(optax.sgd(1.0), 1e-40), "scale must be at least float32's smallest normal"),
        (lambda: ls.presets.deepspeed(optax.sgd(1.0), loss_scale=1e39), "loss_scale must be at most"),
        (lambda: ls.dynamic(optax.sgd(1.0), initial_scale="1024"), "initial_scale must be a real number"),
        (lambda: ls.dynamic(optax.sgd(1.0), growth_factor="2"), "growth_factor must be a real number"),
        (lambda: ls.dynamic(optax.sgd(1.0), min_scale="1"), "min_scale must be a real number"),
        (lambda: ls.static(optax.sgd(1.0), "4"), "scale must be a real number"),
        (lambda: ls.dynamic(optax.sgd(1.0), max_grad_norm="1.0"), "max_grad_norm must be a real number"),
        (lambda: ls.dynamic(optax.sgd(1.0), growth_interval=2**31), r"growth_interval must be <= 2\*\*31 - 1"),
        (lambda: ls.dynamic(optax.sgd(1.0), max_consecutive_skips=2**31), "max_consecutive_skips must be <="),
        (lambda: ls.dynamic(optax.sgd(1.0), hysteresis=2**31), r"hysteresis must be <= 2\*\*31 - 1"),
        (lambda: ls.dynamic(optax.sgd(1.0), backoff_factor=1 - 1e-9), r"backoff_factor .* \(in float32 it is 1\.0\)"),
        (lambda: ls.dynamic(optax.sgd(1.0), growth_factor=1 + 1e-9), r"growth_factor .* \(in float32 it is 1\.0\)"),
        (lambda: ls.dynamic(optax.sgd(1.0), initial_scale=True), "initial_scale must be a real number, got True"),
        (lambda: ls.predictive(optax.sgd(1.0), compute_dtype=None), "compute_dtype must be a dtype .* got None"),
    ],
)
def test_the_reported_bad_settings_are_rejected(call, match):
    # Each of these was accepted once and failed (or did nothing) later.
    with pytest.raises((TypeError, ValueError), match=match):
        call()


def test_a_traced_setting_is_refused():
    def build(x):
        ls.static(optax.sgd(1.0), x)
        return x

    with pytest.raises(TypeError, match="scale must be a concrete number"):
        jax.jit(build)(2.0)


# Another library's name for a setting, passed to any factory, names this
# library's argument and the preset that takes the peer's name.
EVERY_FACTORY = {
    "dynamic": lambda **kw: ls.dynamic(optax.sgd(0.1), **kw),
    "predictive": lambda **kw: ls.predictive(optax.sgd(0.1), **kw),
    "static": lambda **kw: ls.static(optax.sgd(0.1), 2.0, **kw),
    "no_op": lambda **kw: ls.no_op(optax.sgd(0.1), **kw),
    "for_dtype": lambda **kw: ls.for_dtype(optax.sgd(0.1), "bfloat16", **kw),
    "Policy.loss_scaling": lambda **kw: ls.Policy.from_string("compute=f16").loss_scaling(optax.sgd(0.1), **kw),
}


@pytest.mark.parametrize("factory", sorted(EVERY_FACTORY))
def test_torchs_init_scale_names_initial_scale_and_the_torch_preset(factory):
    with pytest.raises(TypeError) as error:
        EVERY_FACTORY[factory](init_scale=2.0**16)
    message = str(error.value)
    assert message.startswith(f"{factory}() got an unexpected keyword argument 'init_scale': "), message
    assert "torch" in message and "initial_scale=" in message, message
    assert "ls.presets.torch" in message and "ls.presets.apex" in message, message


@pytest.mark.parametrize(
    ("name", "argument", "presets"),
    [
        ("init_scale", "initial_scale=", ["torch", "apex"]),
        ("dynamic_growth_steps", "growth_interval=", ["keras", "tf_keras"]),
        ("initial_scale_power", "initial_scale=2.0**initial_scale_power", ["deepspeed"]),
        ("loss_scale_window", "growth_interval=", ["deepspeed", "megatron"]),
        ("min_loss_scale", "min_scale=", ["deepspeed", "megatron", "apex", "jmp", "cerebras"]),
        ("initial_loss_scale", "initial_scale=", ["megatron", "cerebras"]),
        ("scale_window", "growth_interval=", ["apex"]),
        ("max_loss_scale", "max_scale=", ["apex", "cerebras"]),
        ("minimum_scale", "min_scale=", ["flax"]),
        ("loss_scale", "initial_scale=", ["jmp", "deepspeed", "megatron", "apex"]),
        ("period", "growth_interval=", ["jmp"]),
        ("factor", "growth_factor=factor, backoff_factor=1/factor", ["jmp"]),
        ("steps_per_increase", "growth_interval=", ["cerebras"]),
        ("max_gradient_norm", "max_grad_norm=", ["cerebras"]),
        ("enabled", "ls.no_op(inner)", ["torch"]),
        ("overflow_tolerance", "no counterpart", ["cerebras"]),
    ],
)
def test_a_peers_name_names_this_librarys_argument_and_the_presets(name, argument, presets):
    with pytest.raises(TypeError) as error:
        ls.dynamic(optax.sgd(0.1), **{name: 1})
    message = str(error.value)
    assert message.startswith(f"dynamic() got an unexpected keyword argument {name!r}: "), message
    assert argument in message, message
    for preset in presets:
        assert f"ls.presets.{preset}" in message, (preset, message)


def test_a_fixed_loss_scale_points_to_static_and_deepspeeds_consecutive_hysteresis_to_dynamic():
    with pytest.raises(TypeError, match=r"for DeepSpeed, Megatron-LM and Apex, .*ls\.static\(inner, scale=\.\.\.\)"):
        ls.dynamic(optax.sgd(0.1), loss_scale=128.0)
    # A setting ls.dynamic takes under the peer's own name, passed to a rule without it.
    with pytest.raises(
        TypeError, match="'consecutive_hysteresis': consecutive_hysteresis is an argument of ls.dynamic"
    ):
        ls.predictive(optax.sgd(0.1), consecutive_hysteresis=True)
    with pytest.raises(TypeError, match=r"'loss_scale_window': .*ls\.dynamic takes it as growth_interval="):
        ls.predictive(optax.sgd(0.1), loss_scale_window=1000)


def test_the_peer_table_covers_every_preset_argument_that_dynamic_lacks():
    # Each name a preset takes and ls.dynamic does not is in the table, with
    # that preset; each preset the table names takes the name.
    import inspect

    from loss_scale._options import PEER_NAMES

    own = set(inspect.signature(ls.dynamic).parameters)
    for preset in ls.presets.__all__:
        for name in inspect.signature(getattr(ls.presets, preset)).parameters:
            if name not in own:
                assert any(preset in presets for presets, _, _ in PEER_NAMES.get(name, ())), (preset, name)
    for name, meanings in PEER_NAMES.items():
        for presets, argument, _ in meanings:
            assert argument is None or argument in own, (name, argument)
            for preset in presets:
                assert name in inspect.signature(getattr(ls.presets, preset)).parameters, (preset, name)


@pytest.mark.parametrize(
    ("call", "suggestion"),
    [
        (lambda: ls.dynamic(optax.sgd(0.1), growth_intervall=10), "did you mean growth_interval?"),
        (lambda: ls.predictive(optax.sgd(0.1), min_headrom=2), "did you mean min_headroom?"),
        (lambda: ls.static(optax.sgd(0.1), 2.0, track_grad_nrom=True), "did you mean track_grad_norm?"),
        (lambda: ls.no_op(optax.sgd(0.1), skip_non_finite=True), "did you mean skip_nonfinite?"),
        (lambda: ls.for_dtype(optax.sgd(0.1), "f16", max_grad_nrom=1.0), "did you mean max_grad_norm?"),
        (lambda: ls.presets.torch(optax.sgd(0.1), growth_intervall=10), "did you mean growth_interval?"),
        (lambda: ls.presets.cerebras(optax.sgd(0.1), max_grad_norm=1.0), "did you mean max_gradient_norm?"),
    ],
)
def test_a_misspelt_keyword_names_the_closest_argument(call, suggestion):
    with pytest.raises(TypeError, match="unexpected keyword argument") as error:
        call()
    assert str(error.value).endswith(suggestion), str(error.value)


def test_an_unknown_keyword_with_nothing_close_keeps_pythons_message():
    with pytest.raises(TypeError) as error:
        ls.dynamic(optax.sgd(0.1), frobnicate=True)
    assert str(error.value) == "dynamic() got an unexpected keyword argument 'frobnicate'"
