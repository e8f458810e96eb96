"""examples/debug_overflow.py: the locator names the overflowing leaf."""

import importlib.util
import pathlib
import sys

EXAMPLE = pathlib.Path(__file__).parents[1] / "examples" / "debug_overflow.py"


def test_debug_overflow_example_locates_the_overflow():
    spec = importlib.util.spec_from_file_location("debug_overflow", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules["debug_overflow"] = module
    spec.loader.exec_module(module)
    results = module.main(["--steps", "60"])
    bad, good = results["unnormalized column"], results["normalized"]
    assert bad["skipped_steps"] > good["skipped_steps"] and bad["final_scale"] < good["final_scale"]
    assert bad["overflow_paths"] and set(bad["overflow_paths"]) < {
        "['encoder']['kernel']",
        "['encoder']['bias']",
        "['hidden']['kernel']",
        "['hidden']['bias']",
        "['head']['kernel']",
        "['head']['bias']",
    }
