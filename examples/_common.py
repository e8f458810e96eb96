"""What the example scripts share: the command line, the results table and the plot.

Every example is a script (``python examples/NAME.py --help``) and a module
that the tests and the notebooks import. A run's results are a dict
``{"config": vars(args), "runs": {label: run}, ...}``; a run is a dict of
final numbers (``train_loss``, ``final_scale``, ...) and per-step lists
(``losses``, ``scales``, ``skipped``, optionally ``zero_fractions``), which
the table and the plot read.
"""

from __future__ import annotations

import argparse
import math
import platform
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

# --precisions name: (label, policy string, whether float16 gets loss scaling)
PRECISIONS = {
    "float32": ("float32", "params=float32,compute=float32,output=float32", True),
    "bfloat16": ("bfloat16", "params=float32,compute=bfloat16,output=float32", True),
    "float16": ("float16, no scaling", "params=float32,compute=float16,output=float32", False),
    "float16+dynamic": ("float16 + ls.dynamic", "params=float32,compute=float16,output=float32", True),
}
PLAIN, SCALED = PRECISIONS["float16"][0], PRECISIONS["float16+dynamic"][0]

Run = Mapping[str, Any]


# ---------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """``--help`` shows the script's description as written and every option's default."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        # An option that says what its default means keeps its own words.
        return action.help if "(default:" in (action.help or "") else super()._get_help_string(action)


def make_parser(doc: str, *, steps: int) -> argparse.ArgumentParser:
    """A parser whose ``--help`` has the docstring's first paragraph, its usage
    lines (the indented block after ``Usage::``) and the defaults; ``--steps`` first."""
    paragraphs = doc.strip().split("\n\n")
    usage = re.search(r"Usage::\n\n((?:    .*\n?|\n)+)", doc)
    parser = argparse.ArgumentParser(
        description=paragraphs[0],
        epilog="examples:\n" + usage.group(1).rstrip() if usage else None,
        formatter_class=HelpFormatter,
    )
    parser.add_argument("--steps", type=int, default=steps, help="training steps per run")
    return parser


def add_run_options(
    parser: argparse.ArgumentParser,
    *,
    seed: int = 0,
    precisions: bool = False,
    plot: bool = False,
    progress: bool = False,
) -> None:
    """The options most examples have, added after the example's own."""
    parser.add_argument("--seed", type=int, default=seed, help="seed of the data order and the initialization")
    if precisions:
        parser.add_argument(
            "--precisions", default=",".join(PRECISIONS), help=f"comma-separated, from {', '.join(PRECISIONS)}"
        )
    if plot:
        parser.add_argument(
            "--plot", metavar="PATH", default=None, help="save a PNG of the training curves there (default: no plot)"
        )
    if progress:
        parser.add_argument("--no-progress", action="store_true", help="no progress bars")


def parse(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """Parses ``argv`` (``sys.argv`` when None), checks ``--steps`` and turns
    ``--precisions`` into a list of names; errors exit with the usage."""
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error("--steps must be >= 1")
    if isinstance(getattr(args, "precisions", None), str):
        args.precisions = [p.strip() for p in args.precisions.split(",") if p.strip()]
        unknown = [p for p in args.precisions if p not in PRECISIONS]
        if unknown or not args.precisions:
            parser.error(f"--precisions: unknown {unknown}, choose from {', '.join(PRECISIONS)}")
    return args


def device_line() -> str:
    """Where this runs, e.g. ``cpu (x86_64, 1 device)``."""
    import jax

    count = jax.device_count()
    return f"{jax.devices()[0].platform} ({platform.machine()}, {count} device{'s' if count > 1 else ''})"


def digits(seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """scikit-learn's bundled 8x8 digits (nothing is downloaded), pixels in
    0..1 as ``[n, 8, 8, 1]`` float32, split 80/20 stratified:
    ``(x_train, x_test, y_train, y_test)``."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    data = load_digits()
    images = (data.images / 16.0).astype(np.float32)[..., None]  # pixels 0..16, scaled to 0..1
    labels = data.target.astype(np.int32)
    return tuple(train_test_split(images, labels, test_size=0.2, random_state=seed, stratify=labels))


# ---------------------------------------------------------------------------
# Results
# ---------------------------------------------------------------------------


def finite_tail_mean(values: Sequence[float], count: int) -> float:
    """Mean of the finite values among the last ``count`` (nan when none is)."""
    tail = [v for v in values[-max(1, count) :] if math.isfinite(v)]
    return float(np.mean(tail)) if tail else float("nan")


def add_gaps(runs: Mapping[str, dict], reference: str = "float32") -> None:
    """Adds ``gap_to_float32`` to every run: the mean over the steps of
    ``|training loss - the reference run's training loss|`` (same data and
    initialization), the finite steps only; nan without a reference run."""
    if reference not in runs:
        for run in runs.values():
            run["gap_to_float32"] = float("nan")
        return
    ref = np.asarray(runs[reference]["losses"], dtype=float)
    for run in runs.values():
        gap = np.abs(np.asarray(run["losses"], dtype=float) - ref)
        run["gap_to_float32"] = float(np.mean(gap[np.isfinite(gap)])) if np.isfinite(gap).any() else float("nan")


def format_table(rows: Mapping[str, Run], columns: Sequence[tuple[str, str, str]], first: str = "precision") -> str:
    """A text table: one row per ``rows`` entry, its label first.

    Args:
      rows: label -> run (a mapping of values).
      columns: ``(header, key, format spec)``; a ``%`` spec shows a fraction
        as a percentage, an ``s`` spec is left-aligned text.
      first: the header of the label column.
    """
    cells = [[format(run[key], spec) for _, key, spec in columns] for run in rows.values()]
    label_width = max(len(first), *(len(label) for label in rows)) + 2
    widths = [max(len(header), *(len(row[i]) for row in cells)) + 2 for i, (header, _, _) in enumerate(columns)]
    left = [spec.endswith("s") for _, _, spec in columns]

    def line(label: str, values: Iterable[str]) -> str:
        parts = [
            f"  {v:<{w - 2}}" if is_left else f"{v:>{w}}" for v, w, is_left in zip(values, widths, left, strict=True)
        ]
        return (f"{label:<{label_width}}" + "".join(parts)).rstrip()

    header = line(first, (h for h, _, _ in columns))
    body = [line(label, row) for label, row in zip(rows, cells, strict=True)]
    return "\n".join([header, "-" * len(header), *body])


def print_table(rows: Mapping[str, Run], columns: Sequence[tuple[str, str, str]], first: str = "precision") -> str:
    """Prints ``format_table(rows, columns, first)`` and returns it."""
    text = format_table(rows, columns, first)
    print(text)
    return text


def report(
    results: dict,
    columns: Sequence[tuple[str, str, str]],
    summary: str | None = None,
    *,
    title: str = "",
    log_loss: bool = True,
) -> None:
    """The end of a run: the table, the summary (kept in ``results["summary"]``),
    the wall time and, with ``--plot PATH``, the plot (``plot_runs``)."""
    print_table(results["runs"], columns)
    if summary is not None:
        results["summary"] = summary
        print(summary)
    print(f"total wall time {results['wall_s']:.0f} s")
    path = results["config"].get("plot")
    if path:
        smooth = max(1, results["config"]["steps"] // 50)
        plot_runs(results["runs"], title=title, path=path, smooth=smooth, log_loss=log_loss)
        print(f"plot saved to {path}")


# ---------------------------------------------------------------------------
# Plot
# ---------------------------------------------------------------------------


def moving_average(values: Sequence[float], window: int) -> tuple[np.ndarray, np.ndarray]:
    """``(steps, averages)`` of a trailing moving average over ``window`` steps."""
    window = max(1, min(window, len(values)))
    averages = np.convolve(np.asarray(values, dtype=float), np.ones(window) / window, mode="valid")
    return np.arange(len(averages)) + window - 1, averages


def plot_runs(
    runs: Mapping[str, Run],
    *,
    title: str,
    path: str | None = None,
    smooth: int = 1,
    panels: Sequence[str] | None = None,
    log_loss: bool = True,
) -> Any:
    """The training curves of several runs, one colour per run in every panel.

    Panels (``panels``, or every one the runs have data for): ``"loss"``, the
    training loss (moving average over ``smooth`` steps); ``"gap"``, its
    distance from the ``float32`` run's; ``"zeros"``, the fraction of gradient
    elements that were exactly 0 (runs with ``zero_fractions``); ``"scale"``,
    the loss scale of every scaled run, skipped steps marked: the scale each
    step was taken at, and at the end the scale after the last step (the
    run's ``final_scale``, which the table shows).

    Returns the matplotlib figure; with ``path`` it is saved there as a PNG
    and closed (no display is needed), else it is a pyplot figure, which a
    notebook shows.
    """
    if panels is None:
        panels = ["loss"]
        if "float32" in runs and len(runs) > 1:
            panels.append("gap")
        if all("zero_fractions" in run for run in runs.values()):
            panels.append("zeros")
        if any(max(run["scales"]) > 1 for run in runs.values()):
            panels.append("scale")
    shape = (2, 2) if len(panels) == 4 else (1, len(panels))
    size = (13, 8.5) if len(panels) == 4 else (5.7 * len(panels), 4.5)
    if path:
        from matplotlib.figure import Figure

        fig = Figure(figsize=size)
    else:
        import matplotlib.pyplot as plt

        fig = plt.figure(figsize=size)
    axes = dict(zip(panels, np.atleast_1d(fig.subplots(*shape)).flat, strict=True))
    reference = np.asarray(runs["float32"]["losses"], dtype=float) if "float32" in runs else None
    for i, (label, run) in enumerate(runs.items()):
        color = f"C{i}"
        if "loss" in axes:
            axes["loss"].plot(*moving_average(run["losses"], smooth), color=color, label=label)
        if "gap" in axes and reference is not None and label != "float32":
            gap = np.abs(np.asarray(run["losses"], dtype=float) - reference)
            axes["gap"].semilogy(*moving_average(gap, smooth), color=color, label=label)
        if "zeros" in axes and "zero_fractions" in run:
            axes["zeros"].plot(100 * np.asarray(run["zero_fractions"]), color=color, label=label)
        if "scale" in axes and max(run["scales"]) > 1:
            skips = np.flatnonzero(run["skipped"])
            # The scale each step was taken at, then the scale after the last
            # step: the curve ends at the run's final_scale, as the table does.
            scales = [*run["scales"], run["final_scale"]] if "final_scale" in run else run["scales"]
            axes["scale"].semilogy(scales, base=2, color=color, label=f"{label}: loss scale")
            marks = np.asarray(run["scales"])[skips]
            axes["scale"].semilogy(skips, marks, "rx", base=2, label=f"{label}: skipped step ({len(skips)})")
    averaged = " (moving average)" if smooth > 1 else ""
    titles = {
        "loss": (f"Training loss{averaged}", "loss (log axis)" if log_loss else "loss"),
        "gap": (f"Distance from the float32 run{averaged}", "|loss - float32 loss| (log axis)"),
        "zeros": ("Gradient elements that are exactly zero", "% of elements"),
        "scale": ("Loss scale", "scale (log2 axis)"),
    }
    for name, ax in axes.items():
        ax.set(title=titles[name][0], xlabel="step", ylabel=titles[name][1])
        if name == "loss" and log_loss:
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
        if ax.has_data():
            ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    if path:
        fig.savefig(path, dpi=100)
    return fig
