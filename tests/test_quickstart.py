"""The main demo runs end to end on a tiny configuration, and saves its plot."""

from tests._scripts import ROOT, load_script


def test_quickstart_smoke(tmp_path, capsys):
    module = load_script(ROOT / "examples" / "quickstart.py", "quickstart")
    plot = tmp_path / "quickstart.png"
    result = module.main(["--steps", "3", "--vocab", "512", "--tokens", "64", "--no-progress", "--plot", str(plot)])
    runs = result["runs"]
    assert set(runs) == {"float32", "float16, no scaling", "float16 + ls.dynamic"}
    for run in runs.values():
        assert len(run["losses"]) == 3 and all(loss == loss for loss in run["losses"])  # no nan
        assert 0.0 <= run["zero_grad_fraction"] <= 1.0
    assert runs["float16 + ls.dynamic"]["final_scale"] > 1 and runs["float16, no scaling"]["final_scale"] == 1
    out = capsys.readouterr().out
    assert "zero logit grads" in out and result["summary"] in out
    assert plot.stat().st_size > 10_000
