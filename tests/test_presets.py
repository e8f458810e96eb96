"""The compatibility presets against their peers.

Three kinds of evidence, table-driven over the presets:

* random overflow sequences (hypothesis) against the plain-Python
  transcriptions of the peers' rules in tests/oracles.py;
* trajectories recorded from the peers' released sources
  (tests/data/peer_trajectories.json: Keras 3, DeepSpeed, megatron-core,
  Cerebras; tests/data/torch_gradscaler.json: torch), which also check the
  transcriptions;
* the real peers, where installed: torch.amp.GradScaler, jmp.DynamicLossScale,
  flax's DynamicScale.

Every preset runs as the full transformation (skips included), jitted once per
configuration with ``lax.scan``.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import json
import math
import pathlib

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import loss_scale as ls
from loss_scale._validate import FLOAT32_TINY
from tests import oracles

DATA = pathlib.Path(__file__).parent / "data"
FIXTURE = json.loads((DATA / "peer_trajectories.json").read_text())
FLOAT32_MAX = float(np.finfo(np.float32).max)
LENGTH = 80  # the fixture's trajectory length, so one compile serves both
BAD = np.float32([np.inf, -np.inf, np.nan])


def _freeze(config: dict) -> tuple:
    return tuple(sorted(config.items()))


@functools.cache
def _compiled(preset: str, frozen: tuple):
    """The preset's full transformation over ``LENGTH`` steps, jitted once:
    (scale after each step, state.skipped, parameters unchanged,
    the hysteresis allowance left after each step). ``initial`` replaces the initial scale
    unless it is nan (or the preset's scale is fixed, a constant of its state's layout)."""
    tx = getattr(ls.presets, preset)(optax.sgd(1.0), **dict(frozen))

    @jax.jit
    def run(injected, initial):
        params = jnp.zeros(2)
        state = tx.init(params)
        if state.packed.layout.fixed_scale is None:
            state = state._replace(scale=jnp.where(jnp.isnan(initial), state.scale, initial))

        def step(carry, value):
            params, state = carry
            grads = jnp.array([1.0, 1.0]).at[0].set(value) * state.scale
            updates, state = tx.update(grads, state, params)
            new_params = optax.apply_updates(params, updates)
            allowance = getattr(state.counters, "overflows_left", jnp.int32(0))
            out = (state.scale, state.skipped, jnp.all(new_params == params), allowance)
            return (new_params, state), out

        return jax.lax.scan(step, (params, state), injected)[1]

    return run


def run_preset_full(preset: str, config: dict, overflows, initial: float = math.nan):
    """(scales, skip flags, hysteresis allowances) of ``preset`` over ``overflows``
    (padded to LENGTH)."""
    n = len(overflows)
    assert n <= LENGTH
    injected = np.ones(LENGTH, np.float32)
    bad = BAD[np.arange(LENGTH) % 3]
    injected[:n] = np.where(np.asarray(overflows, bool), bad[:n], 1.0)
    run = _compiled(preset, _freeze(config))
    scales, skipped, unchanged, budget = (np.asarray(x)[:n] for x in run(injected, np.float32(initial)))
    np.testing.assert_array_equal(skipped, unchanged)  # a skipped step moves nothing
    return scales, skipped, budget


def run_preset(preset: str, config: dict, overflows, initial: float = math.nan) -> tuple[np.ndarray, np.ndarray]:
    """Scales and skip flags of ``preset`` over ``overflows``."""
    return run_preset_full(preset, config, overflows, initial)[:2]


def in_range_prefix(trajectory) -> int:
    """How many leading steps keep the peer's scale in float32's normal range."""
    for i, (scale, _) in enumerate(trajectory):
        if not FLOAT32_TINY <= scale <= FLOAT32_MAX:
            return i
    return len(trajectory)


def assert_peer_equals_transcription(peer, transcribed):
    """Equal while the peer's scale stays in float32's normal range; at the
    step that leaves it both leave it. Beyond, the real peers' arithmetic is
    no longer the rule's: XLA flushes subnormal scales to 0, torch's inverse
    scale overflows and makes every step skip."""
    assert len(peer) == len(transcribed)
    n = in_range_prefix(peer)
    assert peer[:n] == transcribed[:n]
    assert in_range_prefix(transcribed) == n


def assert_same_trajectory(scales, skipped, expected, floor=FLOAT32_TINY, context=""):
    """Exact float32 equality of the scales and equality of the skip flags,
    up to the step where the peer's own scale leaves float32's normal range
    (a peer defect the presets do not reproduce); from there on the preset's
    scale must stay finite and at least ``floor``."""
    for i, (scale, peer_skipped) in enumerate(expected):
        if not FLOAT32_TINY <= scale <= FLOAT32_MAX:
            rest = scales[i:]
            assert np.all(np.isfinite(rest) & (rest >= np.float32(floor))), context
            return i
        assert scales[i] == np.float32(scale), f"step {i}: {scales[i]} != {scale} {context}"
        assert bool(skipped[i]) == peer_skipped, f"step {i} skip {context}"
    return len(expected)


# --- the table ----------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Peer:
    transcription: object
    configs: tuple  # preset keyword arguments, also the transcription's
    extra: tuple = ()  # transcription-only keyword arguments


def _recorded_configs(peer: str) -> tuple:
    """The configurations recorded from the peer's own source (shared with
    the fixture test, so each compiles once)."""
    configs = []
    for t in FIXTURE[peer]["trajectories"]:
        if t["config"] not in configs:
            configs.append(t["config"])
    return tuple(configs)


PEERS = {
    "torch": Peer(
        oracles.torch_gradscaler,
        (
            {"init_scale": 2.0**10, "growth_interval": 1},
            {"init_scale": 1.0, "growth_factor": 1.5, "backoff_factor": 0.25, "growth_interval": 3},
            {"init_scale": 2.0**-100, "growth_factor": 4.0, "backoff_factor": 0.125, "growth_interval": 2},
        ),
    ),
    "keras": Peer(oracles.keras3, _recorded_configs("keras")),
    "tf_keras": Peer(
        oracles.tf_keras,
        ({"initial_scale": 4.0, "dynamic_growth_steps": 2}, {"dynamic_growth_steps": 3}, {}),
    ),
    "deepspeed": Peer(oracles.deepspeed, _recorded_configs("deepspeed"), (("raise_error_at_min_scale", False),)),
    "megatron": Peer(oracles.megatron, _recorded_configs("megatron")),
    "apex": Peer(
        oracles.apex,
        (
            {"init_scale": 2.0**10, "scale_window": 2, "max_loss_scale": 2.0**12},
            {"init_scale": 2.0**30, "scale_window": 1, "min_loss_scale": 2.0**20},
            {"init_scale": 1.0, "scale_window": 3},
        ),
    ),
    "flax": Peer(
        oracles.flax_dynamic_scale,
        (
            {"scale": 2.0**10, "growth_interval": 1},
            {"scale": 3.0, "growth_factor": 1.5, "backoff_factor": 0.25, "growth_interval": 0},
            {"scale": 2.0**-120, "growth_interval": 2},
            {"scale": 8.0, "growth_interval": 3, "minimum_scale": 2.0},
        ),
    ),
    "jmp": Peer(
        oracles.jmp_dynamic_loss_scale,
        (
            {"loss_scale": 2.0**10, "period": 1},
            {"loss_scale": 16.0, "period": 3, "factor": 4, "min_loss_scale": 0.25},
            {"loss_scale": 1.0, "period": 2},
        ),
    ),
    "cerebras": Peer(oracles.cerebras, _recorded_configs("cerebras")),
}

OVERFLOWS = st.one_of(
    st.lists(st.booleans(), min_size=LENGTH, max_size=LENGTH),
    st.lists(st.sampled_from([False] * 9 + [True]), min_size=LENGTH, max_size=LENGTH),
    st.lists(st.sampled_from([True] * 4 + [False]), min_size=LENGTH, max_size=LENGTH),
)


def test_the_table_covers_every_preset():
    assert sorted(PEERS) == sorted(ls.presets.__all__)
    assert "presets" in ls.__all__


@pytest.mark.parametrize("preset", sorted(PEERS))
@hypothesis.settings(max_examples=30, deadline=None)
@hypothesis.given(data=st.data(), overflows=OVERFLOWS)
def test_preset_equals_transcription(preset, data, overflows):
    peer = PEERS[preset]
    config = data.draw(st.sampled_from(peer.configs), label="config")
    expected = peer.transcription(overflows, **config, **dict(peer.extra))
    scales, skipped = run_preset(preset, config, overflows)
    assert_same_trajectory(scales, skipped, expected, context=f"{preset} {config}")


# --- against the peers' released sources (recorded) -------------------------

_RECORDED = ("cerebras", "deepspeed", "keras", "megatron")


def _flags(text: str) -> list[bool]:
    return [c == "1" for c in text]


@pytest.mark.parametrize("preset", _RECORDED)
def test_preset_and_transcription_equal_the_recorded_peer(preset):
    recorded, transcription = FIXTURE[preset], PEERS[preset].transcription
    compared = 0
    for t in recorded["trajectories"]:
        overflows, skipped = _flags(t["overflows"]), _flags(t["skipped"])
        peer = list(zip(t["scales"], skipped, strict=True))
        if preset == "deepspeed" and t["raised_at"] is not None:
            with pytest.raises(oracles.DeepSpeedMinScaleError) as raised:
                transcription(overflows + [True], **t["config"])
            assert raised.value.at == t["raised_at"] and raised.value.trajectory == peer
        else:
            assert_peer_equals_transcription(peer, transcription(overflows, **t["config"]))
        scales, preset_skipped = run_preset(preset, t["config"], overflows)
        compared += assert_same_trajectory(scales, preset_skipped, peer, context=str(t["config"]))
    total = sum(len(t["scales"]) for t in recorded["trajectories"])
    # One recorded configuration of Keras and of Megatron reaches inf (cut there).
    assert compared > 0.8 * total > 1500


def test_deepspeed_host_side_check_finds_exactly_where_deepspeed_raises():
    """DeepSpeed raises when an overflow calls for a backoff at min_loss_scale;
    the preset documents the host-side condition that finds those steps."""
    raised = 0
    for t in FIXTURE["deepspeed"]["trajectories"]:
        overflows = _flags(t["overflows"])
        if t["raised_at"] is not None:
            overflows = overflows + [True]  # the step that raised
        scales, skipped, budget = run_preset_full("deepspeed", t["config"], overflows)
        prev = np.concatenate([[2.0 ** t["config"]["initial_scale_power"]], scales[:-1]])
        would_raise = (prev == t["config"]["min_loss_scale"]) & skipped & (budget == 0)
        expected = np.zeros(len(overflows), bool)
        if t["raised_at"] is not None:
            expected[t["raised_at"]] = True
            raised += 1
        np.testing.assert_array_equal(would_raise, expected, err_msg=str(t["config"]))
    assert raised >= 10


def test_preset_equals_recorded_torch_gradscaler():
    """tests/data/torch_gradscaler.json (recorded from torch 2.13's GradScaler)
    for its float32-exact configurations."""
    fixture = json.loads((DATA / "torch_gradscaler.json").read_text())
    compared = 0
    for t in fixture["trajectories"]:
        exact = all(float(np.float32(t[k])) == t[k] for k in ("growth_factor", "backoff_factor"))
        if not exact or t["init_scale"] > FLOAT32_MAX or len(t["overflows"]) > LENGTH:
            continue
        # One compile per rule; the initial scale is passed at run time.
        config = {"init_scale": 1.0, **{k: t[k] for k in ("growth_factor", "backoff_factor", "growth_interval")}}
        scales, skipped = run_preset("torch", config, t["overflows"], initial=t["init_scale"])
        compared += assert_same_trajectory(scales, skipped, list(zip(t["scales"], t["skipped"], strict=True)))
    assert compared > 1000


# --- against the real peers -----------------------------------------------------


def _sequences(seed, count=4):
    rng = np.random.default_rng(seed)
    return [rng.random(LENGTH) < rate for rate in np.resize([0.05, 0.2, 0.5, 0.9], count)]


def _real_torch(torch, config, overflows):
    """(scale, skipped) after each step of a real GradScaler driving SGD."""
    param = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([param], lr=1.0)
    scaler = torch.amp.GradScaler("cpu", **config)
    peer = []
    for i, overflow in enumerate(overflows):
        opt.zero_grad()
        scaler.scale(param.sum()).backward()
        if overflow:
            with torch.no_grad():
                param.grad[0] = float(BAD[i % 3])
        before = param.detach().clone()
        scaler.step(opt)
        scaler.update()
        peer.append((scaler.get_scale(), bool(torch.equal(before, param.detach()))))
    return peer


@pytest.mark.parametrize("config", PEERS["torch"].configs)
def test_torch_preset_equals_real_gradscaler(config):
    torch = pytest.importorskip("torch")
    for overflows in _sequences(0):
        peer = _real_torch(torch, config, overflows)
        assert_peer_equals_transcription(peer, oracles.torch_gradscaler(overflows, **config))
        scales, skipped = run_preset("torch", config, overflows)
        assert_same_trajectory(scales, skipped, peer, context=str(config))


@pytest.mark.parametrize("config", PEERS["jmp"].configs)
def test_jmp_preset_equals_real_dynamic_loss_scale(config):
    jmp = pytest.importorskip("jmp")
    for overflows in _sequences(1, count=4):
        state = jmp.DynamicLossScale(
            jnp.float32(config["loss_scale"]),
            period=config["period"],
            factor=config.get("factor", 2),
            min_loss_scale=jnp.float32(config.get("min_loss_scale", 1.0)),
        )
        peer = []
        for overflow in overflows:  # eagerly: under jit jmp drops its minimum
            state = state.adjust(jnp.asarray(not overflow))
            peer.append((float(state.loss_scale), bool(overflow)))
        assert_peer_equals_transcription(peer, oracles.jmp_dynamic_loss_scale(overflows, **config))
        scales, skipped = run_preset("jmp", config, overflows)
        assert_same_trajectory(scales, skipped, peer, context=str(config))


def test_jmp_loses_its_minimum_under_jit_and_the_preset_does_not():
    jmp = pytest.importorskip("jmp")
    if jmp.__version__ != "0.0.4":
        pytest.skip("the defect is jmp 0.0.4's")
    state = jmp.DynamicLossScale(jnp.float32(16.0), period=5, min_loss_scale=jnp.float32(4.0))
    adjust = jax.jit(lambda s, finite: s.adjust(finite))
    for _ in range(4):
        state = adjust(state, jnp.asarray(False))
    assert float(state.loss_scale) == 1.0  # jmp's defect: the minimum became 1
    scales, _ = run_preset("jmp", {"loss_scale": 16.0, "period": 5, "min_loss_scale": 4.0}, [True] * 4)
    np.testing.assert_array_equal(scales, [8.0, 4.0, 4.0, 4.0])


@pytest.mark.parametrize("config", PEERS["flax"].configs)
def test_flax_preset_equals_real_dynamic_scale(config):
    """flax's DynamicScale.value_and_grad on a tiny loss with an inf injected
    into its input; flax's finite flag is the skip decision."""
    DynamicScale = pytest.importorskip("flax.training.dynamic_scale").DynamicScale

    def loss(params, values):
        return jnp.sum(params * values)

    step = jax.jit(lambda ds, params, values: ds.value_and_grad(loss)(params, values))
    for overflows in _sequences(2, count=4):
        ds, params, peer = DynamicScale(**config), jnp.zeros(2), []
        for i, overflow in enumerate(overflows):
            values = jnp.array([float(BAD[i % 3]) if overflow else 1.0, 1.0])
            ds, finite, _, _ = step(ds, params, values)
            peer.append((float(ds.scale), not bool(finite)))
        assert_peer_equals_transcription(peer, oracles.flax_dynamic_scale(overflows, **config))
        scales, skipped = run_preset("flax", config, overflows)
        assert_same_trajectory(scales, skipped, peer, context=str(config))


# --- hand-checked edge semantics ----------------------------------------------


def scales_of(preset, config, pattern):
    """Scales after each step for a pattern like "..x..": x overflows."""
    scales, skipped = run_preset(preset, config, [c == "x" for c in pattern])
    np.testing.assert_array_equal(skipped, [c == "x" for c in pattern])
    return [float(s) for s in scales]


# The hand-checked cases reuse the tables' configurations (one compile each).


def test_flax_grows_on_the_growth_interval_plus_first_clean_step():
    config = PEERS["flax"].configs[3]
    assert config["growth_interval"] == 3
    assert scales_of("flax", config, "....x....") == [8, 8, 8, 16, 8, 8, 8, 8, 16]


def test_deepspeed_first_growth_needs_window_plus_one_clean_steps_at_start_and_after_overflow():
    config = PEERS["deepspeed"].configs[2]
    assert (config["loss_scale_window"], config["hysteresis"], config["consecutive_hysteresis"]) == (3, 2, False)
    # start: growth on clean step 4 (not 3), then every 3
    assert scales_of("deepspeed", config, ".......") == [1024, 1024, 1024, 2048, 2048, 2048, 4096]
    # an overflow absorbed by hysteresis (no backoff) also restarts the count at window + 1
    assert scales_of("deepspeed", config, "....x....") == [1024, 1024, 1024, 2048, 2048, 2048, 2048, 2048, 4096]


def test_megatron_hysteresis_is_refilled_by_growth_only():
    config = PEERS["megatron"].configs[0]
    assert (config["loss_scale_window"], config["hysteresis"]) == (3, 2)
    # clean steps between two overflows do not refill: the second backs off
    assert scales_of("megatron", config, "x..x") == [2.0**32, 2.0**32, 2.0**32, 2.0**31]
    # a growth in between refills: the next overflow is absorbed
    assert scales_of("megatron", config, "x...x") == [2.0**32, 2.0**32, 2.0**32, 2.0**33, 2.0**33]


def test_deepspeed_consecutive_hysteresis_refills_on_every_clean_step():
    consecutive, plain = PEERS["deepspeed"].configs[3], PEERS["deepspeed"].configs[2]
    assert consecutive["consecutive_hysteresis"] and not plain["consecutive_hysteresis"]
    pattern = "x.x.x.xx"  # no growth: never window + 1 clean steps
    assert scales_of("deepspeed", consecutive, pattern) == [1024] * 7 + [512]
    assert scales_of("deepspeed", plain, pattern) == [1024, 1024, 512, 512, 256, 256, 128, 64]


def test_apex_caps_at_max_loss_scale_and_starts_below_it():
    config = PEERS["apex"].configs[1]  # init_scale 2**30, scale_window 1, min_loss_scale 2**20
    assert scales_of("apex", config, "..x..") == [2.0**24, 2.0**24, 2.0**23, 2.0**24, 2.0**24]
    scales, _ = run_preset("apex", config, [True] * 3, initial=2.0**21)
    assert list(scales) == [2.0**20] * 3


def test_tf_keras_never_goes_below_one():
    assert scales_of("tf_keras", PEERS["tf_keras"].configs[0], "xxxx") == [2.0, 1.0, 1.0, 1.0]
    with pytest.raises(ValueError, match="initial_scale must be >= 1"):
        ls.presets.tf_keras(optax.sgd(0.1), initial_scale=0.5)


def test_cerebras_overflow_tolerance():
    config = PEERS["cerebras"].configs[3]
    assert config == {"initial_loss_scale": 8.0, "steps_per_increase": 4, "overflow_tolerance": 0.5}
    # 1 overflow in 3 steps is tolerated (skipped, scale kept), and it counts
    # towards the 5 steps after which the scale grows
    assert scales_of("cerebras", config, "..x..x") == [8, 8, 8, 8, 16, 8]
    # tolerance 1 never backs off: growth every steps_per_increase + 1 steps
    never = PEERS["cerebras"].configs[6]
    assert never["overflow_tolerance"] == 1.0 and never["steps_per_increase"] == 3
    assert scales_of("cerebras", never, "xxxxxxxx") == [2.0**20] * 3 + [2.0**21] * 4 + [2.0**22]
    # tolerance 0: growth after steps_per_increase + 1 clean steps, like flax
    zero = PEERS["cerebras"].configs[1]
    assert scales_of("cerebras", zero, "....x....") == [32, 32, 32, 64, 32, 32, 32, 32, 64]
    # the clamp to [min_loss_scale, max_loss_scale] = [2**8, 2**12]
    bounded = PEERS["cerebras"].configs[2]
    assert scales_of("cerebras", bounded, "xxxx") == [512, 256, 256, 256]
    assert scales_of("cerebras", bounded, "." * 9) == [1024, 1024, 2048, 2048, 2048, 4096, 4096, 4096, 4096]


def test_cerebras_counters_in_the_state():
    tx = ls.presets.cerebras(optax.sgd(0.1), initial_loss_scale=8.0, steps_per_increase=5, overflow_tolerance=0.5)
    state, update = tx.init(jnp.zeros(1)), jax.jit(tx.update)
    for g in [1.0, 1.0, jnp.inf]:
        _, state = update(jnp.array([g]) * state.scale, state)
    assert (int(state.good_steps), int(state.counters.overflows), float(state.scale)) == (2, 1, 8.0)


_INITIAL = {
    "torch": "init_scale",
    "keras": "initial_scale",
    "megatron": "initial_loss_scale",
    "apex": "init_scale",
    "jmp": "loss_scale",
}


def _with_initial(preset, config, initial):
    """``config`` with the initial scale replaced (for the transcriptions; the
    compiled preset takes it at run time)."""
    if preset == "deepspeed":
        return {**config, "initial_scale_power": int(math.log2(initial))}
    return {**config, _INITIAL[preset]: initial}


@pytest.mark.parametrize(
    ("preset", "config"),
    [
        ("keras", PEERS["keras"].configs[0]),  # dynamic_growth_steps=1
        ("megatron", PEERS["megatron"].configs[2]),  # loss_scale_window=1
        ("deepspeed", PEERS["deepspeed"].configs[0]),  # loss_scale_window=1
        ("torch", PEERS["torch"].configs[0]),  # growth_interval=1
        ("jmp", PEERS["jmp"].configs[0]),  # period=1
    ],
)
def test_growth_never_reaches_inf(preset, config):
    scales, skipped = run_preset(preset, config, [False] * 4, initial=2.0**126)
    assert scales[-1] == 2.0**127 and np.all(np.isfinite(scales))
    overflows = [False] * 4
    peer = PEERS[preset].transcription(
        overflows, **_with_initial(preset, config, 2.0**126), **dict(PEERS[preset].extra)
    )
    assert_same_trajectory(scales, skipped, peer)
    if preset in ("keras", "megatron"):
        assert math.isinf(peer[-1][0])  # the peer's defect: an inf scale
    if preset == "deepspeed":
        assert peer[-1][0] == 2.0**129  # a Python float beyond float32


def test_flax_grows_to_float32_max_like_flax():
    config = PEERS["flax"].configs[0]  # growth_interval 1: growth on every second clean step
    scales, _ = run_preset("flax", config, [False] * 3, initial=2.0**127)
    assert list(scales) == [2.0**127, FLOAT32_MAX, FLOAT32_MAX]
    peer = oracles.flax_dynamic_scale([False] * 3, **{**config, "scale": 2.0**127})
    assert [s for s, _ in peer] == list(scales)


@pytest.mark.parametrize(
    ("preset", "config", "initial"),
    [
        ("torch", PEERS["torch"].configs[2], math.nan),  # 2**-100, backoff 1/8
        ("keras", PEERS["keras"].configs[0], 2.0**-120),
        ("apex", PEERS["apex"].configs[2], 2.0**-120),  # min_loss_scale=None
        ("flax", PEERS["flax"].configs[2], math.nan),  # 2**-120, minimum_scale=None
    ],
)
def test_scale_without_a_peer_minimum_stops_at_float32_tiny(preset, config, initial):
    assert "min_loss_scale" not in config and "minimum_scale" not in config
    scales, skipped = run_preset(preset, config, [True] * 12, initial=initial)
    assert scales[-1] == FLOAT32_TINY and min(scales) == FLOAT32_TINY and np.all(skipped)


def test_torch_transcription_rounds_inexact_factors_as_real_gradscaler():
    """torch multiplies its float32 scale by float64 factors and rounds once."""
    torch = pytest.importorskip("torch")
    config = {"init_scale": 1000.0, "growth_factor": 1.1, "backoff_factor": 0.9, "growth_interval": 1}
    overflows = _sequences(3, count=1)[0]
    assert_peer_equals_transcription(
        _real_torch(torch, config, overflows), oracles.torch_gradscaler(overflows, **config)
    )


def test_jmp_transcription_divides_by_the_factor_as_real_jmp():
    jmp = pytest.importorskip("jmp")
    overflows = _sequences(3, count=1)[0]
    state, peer = jmp.DynamicLossScale(jnp.float32(1000.0), period=1, factor=3), []
    for overflow in overflows:
        state = state.adjust(jnp.asarray(not overflow))
        peer.append((float(state.loss_scale), bool(overflow)))
    assert_peer_equals_transcription(peer, oracles.jmp_dynamic_loss_scale(overflows, 1000.0, period=1, factor=3))


def test_inexact_factors_differ_by_at_most_one_rounding_per_step():
    """torch (float64 factors) and jmp (division by factor) round once per
    change; the presets multiply by the float32 factor."""
    overflows = _sequences(3, count=1)[0]
    config = {"init_scale": 1000.0, "growth_factor": 1.1, "backoff_factor": 0.9, "growth_interval": 1}
    peer = np.float64([s for s, _ in oracles.torch_gradscaler(overflows, **config)])
    scales, _ = run_preset("torch", config, overflows)
    drift = np.abs(np.float64(scales) / peer - 1)
    assert np.all(drift < 2.0**-23 * np.arange(1, LENGTH + 1) * 1.001)
    jmp_config = {"loss_scale": 1000.0, "period": 1, "factor": 3}
    peer = np.float64([s for s, _ in oracles.jmp_dynamic_loss_scale(overflows, **jmp_config)])
    scales, _ = run_preset("jmp", jmp_config, overflows)
    assert np.all(np.abs(np.float64(scales) / peer - 1) < 2.0**-23 * np.arange(1, LENGTH + 1) * 1.001)


# --- defaults are the peers' --------------------------------------------------


def preset_defaults(preset):
    return {
        name: p.default
        for name, p in inspect.signature(getattr(ls.presets, preset)).parameters.items()
        if p.default is not inspect.Parameter.empty and p.kind is p.POSITIONAL_OR_KEYWORD
    }


def test_defaults_equal_installed_torch():
    torch = pytest.importorskip("torch")
    peer = inspect.signature(torch.amp.GradScaler).parameters
    ours = preset_defaults("torch")
    assert ours == {name: peer[name].default for name in ours}


def test_defaults_equal_installed_flax():
    DynamicScale = pytest.importorskip("flax.training.dynamic_scale").DynamicScale

    peer = {f.name: f.default for f in dataclasses.fields(DynamicScale)}
    ours = preset_defaults("flax")
    assert ours.pop("minimum_scale") is None  # None stands for flax's default:
    assert peer.pop("minimum_scale") == np.float32(FLOAT32_TINY)
    assert ls.presets.flax(optax.sgd(0.1)).init(jnp.zeros(1)).scale == np.float32(65536.0)
    assert ours == {name: peer[name] for name in ours}


def test_defaults_equal_installed_jmp():
    jmp = pytest.importorskip("jmp")
    fields = {f.name: f for f in dataclasses.fields(jmp.DynamicLossScale)}
    ours = preset_defaults("jmp")
    assert ours.pop("loss_scale") == 2.0**15  # jmp has no default (its docstring uses 2**15)
    assert fields["loss_scale"].default is dataclasses.MISSING
    assert ours["min_loss_scale"] == float(fields["min_loss_scale"].default_factory())
    assert (ours["period"], ours["factor"]) == (fields["period"].default, fields["factor"].default)


@pytest.mark.parametrize(
    ("preset", "translate"),
    [
        ("keras", {}),
        ("deepspeed", {}),
        ("megatron", {}),
        ("cerebras", {"initial_loss_scale": "init_scale"}),
        ("tf_keras", {}),
    ],
)
def test_defaults_equal_the_recorded_peer_sources(preset, translate):
    peer = FIXTURE[preset]["defaults"]
    for name, default in preset_defaults(preset).items():
        assert peer[translate.get(name, name)] == default, name
    keyword_only = {
        name: p.default
        for name, p in inspect.signature(getattr(ls.presets, preset)).parameters.items()
        if p.kind is p.KEYWORD_ONLY and name in peer
    }
    for name, default in keyword_only.items():  # deepspeed's and megatron's loss_scale
        assert peer[name] == default, name
    if preset == "tf_keras":
        assert (peer["_DEFAULT_INITIAL_SCALE"], peer["_DEFAULT_GROWTH_STEPS"]) == (2**15, 2000)
        assert float(ls.presets.tf_keras(optax.sgd(0.1)).init(jnp.zeros(1)).scale) == 2**15


def test_apex_defaults_are_its_constructor_defaults():
    peer = {n: p.default for n, p in inspect.signature(oracles.apex).parameters.items() if n != "overflows"}
    assert (
        preset_defaults("apex")
        == peer
        == {
            "init_scale": 2.0**16,
            "scale_window": 2000,
            "min_loss_scale": None,
            "max_loss_scale": 2.0**24,
        }
    )


@pytest.mark.parametrize(
    ("preset", "expected"),
    [
        ("torch", 2.0**16),
        ("keras", 2.0**15),
        ("tf_keras", 2.0**15),
        ("deepspeed", 2.0**16),
        ("megatron", 2.0**32),
        ("apex", 2.0**16),
        ("flax", 2.0**16),
        ("jmp", 2.0**15),
        ("cerebras", 2.0**15),
    ],
)
def test_default_initial_scale_and_state(preset, expected):
    tx = getattr(ls.presets, preset)(optax.adam(1e-3))
    assert isinstance(tx, optax.GradientTransformationExtraArgs)
    state = tx.init({"w": jnp.zeros(3)})
    assert isinstance(state, ls.LossScaleState)
    assert float(ls.get_scale(state)) == expected


# --- static modes, options, validation -------------------------------------------


@pytest.mark.parametrize(
    ("preset", "kwargs", "scale"),
    [
        ("torch", {"enabled": False}, 1.0),
        ("tf_keras", {"dynamic": False, "initial_scale": 128.0}, 128.0),
        ("deepspeed", {"loss_scale": 256.0}, 256.0),
        ("megatron", {"loss_scale": 64.0}, 64.0),
        ("apex", {"loss_scale": 32.0}, 32.0),
    ],
)
def test_static_modes_keep_the_scale_and_still_skip(preset, kwargs, scale):
    scales = scales_of(preset, kwargs, ".x..x")
    assert scales == [scale] * 5


def test_cerebras_max_gradient_norm_clips_like_optax():
    params = jnp.zeros(3)
    grads = jnp.array([3.0, 4.0, 0.0])
    tx = ls.presets.cerebras(optax.sgd(1.0), initial_loss_scale=4.0, max_gradient_norm=1.0)
    updates, _ = jax.jit(tx.update)(grads * 4.0, tx.init(params), params)
    reference = optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(1.0))
    expected, _ = reference.update(grads, reference.init(params), params)
    np.testing.assert_allclose(updates, expected, rtol=1e-6)
    np.testing.assert_allclose(updates, [-0.6, -0.8, 0.0], rtol=1e-6)


def test_options_pass_through():
    params = {"a": jnp.zeros(2), "b": jnp.zeros(1)}
    tx = ls.presets.deepspeed(optax.sgd(1.0), locate_overflows=True, track_grad_norm=True, max_grad_norm=0.5)
    state, update = tx.init(params), jax.jit(tx.update)
    scale = state.scale
    _, state = update({"a": jnp.array([3.0, 4.0]) * scale, "b": jnp.zeros(1)}, state, params)
    assert float(state.grad_norm) == 5.0
    _, state = update({"a": jnp.ones(2), "b": jnp.array([jnp.nan])}, state, params)
    assert ls.overflow_paths(state, params) == ["['b']"]


@pytest.mark.parametrize(
    ("preset", "kwargs", "error", "match"),
    [
        ("torch", {"init_scale": 0.0}, ValueError, "init_scale must be finite and > 0"),
        ("torch", {"growth_factor": 1.0}, ValueError, "growth_factor must be > 1"),
        ("torch", {"growth_interval": 0}, ValueError, "growth_interval must be >= 1"),
        ("keras", {"dynamic_growth_steps": 0}, ValueError, "dynamic_growth_steps must be >= 1"),
        ("keras", {"dynamic_growth_steps": 2.5}, TypeError, "dynamic_growth_steps must be an int"),
        ("tf_keras", {"dynamic": False}, ValueError, '"initial_scale" must be specified'),
        ("tf_keras", {"dynamic": False, "initial_scale": 2.0, "dynamic_growth_steps": 3}, ValueError, "must be None"),
        ("deepspeed", {"initial_scale_power": 200}, ValueError, "initial_scale_power must be <= 127"),
        ("deepspeed", {"loss_scale_window": 0}, ValueError, "loss_scale_window must be >= 1"),
        ("deepspeed", {"hysteresis": 0}, ValueError, "hysteresis must be >= 1"),
        ("deepspeed", {"min_loss_scale": 2.0**20}, ValueError, "2\\*\\*initial_scale_power must lie in"),
        ("megatron", {"loss_scale_window": 2.5}, TypeError, "loss_scale_window must be an int"),
        ("megatron", {"min_loss_scale": 0.0}, ValueError, "min_loss_scale must be finite and > 0"),
        ("megatron", {"initial_loss_scale": 1e39}, ValueError, "initial_loss_scale must be at most float32"),
        ("apex", {"min_loss_scale": 2.0**25}, ValueError, "min_loss_scale .* must be <= max_loss_scale"),
        ("flax", {"growth_interval": -1}, ValueError, "growth_interval must be >= 0"),
        ("flax", {"minimum_scale": 2.0**20}, ValueError, "scale must lie in \\[minimum_scale"),
        ("jmp", {"factor": 1}, ValueError, "factor must be >= 2"),
        ("jmp", {"period": 0}, ValueError, "period must be >= 1"),
        ("cerebras", {"min_loss_scale": 2.0**-20}, ValueError, "min_loss_scale too small"),
        ("cerebras", {"overflow_tolerance": -0.1}, ValueError, "overflow_tolerance must be finite and >= 0"),
        ("cerebras", {"min_loss_scale": 2.0**16}, ValueError, r"min_loss_scale \(65536.0\) must be <= max_loss_scale"),
    ],
)
def test_bad_settings_name_the_peers_arguments(preset, kwargs, error, match):
    with pytest.raises(error, match=match):
        getattr(ls.presets, preset)(optax.sgd(0.1), **kwargs)


def test_peer_style_none_and_integral_float_settings():
    # Cerebras: None (or 0) means the default, as in its constructor
    tx = ls.presets.cerebras(optax.sgd(0.1), None, None, None, None)
    assert float(tx.init(jnp.zeros(1)).scale) == 2.0**15
    # Megatron types loss_scale_window as a float
    assert scales_of("megatron", {"initial_loss_scale": 4.0, "loss_scale_window": 2.0}, "..") == [4.0, 8.0]
    # Apex: min_loss_scale 0 means no minimum, as None
    assert scales_of("apex", {"init_scale": 2.0**-125, "min_loss_scale": 0}, "xx") == [FLOAT32_TINY] * 2


@pytest.mark.parametrize(
    "name", ["torch", "keras", "tf_keras", "deepspeed", "megatron", "apex", "flax", "jmp", "cerebras"]
)
def test_every_preset_takes_the_diagnostic_options(name):
    make = getattr(ls.presets, name)
    tx = make(optax.sgd(0.1), track_underflow=True, max_consecutive_skips=3, locate_overflows=True)
    params = {"w": jnp.zeros(2)}
    _, state = jax.jit(tx.update)({"w": jnp.array([0.0, jnp.inf])}, tx.init(params), params)
    assert bool(state.skipped) and state.zero_fraction is not None
    assert ls.overflow_paths(state, params) == ["['w']"]
