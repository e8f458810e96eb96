"""The public factories of the loss-scaling transformation: ``dynamic``,
``static``, ``no_op`` and ``predictive``.

Each validates its settings (here, at construction: a bad setting never
reaches a traced step), builds its rule (``loss_scale/_rules/``) and hands
both to the update (``loss_scale/_update.py``). The presets
(``loss_scale.presets``) and ``for_dtype`` build theirs the same way.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
import optax

from loss_scale import _validate as validate
from loss_scale._options import Options, Unpack, checks_keywords, settings_from, takes_options
from loss_scale._rules.dynamic import DynamicRule
from loss_scale._rules.predictive import PredictiveRule
from loss_scale._rules.segmented import SegmentedRule
from loss_scale._rules.static import fixed
from loss_scale._update import LossScaleTransformation, loss_scaled


@takes_options()
def dynamic(
    inner: optax.GradientTransformation,
    initial_scale: float = 2.0**15,
    growth_factor: float = 2.0,
    backoff_factor: float = 0.5,
    growth_interval: int = 2000,
    min_scale: float = 1.0,
    max_scale: float = 2.0**24,
    hysteresis: int = 1,
    consecutive_hysteresis: bool = False,
    **options: Unpack[Options],
) -> LossScaleTransformation:
    """Dynamic loss scaling around any optax optimizer.

    ``update`` expects the gradients of ``loss * scale`` (see
    ``loss_scale.value_and_grad``). It divides them by the scale in float32,
    checks them for inf/nan, and then either runs ``inner``'s update on the
    unscaled gradients or, if anything is non-finite, skips it: the updates
    are zeros and ``inner``'s state is returned unchanged (Adam's moments and
    step count do not move). Then the scale adjusts:

    * after ``growth_interval`` consecutive clean steps it is multiplied by
      ``growth_factor``, capped at ``max_scale`` (never inf);
    * on an overflow it is multiplied by ``backoff_factor``, floored at
      ``min_scale``; with ``hysteresis = h`` only from the h-th overflow since
      the last growth on (``consecutive_hysteresis=True``: since the last
      clean step).

    With ``min_scale`` tiny, ``max_scale=inf`` and ``hysteresis=1`` the scale
    and the skipped steps follow torch.amp.GradScaler exactly. The rule is
    ``loss_scale/_rules/dynamic.py``'s ``DynamicRule``.

    Args:
      inner: the optimizer to wrap.
      initial_scale: the scale at step 0.
      growth_factor: multiplier on growth, > 1.
      backoff_factor: multiplier on overflow, in (0, 1).
      growth_interval: clean steps in a row before the scale grows, >= 1.
      min_scale: floor of the scale, > 0 (below 1 is allowed).
      max_scale: ceiling of the scale, may be ``inf``.
      hysteresis: overflows tolerated before backing off, >= 1.
      consecutive_hysteresis: refill the hysteresis on every clean step
        instead of only on growth.
      **options: the keyword options.

    Returns:
      A ``LossScaleTransformation`` (an ``optax.GradientTransformationExtraArgs``)
      whose state is a ``LossScaleState``.

    Raises:
      TypeError: a setting of the wrong type, or an ``inner`` that is not an
        optax transformation.
      ValueError: a setting out of range, or an ``inner`` that scales already.

    Examples:
      >>> import jax, jax.numpy as jnp, optax, loss_scale as ls
      >>> tx = ls.dynamic(optax.sgd(0.1), initial_scale=2.0**10)
      >>> params = {"w": jnp.ones(3)}
      >>> state = tx.init(params)
      >>> loss_fn = lambda p: jnp.sum(p["w"] ** 2)
      >>> loss, grads = ls.value_and_grad(loss_fn)(state, params)
      >>> updates, state = tx.update(grads, state, params)
      >>> params = optax.apply_updates(params, updates)
      >>> params["w"]
      Array([0.8, 0.8, 0.8], dtype=float32)
    """
    initial, minimum, maximum = validate.scale_range(
        ("initial_scale", initial_scale), ("min_scale", min_scale), ("max_scale", max_scale)
    )
    rule = DynamicRule(
        initial_scale=initial,
        growth_factor=validate.growth_factor("growth_factor", growth_factor),
        backoff_factor=validate.backoff_factor("backoff_factor", backoff_factor),
        growth_interval=validate.count("growth_interval", growth_interval),
        min_scale=minimum,
        max_scale=maximum,
        hysteresis=validate.count("hysteresis", hysteresis),
        consecutive_hysteresis=validate.flag("consecutive_hysteresis", consecutive_hysteresis),
    )
    return loss_scaled(inner, rule, settings_from("dynamic", options))


@takes_options()
def static(inner: optax.GradientTransformation, scale: float, **options: Unpack[Options]) -> LossScaleTransformation:
    """A fixed loss scale around ``inner``; non-finite steps are still skipped.

    Args:
      inner: the optimizer to wrap.
      scale: the loss scale, a positive normal float32.
      **options: the keyword options.

    Returns:
      A ``LossScaleTransformation`` whose state is a ``LossScaleState``.

    Examples:
      >>> import jax.numpy as jnp, optax, loss_scale as ls
      >>> tx = ls.static(optax.sgd(1.0), scale=128.0)
      >>> state = tx.init(jnp.zeros(2))
      >>> updates, state = tx.update(jnp.array([128.0, jnp.inf]), state)
      >>> updates, bool(state.skipped)
      (Array([0., 0.], dtype=float32), True)
    """
    return loss_scaled(inner, fixed(validate.scale("scale", scale)), settings_from("static", options))


@checks_keywords
def no_op(inner: optax.GradientTransformation, skip_nonfinite: bool = False) -> LossScaleTransformation:
    """No loss scaling (scale 1), with the same state as ``dynamic``.

    For bfloat16 and float32 training, so that switching precision does not
    change the shape of the optimizer state or the training loop
    (``loss_scale.for_dtype`` builds it with the options, which take effect
    as they do for ``dynamic``).

    By default its update is the inner optimizer's and nothing else: the
    gradients are not read before it, and the counters and the record of the
    state pass through unchanged, so that the compiled step is the bare
    optimizer's (on a GPU, no kernel more). The statistics are measured
    where an option of ``for_dtype`` asks for one (``track_grad_norm``,
    ``max_grad_norm``, ``track_underflow``, ``locate_overflows``; then
    ``grad_max`` too) or with ``skip_nonfinite``.

    Args:
      inner: the optimizer to wrap.
      skip_nonfinite: by default the inner update runs on every step, even a
        non-finite one, as the bare optimizer's would; ``True`` checks the
        gradients and skips non-finite steps as ``static(inner, 1.0)`` does.

    Returns:
      A ``LossScaleTransformation`` whose state is a ``LossScaleState``.

    Examples:
      >>> import jax.numpy as jnp, optax, loss_scale as ls
      >>> tx = ls.no_op(optax.sgd(1.0))
      >>> state = tx.init(jnp.zeros(2))
      >>> float(ls.get_scale(state))
      1.0
      >>> updates, state = tx.update(jnp.array([3.0, -4.0]), state)
      >>> updates, int(state.skipped_steps)
      (Array([-3.,  4.], dtype=float32), 0)
      >>> tx = ls.no_op(optax.sgd(1.0), skip_nonfinite=True)
      >>> updates, state = tx.update(jnp.array([3.0, -4.0]), tx.init(jnp.zeros(2)))
      >>> float(ls.metrics(state)["loss_scale/grad_max"])
      4.0
    """
    return unscaled(inner, "no_op", {}, skip_nonfinite)


def unscaled(
    inner: optax.GradientTransformation, function: str, options: Options, skip_nonfinite: bool
) -> LossScaleTransformation:
    """Scale 1 around ``inner``, with ``options`` (validated for
    ``function``); every step applied unless ``skip_nonfinite``. The options
    that act on skipped steps only are refused without it."""
    skip_nonfinite = validate.flag("skip_nonfinite", skip_nonfinite)
    return loss_scaled(inner, fixed(1.0), settings_from(function, options, check_finite=skip_nonfinite))


@takes_options()
def predictive(
    inner: optax.GradientTransformation,
    initial_scale: float = 2.0**15,
    min_headroom: int = 1,
    headroom_interval: int = 20000,
    peak_half_life: float = 100.0,
    min_scale: float = 1.0,
    max_scale: float = 2.0**24,
    initial_headroom: int = 12,
    compute_dtype: Any = "float16",
    segments: Sequence[str] | None = None,
    **options: Unpack[Options],
) -> LossScaleTransformation:
    """Loss scaling that aims the scale at the recent gradient peak.

    The update is ``dynamic``'s (unscale in float32, check, skip the whole
    inner update on overflow); only the rule that moves the scale differs.
    Where ``dynamic`` reacts (it halves after an overflow and doubles after
    ``growth_interval`` clean steps), this rule predicts: from the largest
    gradient magnitude of every step, which the finite check computes anyway,
    it keeps a running peak (``grad_peak``, halving every ``peak_half_life``
    steps) and sets the scale to the power of two that puts that peak
    ``headroom`` binades below the largest float16 value. The scale follows
    the gradients down and up within steps, so it backs off before a slow
    rise of the gradients overflows and grows as soon as they shrink.

    The headroom learns how much larger than the parameter gradients the
    float16 values of the backward pass get. The first clean step measures
    how far below the float16 maximum its gradients were (at most
    ``initial_headroom`` counts); from there the scale climbs one binade a
    clean step until the first overflow, which sets the headroom two binades
    above what the scale had then (one skipped step), or until
    ``min_headroom`` is reached. After that the headroom drops by one every
    ``headroom_interval`` clean steps (a probe that may cost a skip; torch's
    rule probes every 2000 steps). Overflows in a row back off by 2, 4, 16,
    256, ...; an overflow before any clean step drops the scale to
    ``min_scale``. Every rule of the update is in
    ``loss_scale/_rules/predictive.py``'s ``PredictiveRule``.

    With the backward pass measured (``loss_scale.value_grad_and_peak``
    and ``tx.update(..., backward_peak=peak)``), the headroom is set from
    the measured largest value of the whole backward pass instead of learned
    by overflowing: the scale moves to where that value, rescaled, keeps
    ``min_headroom`` binades below the float16 maximum, in either direction,
    on every measuring step. Start at ``initial_scale=1.0`` then: the first
    step measures at a scale that cannot overflow.

    Args:
      inner: the optimizer to wrap.
      initial_scale: the scale of the first step (as ``dynamic``'s).
      min_headroom: the smallest margin, in powers of two, kept between the
        predicted largest scaled value and the dtype's largest value.
      headroom_interval: clean steps in a row after which the headroom drops
        by one, >= 1.
      peak_half_life: steps over which a past gradient peak counts half as
        much, >= 1.
      min_scale: floor of the scale, > 0.
      max_scale: ceiling of the scale, may be ``inf``.
      initial_headroom: the most headroom the first measurement keeps,
        >= ``min_headroom``: an upper bound on how much larger than the
        parameter gradients the backward pass's values may get.
      compute_dtype: the dtype of the backward pass, whose largest value is
        the overflow threshold (float16: 65504).
      segments: the names of the boundaries (``loss_scale.segment(x,
        name)``) that get a scale of their own: per-segment scaling. The
        global scale then follows this rule as without segments, measured
        over the whole backward pass, and on every measuring step each
        boundary's factor ``2**e`` is set so that the measured largest
        cotangent of every segment sits ``min_headroom`` binades (plus what
        overflows taught) below the threshold (``SegmentedRule`` in
        ``loss_scale/_rules/segmented.py``). Measure with
        ``loss_scale.value_grad_and_peak`` and pass its peaks on as
        ``backward_peak``; ``loss_scale.value_and_grad`` applies the factors
        without measuring. A loss function without boundaries trains
        exactly as without ``segments``.
      **options: the keyword options.

    Returns:
      A ``LossScaleTransformation`` whose state is a ``LossScaleState`` with
      ``PredictiveCounters`` (``headroom``, ``grad_peak``, ...), or with
      ``segments``, ``SegmentCounters`` (the same fields, then
      ``segments``, a ``SegmentTable`` of the exponents and the last
      measurement of each segment).

    Examples:
      >>> import jax.numpy as jnp, optax, loss_scale as ls
      >>> tx = ls.predictive(optax.sgd(0.1))
      >>> state = tx.init(jnp.zeros(2))
      >>> for _ in range(3):  # gradients of loss * scale; the largest unscaled one is 2**-8
      ...     _, state = tx.update(jnp.array([2.0**-8, 0.0]) * state.scale, state)
      ...     print(float(state.scale), int(state.headroom))
      32768.0 8
      65536.0 7
      131072.0 6
    """
    initial, minimum, maximum = validate.scale_range(
        ("initial_scale", initial_scale), ("min_scale", min_scale), ("max_scale", max_scale)
    )
    lowest = validate.count("min_headroom", min_headroom, -64, 64)
    first = validate.count("initial_headroom", initial_headroom, -64, 64)
    if first < lowest:
        raise ValueError(f"initial_headroom ({initial_headroom!r}) must be >= min_headroom ({min_headroom!r})")
    half_life = validate.real("peak_half_life", peak_half_life)
    if not 1 <= half_life < math.inf:
        raise ValueError(f"peak_half_life must be finite and >= 1 step, got {peak_half_life!r}")
    dtype = validate.floating_dtype("compute_dtype", compute_dtype)
    settings = dict(
        initial_scale=initial,
        initial_headroom=first,
        min_headroom=lowest,
        headroom_interval=validate.count("headroom_interval", headroom_interval),
        peak_half_life=half_life,
        min_scale=minimum,
        max_scale=maximum,
        overflow_threshold=min(float(jnp.finfo(dtype).max), validate.FLOAT32_MAX),
    )
    if segments is None:
        rule = PredictiveRule(**settings)
    else:
        rule = SegmentedRule(**settings, segments=validate.segment_names("segments", segments))
    return loss_scaled(inner, rule, settings_from("predictive", options))
