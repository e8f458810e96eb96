"""examples/debug_overflow.py: the locator names the overflowing leaf."""

from tests._scripts import ROOT, load_script


def test_debug_overflow_example_locates_the_overflow():
    module = load_script(ROOT / "examples" / "debug_overflow.py", "debug_overflow")
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
