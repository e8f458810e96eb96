"""Smoke runs of the examples with tiny step counts: they run, return their
results, print their table and save their plot."""

import math
import pathlib

import pytest

from tests._scripts import ROOT, load_script

pytest.importorskip("flax")
pytest.importorskip("tqdm")
pytest.importorskip("matplotlib")

EXAMPLES = ROOT / "examples"
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
