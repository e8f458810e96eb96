"""The keyword options that every loss-scaling transformation takes.

Each option is declared once, in ``Options``: its name, its type, its
default, its check and its documentation. ``dynamic``, ``predictive``,
``static`` and every preset take them as ``**options``;
``takes_options`` gives each of those functions the full signature (for
``help`` and ``inspect``) and the options' documentation, and
``settings_from`` validates what a caller passed.

A keyword that no factory takes gets a ``TypeError`` that says what to write
instead (``unexpected_keyword``): another library's name for a setting
(``init_scale``, torch's) names this library's argument and the preset that
takes the peer's names; a close misspelling names the closest argument.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import inspect
import textwrap
import types
from collections.abc import Callable, Hashable, Iterable, Mapping
from typing import Annotated, Any, TypedDict, TypeVar, Unpack, cast, get_type_hints

from loss_scale import _validate as validate
from loss_scale._settings import Settings

__all__ = [
    "OPTIONS",
    "PEER_NAMES",
    "Option",
    "Options",
    "Unpack",
    "accepted_keywords",
    "checks_keywords",
    "settings_from",
    "takes_options",
    "unexpected_keyword",
]


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
    Python raises for an unexpected keyword argument, with what to write
    instead (``unexpected_keyword``). ``overrides`` sets options the
    function takes under names of its own (validated by it)."""
    for name in given:
        if name not in OPTIONS or name in exclude:
            accepted = _ACCEPTED.get(function, tuple(n for n in OPTIONS if n not in exclude))
            raise unexpected_keyword(function, name, accepted)
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
        _register(function, [p.name for p in parameters])
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


# The keyword arguments each factory and preset takes, by the name its
# errors give it (``"dynamic"``, ``"torch"``), and how the public API spells
# it (``ls.dynamic``, ``ls.presets.torch``): for the suggestions of
# ``unexpected_keyword``. Filled in as the functions are defined.
_ACCEPTED: dict[str, tuple[str, ...]] = {}
_PUBLIC: dict[str, str] = {}


def _register(function: Callable, names: list[str]) -> None:
    _ACCEPTED[function.__name__] = tuple(names)
    package = "ls.presets" if function.__module__.startswith("loss_scale.presets") else "ls"
    _PUBLIC[function.__name__] = f"{package}.{function.__name__}"


def accepted_keywords(function: str) -> tuple[str, ...]:
    """The keyword arguments of the registered factory ``function``."""
    return _ACCEPTED[function]


F = TypeVar("F", bound=Callable[..., Any])


def checks_keywords(function: F) -> F:
    """Decorates a factory without ``**options`` (``no_op``): an unknown
    keyword gets ``unexpected_keyword``'s explanation instead of Python's
    bare ``TypeError``. The signature, name and docstring are kept."""
    names = list(inspect.signature(function).parameters)
    _register(function, names)

    @functools.wraps(function)
    def checked(*args: Any, **kwargs: Any) -> Any:
        for name in kwargs:
            if name not in names:
                raise unexpected_keyword(function.__name__, name, names)
        return function(*args, **kwargs)

    return cast(F, checked)


# Other libraries' names for their loss scalers' settings, as the presets
# (``loss_scale.presets``) take them, and where each setting goes here:
# ``{name: ((presets, this library's argument or None, how to write it), ...)}``,
# one entry per meaning (jmp's ``loss_scale`` is an initial scale, Apex's,
# DeepSpeed's and Megatron's a fixed one). The argument is ``ls.dynamic``'s
# (or an option); ``None`` where the setting has no argument here, and the
# text then says what to use instead. ``tests/test_validate.py`` checks it
# against the presets' signatures.
PEER_NAMES: Mapping[str, tuple[tuple[tuple[str, ...], str | None, str], ...]] = types.MappingProxyType(
    {
        "init_scale": ((("torch", "apex"), "initial_scale", "initial_scale=..."),),
        "enabled": ((("torch",), None, "enabled=False (no loss scaling) is ls.no_op(inner)"),),
        "dynamic_growth_steps": ((("keras", "tf_keras"), "growth_interval", "growth_interval=..."),),
        "dynamic": ((("tf_keras",), None, "dynamic=False (a fixed scale) is ls.static(inner, scale=...)"),),
        "initial_scale_power": ((("deepspeed",), "initial_scale", "initial_scale=2.0**initial_scale_power"),),
        "loss_scale_window": ((("deepspeed", "megatron"), "growth_interval", "growth_interval=..."),),
        "initial_loss_scale": ((("megatron", "cerebras"), "initial_scale", "initial_scale=..."),),
        "min_loss_scale": ((("deepspeed", "megatron", "apex", "jmp", "cerebras"), "min_scale", "min_scale=..."),),
        "max_loss_scale": ((("apex", "cerebras"), "max_scale", "max_scale=..."),),
        "loss_scale": (
            (("jmp",), "initial_scale", "initial_scale=..."),
            (("deepspeed", "megatron", "apex"), None, "a fixed loss_scale is ls.static(inner, scale=...)"),
        ),
        "scale_window": ((("apex",), "growth_interval", "growth_interval=..."),),
        "scale": ((("flax",), "initial_scale", "initial_scale=..."),),
        "minimum_scale": ((("flax",), "min_scale", "min_scale=..."),),
        "period": ((("jmp",), "growth_interval", "growth_interval=..."),),
        "factor": ((("jmp",), "growth_factor", "growth_factor=factor, backoff_factor=1/factor"),),
        "steps_per_increase": ((("cerebras",), "growth_interval", "growth_interval=..."),),
        "overflow_tolerance": (
            (
                ("cerebras",),
                None,
                "ls.dynamic has no counterpart (it backs off on every overflow, or on every hysteresis-th)",
            ),
        ),
        "max_gradient_norm": ((("cerebras",), "max_grad_norm", "max_grad_norm=..."),),
    }
)

# The peers, as the messages name them.
_PEERS = {
    "torch": "torch's GradScaler",
    "keras": "Keras",
    "tf_keras": "tf-keras",
    "deepspeed": "DeepSpeed",
    "megatron": "Megatron-LM",
    "apex": "Apex",
    "flax": "flax's DynamicScale",
    "jmp": "jmp",
    "cerebras": "Cerebras",
}


def _join(words: list[str], last: str = "and") -> str:
    return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} {last} {words[-1]}"


def unexpected_keyword(function: str, name: str, accepted: Iterable[str]) -> TypeError:
    """The ``TypeError`` for a keyword ``name`` that ``function`` (as its
    errors call it: ``"dynamic"``, ``"torch"``) does not take, ``accepted``
    being the keywords it does take. It starts as Python's own message and
    goes on to say what to write instead: for another library's name, this
    library's argument and the presets that take that name; for another
    factory's argument, which factory takes it; for a close misspelling,
    the closest accepted name."""
    accepted = tuple(accepted)
    message = f"{function}() got an unexpected keyword argument {name!r}"
    hints = []
    # Once the message says which accepted argument to write, a guessed
    # spelling would only compete with it.
    guess = True
    meanings = PEER_NAMES.get(name, ())
    if meanings:
        peers = [peer for presets, _, _ in meanings for peer in presets]
        hints.append(f"{name} is a name from {_join([_PEERS[p] for p in peers])}")
        for presets, argument, spelling in meanings:
            if argument is None:
                fix = spelling
            elif argument in accepted:
                guess = False
                fix = f"{function}() takes it as {spelling}"
            else:
                fix = f"ls.dynamic takes it as {spelling}"
            if len(meanings) > 1:
                fix = f"for {_join([_PEERS[p] for p in presets])}, {fix}"
            hints.append(fix)
        presets = [f"ls.presets.{p}" for p in peers]
        takes = "takes" if len(presets) == 1 else "take"
        hints.append(f"or keep the peer's names and rule with {_join(presets, 'or')}, which {takes} {name}=")
    others = [
        public
        for factory, public in _PUBLIC.items()
        if factory != function and not public.startswith("ls.presets.") and name in _ACCEPTED[factory]
    ]
    if others:
        hints.append(f"{name} is an argument of {_join(others)}")
    close = difflib.get_close_matches(name, accepted, n=1) if guess else []
    if close:
        hints.append(f"did you mean {close[0]}?")
    if hints:
        message += ": " + "; ".join(hints)
    return TypeError(message)
