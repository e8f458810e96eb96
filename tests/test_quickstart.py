"""The main demo runs end to end on a tiny configuration."""

from tests._scripts import ROOT, load_script


def test_quickstart_smoke():
    module = load_script(ROOT / "examples" / "quickstart.py", "quickstart")
    result = module.main(["--steps", "3", "--vocab", "512", "--tokens", "64", "--no-progress"])
    runs = result["runs"]
    assert set(runs) == {"float32", "float16, no scaling", "float16 + ls.dynamic"}
    for run in runs.values():
        assert len(run["losses"]) == 3 and all(loss == loss for loss in run["losses"])  # no nan
        assert 0.0 <= run["zero_grad_fraction"] <= 1.0
    assert runs["float16 + ls.dynamic"]["final_scale"] > 1 and runs["float16, no scaling"]["final_scale"] == 1
