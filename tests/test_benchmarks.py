"""The benchmarks' logic, on tiny models and few steps (their numbers mean
nothing here; ``python benchmarks/overhead.py`` and
``python benchmarks/predictive.py`` measure)."""

import math

from tests._scripts import ROOT, load_script

BENCH = ROOT / "benchmarks"


def load(name: str = "overhead"):
    return load_script(BENCH / f"{name}.py", f"bench_{name}")


def test_overhead_quick_runs_every_variant_and_checks_them():
    overhead = load()
    result = overhead.main(["--quick", "--models", "mlp", "--precisions", "f32", "--rounds", "2"])
    [run] = result["runs"]
    [table] = run["tables"]
    names = [row["variant"] for row in table["rows"]]
    assert names[:5] == [
        overhead.BARE,
        overhead.LS,
        overhead.LS_OVERFLOW,
        overhead.LS_FUSED,
        overhead.LS_FUSED_OVERFLOW,
    ]
    assert {"optax.apply_if_finite", "jmp DynamicLossScale", "flax DynamicScale"} <= set(names)
    for row in table["rows"]:
        for kind in ("step", "update"):
            assert math.isfinite(row[kind]["median"]) and row[kind]["median"] > 0
    rendered = overhead.format_table(table)
    assert "ls.dynamic + ls.apply_gradients" in rendered and "|" in rendered


def test_speedup_reads_a_two_precision_run(tmp_path):
    overhead = load()
    results = overhead.main(
        ["--quick", "--models", "mlp", "--precisions", "f32,mixed", "--rounds", "2", "--json", str(tmp_path / "r.json")]
    )
    speedup = load("speedup")
    [row] = speedup.main([str(tmp_path / "r.json")])
    f32 = results["runs"][0]["tables"][0]
    assert row["model"] == "mlp" and row["f32_ms"] == f32["rows"][0]["step"]["median_ms"]
    for variant in speedup.VARIANTS:
        assert row[variant]["speedup"] == row["f32_ms"] / row[variant]["mixed_ms"] > 0


def test_predictive_benchmark_quick_trains_every_rule():
    module = load("predictive")
    results = module.main(["--quick", "--workloads", "regression"])
    [(name, workload)] = results["workloads"].items()
    assert name == "raw-column regression" and workload["steps"] == 6
    assert set(workload["runs"]) == {"float32", "torch rule", "ls.predictive"}
    for run in workload["runs"].values():
        assert len(run["scales"]) == 6 and math.isfinite(run["eval_loss"])
        assert 0 <= run["skipped_steps"] <= 6
    # torch's 2**16 overflows this model's float16 gradients at the start.
    assert workload["runs"]["torch rule"]["skipped"][0]
    assert workload["runs"]["ls.predictive"]["headroom"] is not None
    table = module.format_table(results)
    assert "raw-column regression" in table and "torch rule / ls.predictive" in table
