"""The benchmarks' scripts, smoke-run on tiny models and few steps: every
script runs, checks what it checks, and prints the tables it promises (the
numbers mean nothing here; the scripts measure when run for real)."""

import importlib.util
import json
import math
import os
import subprocess
import sys

import jax
import pytest

from tests import _simulation as simulation
from tests._compare import assert_trees_bitwise
from tests._scripts import ROOT, load_script

BENCH = ROOT / "benchmarks"
# The harness as the scripts import it (each puts its own directory on
# sys.path), so that the tests and the scripts they load share one module.
sys.path.insert(0, str(BENCH.resolve()))
from _harness import hlo, peers, provenance, tables, timing  # noqa: E402

HAS_MPX = importlib.util.find_spec("mpx") is not None


def load(name: str):
    return load_script(BENCH / f"{name}.py", f"bench_{name}")


def printed_tables(text: str) -> list[list[dict[str, str]]]:
    """Every markdown table in ``text``, in order, as rows of header -> cell."""
    found, lines = [], text.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("|---") and i and lines[i - 1].startswith("|"):
            found.append(tables.parse_markdown("\n".join(lines[i - 1 :])))
    return found


OVERHEAD_COLUMNS = [
    "variant",
    "step ×bare median [95% CI]",
    "update-only ×bare",
    "compile ×bare (step / update)",
    "step temp MiB (Δ bare)",
    "step peak MiB (Δ bare)",
    "update temp MiB (Δ bare)",
]


def test_overhead_quick_runs_every_variant_and_prints_both_tables(capsys):
    overhead = load("overhead")
    result = overhead.main(["--quick", "--models", "mlp", "--precisions", "f32", "--rounds", "2"])
    [run] = result["runs"]
    [table] = run["tables"]
    names = [row["variant"] for row in table["rows"]]
    pytree = [peers.BARE, peers.LS, peers.LS_OVERFLOW, peers.LS_FUSED, peers.LS_FUSED_OVERFLOW,
              peers.APPLY_IF_FINITE, peers.JMP, peers.FLAX]  # fmt: skip
    equinox = [peers.EQX_BARE, peers.EQX_LS, peers.EQX_LS_OVERFLOW]
    equinox += [peers.MPX, peers.MPX_OVERFLOW] if HAS_MPX else []
    assert names == pytree + equinox
    for row in table["rows"]:
        for kind in ("step", "update"):
            stats = row[kind]
            assert math.isfinite(stats["median"]) and stats["median"] > 0
            assert stats["ci_low"] <= stats["median"] <= stats["ci_high"] and stats["rounds"] == 2
        in_equinox_group = row["family"] == "equinox" and row["variant"] != peers.EQX_BARE
        assert row["baseline"] == (peers.EQX_BARE if in_equinox_group else peers.BARE)
    out = capsys.readouterr().out
    assert "loss_scale 0." in out and "`python benchmarks/overhead.py --quick" in out  # provenance header
    main_table, equinox_table = printed_tables(out)
    assert list(main_table[0]) == OVERHEAD_COLUMNS
    assert [r["variant"] for r in main_table] == pytree and main_table[0]["update-only ×bare"].startswith("1.00")
    assert list(equinox_table[0]) == [c.replace("bare", "eqx bare") for c in OVERHEAD_COLUMNS]
    assert [r["variant"] for r in equinox_table] == equinox


def test_overhead_tuned_malloc_reruns_the_script_and_saves_its_tables(tmp_path, capfd):
    """--tuned-malloc runs benchmarks/overhead.py as a script in a child
    process (the harness found next to it); --out saves what it printed."""
    overhead = load("overhead")
    out_path = tmp_path / "overhead.txt"
    result = overhead.main(
        ["--quick", "--tuned-malloc", "--models", "transformer", "--precisions", "f32", "--rounds", "1",
         "--variants", "ls-fused,ls-trainstate", "--out", str(out_path)]
    )  # fmt: skip
    [run] = result["runs"]
    assert run["environment"]["malloc_env"] == timing.TUNED_MALLOC
    assert [row["variant"] for row in run["tables"][0]["rows"]] == [peers.BARE, peers.LS_FUSED, peers.LS_TRAIN_STATE]
    [saved] = printed_tables(out_path.read_text())  # the transformer has no Equinox table
    assert [r["variant"] for r in saved] == [peers.BARE, peers.LS_FUSED, peers.LS_TRAIN_STATE]
    assert "MALLOC_ARENA_MAX=1" in out_path.read_text() and "### transformer f32" in capfd.readouterr().out


def test_the_nnx_paths_reproduce_bare_adam_and_are_timed_against_it():
    """nnx.Optimizer and loss_scale.flax.Optimizer on an NNX module holding
    the MLP's params: overhead.main checks that one update of each gives bare
    Adam's params (check_updates) and that the warm-up steps were applied."""
    overhead = load("overhead")
    result = overhead.main(
        ["--quick", "--models", "mlp", "--precisions", "mixed", "--rounds", "1", "--variants", "ls-nnx,nnx-bare"]
    )
    [table] = result["runs"][0]["tables"]
    assert [(row["variant"], row["baseline"]) for row in table["rows"]] == [
        (peers.BARE, peers.BARE), (peers.NNX_BARE, peers.BARE), (peers.LS_NNX, peers.BARE)
    ]  # fmt: skip


def test_speedup_reads_a_two_precision_run(tmp_path, capsys):
    overhead = load("overhead")
    results = overhead.main(
        ["--quick", "--models", "mlp", "--precisions", "f32,mixed", "--rounds", "2", "--variants", "ls,ls-fused",
         "--json", str(tmp_path / "r.json")]
    )  # fmt: skip
    capsys.readouterr()
    speedup = load("speedup")
    [row] = speedup.main([str(tmp_path / "r.json"), "--out", str(tmp_path / "speedup.txt")])
    f32 = results["runs"][0]["tables"][0]
    assert row["model"] == "mlp" and row["f32_ms"] == f32["rows"][0]["step"]["median_ms"]
    for variant in speedup.VARIANTS:
        assert row[variant]["speedup"] == row["f32_ms"] / row[variant]["mixed_ms"] > 0
    [printed] = printed_tables(capsys.readouterr().out)
    assert list(printed[0]) == list(speedup.HEADERS) and printed[0]["model"] == "mlp"
    assert printed_tables((tmp_path / "speedup.txt").read_text()) == [printed]


def test_compile_time_quick_times_every_variant_against_bare(capsys):
    compile_time = load("compile_time")
    result = compile_time.main(["--quick", "--leaves", "2,3", "--optimizers", "sgd", "--repeats", "1"])
    assert [(r["leaves"], r["key"]) for r in result["rows"]] == [(n, k) for n in (2, 3) for k in compile_time.VARIANTS]
    for row in result["rows"]:
        assert row["trace_lower_s"] > 0 and row["compile_s"] > 0 and len(row["samples"]) == 1
        assert row["total_s"] == pytest.approx(row["trace_lower_s"] + row["compile_s"])
    [printed] = printed_tables(capsys.readouterr().out)
    assert list(printed[0]) == list(compile_time.HEADERS)
    assert [r["variant"] for r in printed[:6]] == [label for label, _ in compile_time.VARIANTS.values()]
    assert printed[0]["compile ×bare"] == printed[0]["trace+lower ×bare"] == "1.00x"


def test_autocast_quick_compares_the_three_versions_of_each_model(capsys):
    autocast = load("autocast")
    result = autocast.main(["--quick", "--models", "mlp"])
    versions = result["models"]["mlp"]["versions"]
    assert list(versions) == list(autocast.VERSIONS) == ["float32", "hand-cast", "autocast"]
    for measured in versions.values():
        assert measured["median_ms"] > 0 and measured["compile_s"] > 0
        assert measured["vs_hand_cast"]["rounds"] == 3
    # the float32 step has (almost) no converts; both half versions have many
    assert versions["float32"]["converts"] < versions["hand-cast"]["converts"]
    assert versions["float32"]["converts"] < versions["autocast"]["converts"]
    [printed] = printed_tables(capsys.readouterr().out)
    assert [row["version"] for row in printed] == ["float32", "hand-cast", "autocast"]
    assert printed[1]["vs hand-cast"] == "1.00 [1.00, 1.00]"


def test_the_timing_scripts_compile_afresh_where_a_persistent_cache_is_configured(tmp_path):
    """A user's ``JAX_COMPILATION_CACHE_DIR`` would turn timed compiles into
    file reads. Run as scripts, the timing benchmarks turn the cache off: the
    compile-time benchmark writes nothing there and its header mentions no
    cache. A header does name the cache where a process uses one."""
    for script in ("compile_time", "overhead", "predictive"):
        source = (ROOT / "benchmarks" / f"{script}.py").read_text()
        assert 'if __name__ == "__main__":\n    timing.fresh_compiles()\n    main()' in source, script
    cache = tmp_path / "xla-cache"
    env = dict(
        os.environ,
        JAX_COMPILATION_CACHE_DIR=str(cache),
        JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
        JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0",
    )
    argv = ["--quick", "--leaves", "2", "--optimizers", "sgd", "--variants", "ls", "--repeats", "1"]
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "compile_time.py"), *argv],
        env=env, capture_output=True, text=True, check=True, timeout=300,
    )  # fmt: skip
    assert "ls.dynamic" in result.stdout and "persistent compilation cache" not in result.stdout
    assert not cache.exists() or not any(cache.iterdir())
    environment = {**provenance.environment("benchmarks/compile_time.py", []), "compilation_cache": str(cache)}
    assert f"persistent compilation cache {cache}: compile times may be cache hits" in provenance.header(environment)


def test_predictive_benchmark_quick_trains_every_rule(capsys):
    module = load("predictive")
    results = module.main(["--quick", "--workloads", "regression"])
    [(name, workload)] = results["workloads"].items()
    assert name == "raw-column regression" and workload["steps"] == 6
    assert set(workload["runs"]) == {"float32", "torch rule", "ls.predictive", "ls.predictive + peak"}
    for run in workload["runs"].values():
        assert len(run["scales"]) == 6 and math.isfinite(run["eval_loss"])
        assert 0 <= run["skipped_steps"] <= 6
    # torch's 2**16 overflows this model's float16 gradients at the start.
    assert workload["runs"]["torch rule"]["skipped"][0]
    assert workload["runs"]["ls.predictive"]["headroom"] is not None
    # Measured peaks, from a first step at scale 1: no skip.
    assert workload["runs"]["ls.predictive + peak"]["skipped_steps"] == 0
    runs, summary = printed_tables(capsys.readouterr().out)
    assert list(runs[0]) == list(module.RUN_HEADERS) and list(summary[0]) == list(module.SUMMARY_HEADERS)
    assert [r["rule"] for r in runs] == ["float32", "torch rule", "ls.predictive", "ls.predictive + peak"]
    assert summary[0]["workload"] == "raw-column regression"


def test_predictive_benchmark_timing_quick_times_every_variant(capsys):
    module = load("predictive")
    results = module.main(["--timing", "--quick", "--rounds", "1", "--warmup", "0", "--block", "2"])
    rows = results["timing"]["rows"]
    assert [r["variant"] for r in rows] == list(module.TIMING_VARIANTS)
    for row in rows:
        assert row["steps"] == 2 and row["ratio"]["rounds"] == 1 and row["ms_per_step"] > 0
    [table] = printed_tables(capsys.readouterr().out)
    assert list(table[0]) == list(module.TIMING_HEADERS)


def test_predictive_benchmark_simulation_models_a_measured_peak():
    module = load("predictive")
    from loss_scale._rules.predictive import PredictiveRule

    grads = module.drifting_gradients(300, noise=0.05)
    scales, overflowed = module.simulate(PredictiveRule(initial_scale=1.0), grads, 3000.0, every=16)
    assert not overflowed.any() and scales[0] == 1.0 and scales[1] > 1.0
    # Without measurements, the same rule learns the amplification by overflowing.
    _, overflowed = module.simulate(PredictiveRule(initial_scale=1.0), grads, 3000.0)
    assert overflowed.any()


def test_predictive_benchmark_simulates_the_runs_the_tests_simulate():
    """tests/_simulation.py is the benchmark's simulated model, copied so
    that the rule tests need no flax: both give the same runs."""
    module = load("predictive")
    from loss_scale._rules.dynamic import DynamicRule
    from loss_scale._rules.predictive import PredictiveRule

    assert (module.SIMULATIONS, module.F16_MAX) == (simulation.SIMULATIONS, simulation.F16_MAX)
    grads = simulation.drifting_gradients(3000, noise=0.25, seed=1)
    assert_trees_bitwise(module.drifting_gradients(3000, noise=0.25, seed=1), grads)
    torch_rule = DynamicRule(initial_scale=2.0**16, min_scale=2.0**-30, max_scale=math.inf)
    for rule, every in [(torch_rule, None), (PredictiveRule(), None), (PredictiveRule(initial_scale=1.0), 16)]:
        runs = [m.simulate(rule, grads, 3000.0, every) for m in (module, simulation)]
        assert_trees_bitwise(*runs)


def test_segments_benchmark_quick_trains_every_run(capsys):
    module = load("segments")
    output = module.main(["--quick", "--workloads", "bag", "--steps", "6", "--rounds", "1"])
    [result] = output["results"]
    assert result["workload"] == "bag-of-bytes classifier" and result["steps"] == 6
    assert set(result["runs"]) == set(module.RUNS)
    for run in result["runs"].values():
        assert run["nonfinite_losses"] == 0 and math.isfinite(run["final_loss"])
    # Unscaled float16 flushes the embedding's tiny cotangents (51% of them at the end).
    assert result["runs"]["float16 unscaled"]["worst_flushed"] > 0.1
    assert set(result["runs"]["per-segment"]["exponents"]) == {"embed"}
    [runs] = printed_tables(capsys.readouterr().out)
    assert [r["run"] for r in runs] == list(module.RUNS)


def test_segments_benchmark_workloads_declare_their_boundaries():
    import jax
    import jax.numpy as jnp
    import optax

    import loss_scale as ls

    module = load("segments")
    for make in module.WORKLOADS.values():
        workload = make(True)
        batch = workload.batches(0)
        # A boundary is the identity forward.
        marked, unmarked = (float(workload.loss_fn(workload.params, batch, jnp.float32, m)) for m in (True, False))
        assert marked == unmarked, workload.name
        # Every boundary in the model is declared (an undeclared one is an error), and each is measured.
        state = ls.predictive(optax.sgd(0.0), initial_scale=1.0, segments=workload.segments).init(workload.params)
        _, _, peaks = ls.value_grad_and_peak(workload.loss_fn, every=1)(state, workload.params, batch)
        assert peaks.names == tuple(sorted(workload.segments)), workload.name
        assert bool(jnp.all(jnp.isfinite(peaks.peak))), workload.name
        assert len(workload.eval_batches) == 2 and not jax.tree.all(
            jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), workload.batches(0), workload.batches(1))
        )


@pytest.mark.parametrize("name", ["overhead", "compile_time", "predictive", "segments", "speedup", "autocast"])
def test_every_script_documents_its_flags_and_defaults(name, capsys):
    with pytest.raises(SystemExit) as exit_info:
        load(name).main(["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    assert "--out" in text and ("default:" in text or name == "speedup")


def test_median_ci_uses_order_statistics():
    # n = 20: the 6th smallest and the 6th largest, 95.9% coverage.
    low, high, coverage = timing.median_ci(range(1, 21))
    assert (low, high) == (6, 15) and coverage == pytest.approx(1 - 2 * 21700 / 2**20)
    # Too few rounds for 95%: the range, at its own coverage.
    assert timing.median_ci([3.0, 1.0, 2.0]) == (1.0, 3.0, 0.75)


def test_variant_selection_adds_what_a_row_needs():
    assert peers.resolve(["ls-fused-overflow"]) == ["bare", "ls-fused", "ls-fused-overflow"]
    assert peers.resolve(["mpx"]) == ["bare", "eqx-bare", "mpx"]
    with pytest.raises(ValueError, match="unknown variant"):
        peers.resolve(["no-such-variant"])


def test_results_json_round_trips(tmp_path):
    """What --json writes is plain JSON (speedup.py and later analyses read it)."""
    compile_time = load("compile_time")
    path = tmp_path / "c.json"
    compile_time.main(["--quick", "--leaves", "2", "--optimizers", "sgd", "--variants", "ls", "--json", str(path)])
    data = json.loads(path.read_text())
    assert [r["variant"] for r in data["rows"]] == ["bare", "ls.dynamic"] and data["environment"]["backend"] == "cpu"


# A compiled module as XLA prints it: an entry with a fusion, a library call
# and a conditional whose branches hold a fusion each, and a fused
# computation (one kernel, whatever it holds).
HLO_MODULE = """HloModule jit_step, entry_computation_layout={(f32[1024]{0}, pred[])->f32[1024]{0}}

%fused_computation (param_0: f32[1024]) -> f32[1024] {
  %param_0 = f32[1024]{0} parameter(0)
  %constant.1 = f32[] constant(2)
  %broadcast.1 = f32[1024]{0} broadcast(%constant.1), dimensions={}
  ROOT %multiply.1 = f32[1024]{0} multiply(%param_0, %broadcast.1)
}

%taken (arg: f32[1024]) -> f32[1024] {
  %arg = f32[1024]{0} parameter(0)
  ROOT %fusion.2 = f32[1024]{0} fusion(%arg), kind=kLoop, calls=%fused_computation
}

%skipped (arg.1: f32[1024]) -> f32[1024] {
  %arg.1 = f32[1024]{0} parameter(0)
  ROOT %copy.1 = f32[1024]{0} copy(%arg.1)
}

ENTRY %main (x: f32[1024], p: pred[]) -> f32[1024] {
  %x = f32[1024]{0} parameter(0)
  %p = pred[] parameter(1)
  %fusion.1 = bf16[1024]{0} fusion(%x), kind=kLoop, calls=%fused_computation
  %gemm = (f32[1024]{0}, s8[256]{0}) custom-call(%fusion.1, %fusion.1), custom_call_target="__cublas$gemm"
  %gte = f32[1024]{0} get-tuple-element(%gemm), index=0
  ROOT %conditional = f32[1024]{0} conditional(%p, %gte, %gte), true_computation=%taken, false_computation=%skipped
}
"""


def test_the_hlo_reader_counts_kernels_and_their_bytes():
    k = hlo.kernels(HLO_MODULE, min_bytes=4096)
    # fusion.1, the gemm, and each branch's kernel; the fused computation's
    # instructions, parameters, the get-tuple-element and the conditional are not kernels.
    assert k.count == 4
    assert k.by_opcode == {"fusion": 2, "custom-call": 1, "copy": 1}
    # fusion.1 reads 4096 B and writes 2048 (bf16); the gemm reads its operand once (2048) and
    # writes 4096 + 256; each branch reads and writes 4096.
    assert k.read_bytes == 4096 + 2048 + 4096 + 4096
    assert k.written_bytes == 2048 + 4352 + 4096 + 4096
    assert sorted(name for name, *_ in k.large) == ["copy.1", "fusion.1", "fusion.2", "gemm"]


def test_hlo_kernels_shows_what_each_path_adds_to_the_update(capsys, tmp_path):
    dump = tmp_path / "hlo"
    rows = load("hlo_kernels").main(
        ["--size", "quick", "--precisions", "f32", "--variants", "ls,apply-if-finite", "--dump", str(dump)]
    )
    by_variant = {row["variant"]: row for row in rows}
    assert list(by_variant) == [peers.BARE, peers.LS, peers.APPLY_IF_FINITE]
    assert by_variant[peers.BARE]["extra_kernels"] == 0 and by_variant[peers.BARE]["extra_mib"] == 0
    # A scaler reads the gradients at least once more than bare Adam (its finite check).
    params_mib = 9.6e3 * 4 / 2**20
    for name in (peers.LS, peers.APPLY_IF_FINITE):
        assert by_variant[name]["extra_kernels"] > 0 and by_variant[name]["extra_mib"] >= params_mib
    [table] = printed_tables(capsys.readouterr().out)
    assert [row["variant"] for row in table] == list(by_variant)
    # --dump: one program per variant, named by hlo.dump_path, the one the kernels were counted in.
    names = ["mlp_f32_adam_bare_update", "mlp_f32_ls_dynamic_update", "mlp_f32_optax_apply_if_finite_update"]
    assert sorted(p.name for p in dump.iterdir()) == [f"{n}.hlo.txt" for n in names]
    counted = hlo.kernels((dump / "mlp_f32_ls_dynamic_update.hlo.txt").read_text(), 1 << 20)
    assert counted.count == by_variant[peers.LS]["kernels"]


def test_the_unscaled_rows_move_no_more_bytes_than_bare_adam_on_the_cpu(capsys):
    """On XLA:CPU the division by the scale is a multiplication by its
    reciprocal (one scalar kernel), fused into the optimizer's pass: a
    division there would be materialized, a pass more over the gradients."""
    rows = load("hlo_kernels").main(
        ["--models", "mlp,tree", "--size", "quick", "--precisions", "f32,mixed", "--variants", "ls-no-op,ls-bf16"]
    )
    bare = {(r["model"], r["precision"]): r for r in rows if r["variant"] == peers.BARE}
    for row in rows:
        base = bare[row["model"], row["precision"]]
        assert row["kernels"] - base["kernels"] <= 1, row
        assert abs(row["read_mib"] + row["written_mib"] - base["read_mib"] - base["written_mib"]) < 1e-3, row


def test_a_gpu_target_without_the_plugin_says_why_and_exits():
    """In the README's suite jax runs without the CUDA plugin (or without
    JAX_PLATFORMS naming it): the scripts say so instead of failing deep
    inside jax."""
    from _harness import gpu

    reason = gpu.unavailable()
    if reason is None:
        pytest.skip("this process can compile for a GPU (tests/test_gpu_program.py covers it)")
    for script, argv in (("hlo_kernels", ["--target", "h100"]), ("compile_time", ["--target", "t4", "--quick"])):
        with pytest.raises(SystemExit, match="cannot compile for a GPU here: "):
            load(script).main(argv)


def test_every_target_config_names_its_device():
    from _harness import gpu

    for name in gpu.TARGETS:
        text = gpu.target_config(name)
        assert "cuda_compute_capability" in text and 'platform_name: "CUDA"' in text
    assert "major: 7 minor: 5" in gpu.target_config("t4")  # the free Colab GPU
    with pytest.raises(ValueError, match="unknown GPU target 'v100'"):
        gpu.target_config("v100")


def test_abstract_models_hold_shapes_only():
    from _harness import models

    large = models.build_abstract("transformer", "mixed", "large")
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves((large.params, large.batch)))
    assert models.n_params(large.params) > 2e8
    real, shapes = models.build("tree", "f32", "quick"), models.build_abstract("tree", "f32", "quick")
    assert jax.tree.structure(real.params) == jax.tree.structure(shapes.params)
    assert [x.shape for x in jax.tree.leaves(real.params)] == [x.shape for x in jax.tree.leaves(shapes.params)]
    assert len(jax.tree.leaves(models.build_abstract("tree", "f32", "gpu").params)) == 160


def test_the_gpu_check_runs_through_on_a_cpu(tmp_path):
    """benchmarks/gpu.sh with the quick models and one test file: every stage
    runs and writes what it promises (on a GPU, the same script measures)."""
    env = {
        **os.environ,
        "OUT": str(tmp_path),
        "PYTHON": sys.executable,
        "SIZE": "quick",
        "ALLOW_CPU": "1",
        "ROUNDS": "2",
        "VARIANTS": "ls",
        "TESTS": "tests/test_layers.py",
        "TEST_WORKERS": "1",
        # The caps fit a GPU's window; on 2 shared CPU cores a stage can
        # take longer than its cap (low_precision's cost did, at 40 s).
        "CAP_SCALE": "4",
    }
    done = subprocess.run(["bash", str(BENCH / "gpu.sh")], env=env, capture_output=True, text=True, timeout=600)
    log = (tmp_path / "gpu.log").read_text()
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    stages = ["versions", "tests", "overhead mlp", "overhead transformer", "hlo kernels", "autocast"]
    for stage in [*stages, "low_precision cost"]:
        assert f"== {stage}: rc=0 in" in log, (stage, log[-3000:])
    files = {"gpu.log", "overhead_mlp.json", "overhead_transformer.json", "hlo_kernels.txt", "autocast.txt"}
    assert files | {"low_precision_cost.txt"} == {p.name for p in tmp_path.iterdir()}
