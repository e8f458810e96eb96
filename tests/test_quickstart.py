"""The main demo runs end to end on a tiny configuration."""

import importlib.util
import pathlib
import sys

QUICKSTART = pathlib.Path(__file__).parents[1] / "examples" / "quickstart.py"


def test_quickstart_smoke():
    spec = importlib.util.spec_from_file_location("quickstart", QUICKSTART)
    module = importlib.util.module_from_spec(spec)
    sys.modules["quickstart"] = module
    spec.loader.exec_module(module)
    result = module.main(["--steps", "3", "--vocab", "512", "--tokens", "64", "--no-progress"])
    runs = result["runs"]
    assert set(runs) == {"float32", "float16, no scaling", "float16 + ls.dynamic"}
    for run in runs.values():
        assert len(run["losses"]) == 3 and all(loss == loss for loss in run["losses"])  # no nan
        assert 0.0 <= run["zero_grad_fraction"] <= 1.0
    assert runs["float16 + ls.dynamic"]["final_scale"] > 1 and runs["float16, no scaling"]["final_scale"] == 1
