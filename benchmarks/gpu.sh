#!/usr/bin/env bash
# The GPU check: what only a GPU shows, in one run that fits a short window.
#
#   bash benchmarks/gpu.sh            # from the repository root, on a machine with an NVIDIA GPU
#
# From a bare machine whose Python already has jax with CUDA, optax, chex,
# flax, equinox, pytest, pytest-xdist and hypothesis (nothing is downloaded):
# jmp and MPX (mixed-precision-for-JAX), the two peers such an image lacks,
# are installed from wheels in .whl/ when it holds them (see
# benchmarks/gpu_wheels.sh, run where pip can download), else left out of
# the tables with a note. The package is imported from this checkout.
#
# Stages, each capped with `timeout` so that the whole fits in about 8
# minutes (the caps add up to 440 s; a stage that reaches its cap is cut
# and the next one runs):
#
#   1. versions and the device;
#   2. the GPU-sensitive tests on the GPU (low precision and the roundings a
#      GPU keeps, the skip and its select path, autocast, precision,
#      reliability), pytest -n 4;
#   3. the overhead tables of every path against the peers, float32 and
#      mixed precision, on the --gpu models (the MLP 4096->8192x4->1000,
#      batch 1024, and a 4-layer transformer LM, d=1024, seq 512);
#   4. the kernels and bytes of each path's update in the optimized HLO;
#   5. ls.autocast against the hand-cast model and float32;
#   6. ls.low_precision's cost, kahan and stochastic against nearest.
#
# Everything lands in $OUT (default gpu-results/), in six files: gpu.log
# (every stage's output, also printed), overhead_mlp.json,
# overhead_transformer.json, hlo_kernels.txt, autocast.txt and
# low_precision_cost.txt.
#
# Settings (environment): OUT; PYTHON (python3); ROUNDS (timed rounds, 10);
# VARIANTS (overhead.py's, default every path and peer); TEST_WORKERS (4);
# TESTS (the test files, default those above); SIZE (the benchmarks' model
# size, gpu; quick with ALLOW_CPU=1 runs the whole script on a CPU in a
# few minutes, as tests/test_benchmarks.py does to keep it working);
# CAP_SCALE (an integer that multiplies every cap, 1: that test's CPU run,
# on cores that other jobs share, is checked for what it writes, not for
# the window's time).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu-results}
mkdir -p "$out"
log="$out/gpu.log"
: >"$log"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
python=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if compgen -G ".whl/*.whl" >/dev/null; then
  "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/gpu-site .whl/*.whl \
    && export PYTHONPATH="$PYTHONPATH:/tmp/gpu-site"
fi
rounds=${ROUNDS:-10}
variants=${VARIANTS:-bare,ls,ls-overflow,ls-fused,ls-fused-overflow,ls-trainstate,ls-nnx,apply-if-finite,jmp,flax,eqx-bare,eqx-ls,mpx}
size=${SIZE:-gpu}
tests=${TESTS:-tests/test_low_precision.py tests/test_rounding_kept.py tests/test_skip.py tests/test_skip_select.py
  tests/test_autocast.py tests/test_autocast_rules.py tests/test_precision.py tests/test_reliability.py}
export ALLOW_CPU=${ALLOW_CPU:-0}
began=$(date +%s)
failed=()

# stage NAME SECONDS COMMAND...: runs COMMAND under a cap, its output into gpu.log.
stage() {
  local name=$1 cap=$(($2 * ${CAP_SCALE:-1})) start rc
  shift 2
  start=$(date +%s)
  echo "== $name (cap ${cap}s, at $((start - began))s)" | tee -a "$log"
  timeout --kill-after=5 "$cap" "$@" 2>&1 | tee -a "$log"
  rc=${PIPESTATUS[0]}
  echo "== $name: rc=$rc in $(($(date +%s) - start))s$([ "$rc" = 124 ] && echo ' (cut at its cap)')" | tee -a "$log"
  [ "$rc" = 0 ] || failed+=("$name")
}

stage versions 30 env python="$python" bash -c '
  date -u +%Y-%m-%dT%H:%MZ
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"
  "$python" - <<PY
import importlib.metadata as md, os, jax
for name in ("jax", "jaxlib", "optax", "chex", "flax", "equinox", "jmp", "mixed-precision-for-JAX"):
    try:
        print(name, md.version(name))
    except md.PackageNotFoundError:
        print(name, "not installed")
print("devices", jax.devices())
if jax.default_backend() != "gpu" and os.environ["ALLOW_CPU"] != "1":
    raise SystemExit("no GPU visible to jax: this script checks a GPU")
PY'

# shellcheck disable=SC2086 # TESTS is a list of paths
stage tests 140 "$python" -m pytest -q -p no:cacheprovider -o addopts="" -n "${TEST_WORKERS:-4}" --dist loadfile $tests

# The transformer's variants take longer to compile than the MLP's.
for model in mlp:60 transformer:90; do
  stage "overhead ${model%:*}" "${model#*:}" "$python" benchmarks/overhead.py --size "$size" --models "${model%:*}" \
    --precisions f32,mixed --variants "$variants" --rounds "$rounds" --warmup 2 --json "$out/overhead_${model%:*}.json"
done

stage "hlo kernels" 40 bash -c "set -o pipefail; $python benchmarks/hlo_kernels.py --size $size | tee '$out/hlo_kernels.txt'"

stage autocast 40 bash -c "set -o pipefail; $python benchmarks/autocast.py --size $size --rounds $rounds --warmup 2 | tee '$out/autocast.txt'"

stage "low_precision cost" 40 bash -c "set -o pipefail; $python benchmarks/low_precision.py --parts cost --cost-size $size \
  --rounds $rounds --warmup 2 | tee '$out/low_precision_cost.txt'"

echo "== done in $(($(date +%s) - began))s; files in $out: $(ls "$out" | tr '\n' ' ')" | tee -a "$log"
if [ ${#failed[@]} -gt 0 ]; then
  echo "== stages that failed or were cut: ${failed[*]}" | tee -a "$log"
  exit 1
fi
