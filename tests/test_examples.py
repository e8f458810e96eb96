"""Smoke runs of the examples with tiny step counts: they run, return their
results, print their table and save their plot; ``python examples/NAME.py
--help`` works from the repository root and shows every option's default."""

import math
import os
import pathlib
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import loss_scale as ls
from tests._scripts import ROOT, load_script

pytest.importorskip("flax")
pytest.importorskip("tqdm")
pytest.importorskip("matplotlib")

EXAMPLES = ROOT / "examples"
SCRIPTS = sorted(p.stem for p in EXAMPLES.glob("*.py") if not p.name.startswith("_"))
LABELS = ("float32", "bfloat16", "float16, no scaling", "float16 + ls.dynamic")


def load(name: str):
    return load_script(EXAMPLES / f"{name}.py", f"example_{name}")


def check(results: dict, steps: int, metrics: tuple[str, ...], out: str, plot: pathlib.Path, labels=LABELS) -> None:
    assert tuple(results["runs"]) == labels
    for label, run in results["runs"].items():
        assert len(run["losses"]) == len(run["scales"]) == len(run["skipped"]) == steps
        assert all(math.isfinite(run[m]) for m in metrics), (label, run)
        assert run["ms_per_step"] > 0 and run["compile_s"] > 0
        assert 0 <= run["skipped_steps"] <= steps
        assert label in out
    unscaled = [label for label in ("float32", "bfloat16", "float16, no scaling") if label in labels]
    assert all(results["runs"][label]["final_scale"] == 1.0 for label in unscaled)
    assert results["runs"]["float16 + ls.dynamic"]["final_scale"] > 1.0
    assert results["summary"] in out
    assert plot.stat().st_size > 10_000


def test_cnn_digits_smoke(tmp_path, capsys):
    pytest.importorskip("sklearn")
    plot = tmp_path / "digits.png"
    results = load("cnn_digits").main(["--steps", "4", "--batch-size", "16", "--no-progress", "--plot", str(plot)])
    out = capsys.readouterr().out
    check(results, 4, ("train_loss", "test_loss", "test_accuracy", "gap_to_float32"), out, plot)
    assert results["runs"]["float32"]["gap_to_float32"] == 0.0
    assert "test acc" in out


def test_nnx_lm_smoke(tmp_path, capsys):
    # Two of the four precisions keep this test short: each one compiles its
    # own train step. The CNN test above runs all four.
    plot = tmp_path / "lm.png"
    tiny = ["--steps", "3", "--batch-size", "2", "--seq-len", "16", "--dim", "16", "--heads", "2", "--layers", "1"]
    tiny += ["--vocab", "128", "--max-bytes", "200000", "--val-batches", "1", "--no-progress", "--plot", str(plot)]
    results = load("nnx_lm").main([*tiny, "--precisions", "bfloat16,float16+dynamic"])
    out = capsys.readouterr().out
    labels = ("bfloat16", "float16 + ls.dynamic")
    check(results, 3, ("train_loss", "val_loss", "zero_grad_peak"), out, plot, labels=labels)
    assert "val loss" in out and "Python stdlib" in out


@pytest.mark.parametrize("name", ["cnn_digits", "nnx_lm"])
def test_unknown_precision_is_rejected(name, capsys):
    with pytest.raises(SystemExit):
        load(name).parse_args(["--precisions", "float32,float8"])
    assert "float8" in capsys.readouterr().err


def test_equinox_mlp_trains_in_float16(tmp_path, capsys):
    pytest.importorskip("equinox")
    pytest.importorskip("sklearn")
    import equinox as eqx

    plot = tmp_path / "mlp.png"
    module = load("equinox_mlp")
    results = module.main(["--steps", "60", "--rows", "3", "--plot", str(plot)])
    out = capsys.readouterr().out
    rows = list(results["rows"].values())
    assert list(results["rows"]) == ["20", "40", "60"] and "test acc" in out and "skipped" in out
    # It trains: the loss falls row after row, the accuracy rises far above chance.
    losses = [row["train_loss"] for row in rows]
    assert losses == sorted(losses, reverse=True) and losses[-1] < 0.5 * losses[0]
    assert results["initial_test_accuracy"] < 0.3 and rows[-1]["test_accuracy"] > 0.75
    (run,) = results["runs"].values()
    assert len(run["losses"]) == 60 and all(math.isfinite(x) for x in run["losses"])
    assert run["final_scale"] >= 2.0**15 and run["skipped_steps"] == 0
    # float16 compute: the arrays the forward and backward passes use are float16, and so
    # are the logits; the model keeps float32 master weights, which Adam updates.
    model, policy = results["model"], ls.Policy.from_string(results["policy"])
    assert policy.compute_dtype == jnp.float16
    arrays = eqx.filter(model, eqx.is_inexact_array)
    assert {a.dtype for a in jax.tree.leaves(policy.cast_to_compute(arrays))} == {jnp.dtype(jnp.float16)}
    assert {a.dtype for a in jax.tree.leaves(arrays)} == {jnp.dtype(jnp.float32)}
    x = module.load_data(0)["test"][0][:4]
    assert jax.vmap(policy.cast_to_compute(model))(policy.cast_to_compute(x)).dtype == jnp.float16
    assert plot.stat().st_size > 10_000


def test_autocast_mlp_ends_within_1_percent_of_the_hand_cast_model(tmp_path, capsys):
    # A model written in float32, ls.autocast + ls.dynamic, against the same model
    # cast by hand (params and images to float16, logits to float32) and float32:
    # the same initialization and batches, the default 200 steps.
    pytest.importorskip("equinox")
    pytest.importorskip("sklearn")
    plot = tmp_path / "autocast.png"
    module = load("autocast_mlp")
    results = module.main(["--plot", str(plot)])
    out = capsys.readouterr().out
    runs = results["runs"]
    assert list(runs) == [module.AUTOCAST, module.HAND_CAST, module.FLOAT32]
    autocast, hand_cast, float32 = (runs[label]["final_loss"] for label in runs)
    # The claim the script prints and checks: within 1% of the hand-cast model.
    assert abs(autocast - hand_cast) <= 0.01 * hand_cast, (autocast, hand_cast)
    assert results["within_tolerance"] and "(within 1%)" in out and results["summary"] in out
    assert abs(autocast - float32) <= 0.02 * float32, (autocast, float32)
    # It trains, in float16: the products of a gradient step are float16 (float32
    # without autocast), the scale grew, no step was skipped.
    first = runs[module.AUTOCAST]["losses"][0]
    assert autocast < 0.1 * first and runs[module.AUTOCAST]["test_accuracy"] > 0.9
    assert results["product_dtypes"][module.AUTOCAST] == results["product_dtypes"][module.HAND_CAST] == {"float16": 8}
    assert results["product_dtypes"][module.FLOAT32] == {"float32": 8}
    for label in (module.AUTOCAST, module.HAND_CAST):
        assert runs[label]["final_scale"] > 2.0**15 and runs[label]["skipped_steps"] == 0
        assert len(runs[label]["losses"]) == 200 and all(math.isfinite(x) for x in runs[label]["losses"])
    assert runs[module.FLOAT32]["final_scale"] == 1.0
    assert plot.stat().st_size > 10_000


def test_autocast_mlp_fails_outside_its_tolerance(capsys):
    # The check can fail: with a tolerance below the measured gap it says so.
    module = load("autocast_mlp")
    results = module.main(["--steps", "20", "--tolerance", "0"])
    assert results["gap_to_hand_cast"] != 0.0 and not results["within_tolerance"]
    assert "NOT within 0%" in capsys.readouterr().out


def test_low_precision_mlp_ends_near_float32_where_nearest_rounding_does_not(capsys):
    # bfloat16 params and AdamW moments: Kahan-compensated and stochastic
    # rounding end within the script's tolerance of float32's final loss,
    # rounding to nearest (optax.apply_updates alone) far above it.
    pytest.importorskip("equinox")
    pytest.importorskip("sklearn")
    module = load("low_precision")
    results = module.main([])  # the defaults: 800 steps
    out = capsys.readouterr().out
    runs = results["runs"]
    assert list(runs) == list(module.RUNS)
    assert results["within_tolerance"] and "(within 5%)" in out and results["summary"] in out
    for label in module.CHECKED:
        assert abs(runs[label]["gap_to_float32"]) <= 0.05, (label, runs[label]["gap_to_float32"])
        assert runs[label]["param_dtype"] == "bfloat16"
    assert runs["bfloat16, nearest"]["gap_to_float32"] > 0.3
    assert runs["float32"]["state_bytes"] == pytest.approx(8.0, abs=0.01)
    assert runs["bfloat16, kahan"]["state_bytes"] == pytest.approx(6.0, abs=0.01)
    assert runs["bfloat16, stochastic"]["state_bytes"] == pytest.approx(4.0, abs=0.01)
    assert all(len(run["losses"]) == 800 and all(map(math.isfinite, run["losses"])) for run in runs.values())


def test_next_token_model_and_batches():
    from flax import nnx

    nnx_lm = load("nnx_lm")
    tokens = np.arange(1000, dtype=np.int32) % 50
    context, targets = nnx_lm.next_token_batch(tokens, np.random.default_rng(0), 8, 3)
    assert context.shape == (8, 3) and targets.shape == (8,)
    np.testing.assert_array_equal(np.asarray(targets), (np.asarray(context[:, -1]) + 1) % 50)
    model = nnx_lm.NextToken(50, 3, dtype=jnp.float16, rngs=nnx.Rngs(0))
    logits = model(context)
    assert logits.shape == (8, 50) and logits.dtype == jnp.float16
    assert model.head.kernel[...].dtype == jnp.float32


def options_help(text: str) -> dict[str, str]:
    """``--help``'s option entries: the option's flags -> its whole entry, continuation lines joined."""
    section = text.split("options:\n", 1)[1].split("\n\n", 1)[0]
    entries = re.split(r"\n(?=  -)", section)
    return {entry.split()[0].rstrip(","): " ".join(entry.split()) for entry in entries}


@pytest.mark.parametrize("name", SCRIPTS)
def test_help_shows_every_default(name):
    # From the repository root, as the README runs them: examples/_common.py is
    # found because Python puts the script's folder on sys.path.
    env = {**os.environ, "COLUMNS": "100"}
    result = subprocess.run(
        [sys.executable, f"examples/{name}.py", "--help"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    entries = options_help(result.stdout)
    assert "--steps" in entries and len(entries) >= 2
    for flag, entry in entries.items():
        assert flag == "-h" or "(default:" in entry, (name, entry)
    assert f"python examples/{name}.py" in result.stdout  # the usage lines of its docstring


def test_the_examples_are_found():
    assert SCRIPTS == [
        "autocast_mlp",
        "cnn_digits",
        "debug_overflow",
        "equinox_mlp",
        "low_precision",
        "nnx_lm",
        "quickstart",
    ]


def test_results_table():
    common = load_script(EXAMPLES / "_common.py", "_common")
    rows = {
        "float32": {"loss": 0.12345, "acc": 0.9, "n": 3},
        "float16 + ls.dynamic": {"loss": float("nan"), "acc": 1.0, "n": 12},
    }
    text = common.format_table(rows, [("loss", "loss", ".3f"), ("accuracy", "acc", ".1%"), ("n", "n", "d")])
    assert text.splitlines() == [
        "precision                loss  accuracy   n",
        "-------------------------------------------",
        "float32                 0.123     90.0%   3",
        "float16 + ls.dynamic      nan    100.0%  12",
    ]


def test_the_scale_curve_ends_at_the_final_scale(tmp_path):
    # The plot shows the scale each step was taken at, then the scale after
    # the last step: the curve ends where the results table does.
    common = load_script(EXAMPLES / "_common.py", "_common")
    run = {"losses": [1.0, 0.5, 0.25], "scales": [2.0, 2.0, 4.0], "skipped": [False] * 3, "final_scale": 8.0}
    figure = common.plot_runs({"float16 + ls.dynamic": run}, title="t", path=str(tmp_path / "p.png"))
    (scale_axis,) = [ax for ax in figure.axes if ax.get_title() == "Loss scale"]
    curve = scale_axis.get_lines()[0]
    assert list(curve.get_ydata()) == [2.0, 2.0, 4.0, 8.0]
