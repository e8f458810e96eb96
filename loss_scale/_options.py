"""The keyword options that every loss-scaling transformation takes.

Each option is declared once, in ``Options``: its name, its type, its
default, its check and its documentation. ``dynamic``, ``predictive``,
``static`` and every preset take them as ``**options``;
``takes_options`` gives each of those functions the full signature (for
``help`` and ``inspect``) and the options' documentation, and
``settings_from`` validates what a caller passed.
"""

from __future__ import annotations

import dataclasses
import inspect
import sys
import textwrap
import types
from collections.abc import Callable, Hashable, Mapping
from typing import Annotated, Any, TypedDict, get_type_hints

from loss_scale import _validate as validate
from loss_scale._settings import Settings

if sys.version_info >= (3, 11):
    from typing import Unpack
else:  # pragma: no cover
    from typing_extensions import Unpack

__all__ = ["OPTIONS", "Option", "Options", "Unpack", "settings_from", "takes_options"]


@dataclasses.dataclass(frozen=True)
class Option:
    """How one keyword option is defaulted, checked and documented."""

    default: Any
    check: Callable[[str, Any], Any]
    doc: str


def _optional(check):
    return lambda name, value: validate.optional(check, name, value)


class Options(TypedDict, total=False):
    """The keyword-only options of every loss-scaling transformation."""

    max_grad_norm: Annotated[
        float | None,
        Option(
            None,
            _optional(validate.positive),
            "clip the unscaled gradients to this global norm before the inner update, on finite steps only: "
            "``optax.chain(optax.clip_by_global_norm(max_grad_norm), inner)`` inside the wrapper, with the norm "
            "taken in the check's pass (clipping in front of the wrapper would see the still-scaled gradients).",
        ),
    ]
    track_grad_norm: Annotated[
        bool,
        Option(
            False,
            validate.flag,
            "record the unscaled global gradient norm (``grad_norm`` in ``loss_scale.metrics``); costs a sum of "
            "squares over the gradients.",
        ),
    ]
    locate_overflows: Annotated[
        bool,
        Option(
            False,
            validate.flag,
            "record which gradient leaves were non-finite on the last skipped step "
            "(``loss_scale.overflow_paths`` names them); costs a bool per leaf in the state.",
        ),
    ]
    axis_name: Annotated[
        Hashable | None,
        Option(
            None,
            validate.axis_name,
            "under ``shard_map`` or ``pmap``, the data axis: every replica agrees on the finite check and the "
            "largest gradient, so all skip the same steps and keep the same scale; the norm and the underflow "
            "counts of sharded parameters are added up over it. Pair it with "
            "``loss_scale.value_and_grad(..., axis_name=...)``.",
        ),
    ]
    max_consecutive_skips: Annotated[
        int | None,
        Option(
            None,
            _optional(validate.count),
            "``None`` keeps skipping for as long as the gradients overflow (the state reports it: "
            "``consecutive_skips``, ``steps_at_min``); an int ``n`` raises a ``loss_scale.SkippedStepsError`` "
            "on the n-th skipped step in a row, naming the non-finite gradient leaves. Called eagerly, "
            "``tx.update`` raises it as it is; under ``jit`` it comes from a host callback, and JAX hands it "
            "to the caller as a ``jax.errors.JaxRuntimeError`` whose message contains "
            "``SkippedStepsError: loss_scale: `` (``loss_scale.check_skips`` raises the error itself on the "
            "host, after a jitted step). No update is applied either way.",
        ),
    ]
    backoff_on_nonfinite_loss: Annotated[
        bool,
        Option(
            False,
            validate.flag,
            "with the loss passed as ``tx.update(..., value=loss)``, a non-finite loss is a forward failure: the "
            "step is skipped and counted apart (``skip_reason`` 2, ``SkipReason.NONFINITE_LOSS``; "
            "``nonfinite_losses``), and by default the scale is left as it was, since a smaller scale cannot "
            "make the forward pass finite; ``True`` backs "
            "it off as for an overflow.",
        ),
    ]
    track_underflow: Annotated[
        bool,
        Option(
            False,
            validate.flag,
            "record the fractions of gradient elements that are 0 and below float16's smallest normal once "
            "scaled (``zero_fraction``, ``below_normal_fraction``): a high value says the scale is too low. "
            "Costs two counting reductions over the gradients.",
        ),
    ]


def _declared() -> dict[str, tuple[Any, Option]]:
    """``{name: (type, Option)}`` in declaration order."""
    hints = get_type_hints(Options, include_extras=True)
    return {name: (hint.__origin__, hint.__metadata__[0]) for name, hint in hints.items()}


OPTIONS: Mapping[str, Option] = types.MappingProxyType({name: option for name, (_, option) in _declared().items()})


def settings_from(
    function: str,
    given: Mapping[str, Any],
    *,
    check_finite: bool = True,
    exclude: tuple[str, ...] = (),
    overrides: Mapping[str, Any] = types.MappingProxyType({}),
) -> Settings:
    """The validated ``Settings`` of the options a caller of ``function``
    passed; unknown names (and ``exclude``'d ones) raise the ``TypeError``
    Python raises for an unexpected keyword argument. ``overrides`` sets
    options the function takes under names of its own (validated by it)."""
    for name in given:
        if name not in OPTIONS or name in exclude:
            raise TypeError(f"{function}() got an unexpected keyword argument {name!r}")
    values = {name: option.check(name, given.get(name, option.default)) for name, option in OPTIONS.items()}
    values.update(overrides)
    if not check_finite:
        for name in SKIPPING_OPTIONS:
            if values[name] != OPTIONS[name].default:
                raise ValueError(
                    f"{function}(): with skip_nonfinite=False every step is applied, so {name}={values[name]!r}, "
                    f"which acts on skipped steps only, would never take effect: pass skip_nonfinite=True "
                    f"(non-finite steps are then skipped) or leave {name} out"
                )
    return Settings(**values, check_finite=check_finite)


# Options that act on skipped steps only: refused where no step is skipped
# (``for_dtype`` of a wide dtype without ``skip_nonfinite``) rather than
# silently dropped.
SKIPPING_OPTIONS = ("max_consecutive_skips", "backoff_on_nonfinite_loss")


def options_doc(exclude: tuple[str, ...] = ()) -> str:
    """The options' documentation, in the docstrings' Args style."""
    lines = []
    for name, option in OPTIONS.items():
        if name not in exclude:
            text = textwrap.fill(f"{name}: {option.doc}", width=76, subsequent_indent="  ")
            lines.append(text)
    return "\n".join(lines)


def takes_options(exclude: tuple[str, ...] = ()) -> Callable:
    """Decorates a function declared with ``**options: Unpack[Options]``: its
    ``__signature__`` lists every option as a keyword-only parameter with its
    default, and the ``**options:`` entry of its docstring's Args becomes one
    entry per option."""

    def decorate(function: Callable) -> Callable:
        signature = inspect.signature(function)
        parameters = [p for p in signature.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
        for name, (annotation, option) in _declared().items():
            if name not in exclude:
                parameters.append(
                    inspect.Parameter(
                        name, inspect.Parameter.KEYWORD_ONLY, default=option.default, annotation=annotation
                    )
                )
        function.__signature__ = signature.replace(parameters=parameters)
        function.__doc__ = _with_options_documented(function.__doc__ or "", exclude)
        return function

    return decorate


def _with_options_documented(doc: str, exclude: tuple[str, ...]) -> str:
    """``doc`` with its ``**options:`` Args entry (and the lines that continue
    it) replaced by one entry per option, at the same indentation."""
    lines = doc.splitlines()
    for i, line in enumerate(lines):
        if line.strip().startswith("**options:"):
            indent = line[: len(line) - len(line.lstrip())]
            end = i + 1
            while end < len(lines) and lines[end].startswith(indent + " ") and lines[end].strip():
                end += 1
            entries = textwrap.indent(options_doc(exclude), indent).splitlines()
            return "\n".join(lines[:i] + entries + lines[end:])
    raise ValueError("a function that takes options documents them with a '**options:' entry in its Args")
