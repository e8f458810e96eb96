#!/usr/bin/env bash
# The overhead table, the mixed-precision speedup and the compile times on a GPU.
#
#   bash benchmarks/gpu.sh            # from the repository root, on a machine with an NVIDIA GPU
#
# Installs the package with its benchmark extras (flax, jmp, equinox, MPX) and
# a CUDA build of jax (skip that with LOSS_SCALE_NO_INSTALL=1 when jax[cuda],
# optax and chex are already there: the package is then imported from this
# checkout, and peers that are not installed are left out with a note),
# checks that jax sees a GPU, runs benchmarks/overhead.py on it (the same
# variants and tables as on CPU, on its --large models unless SIZE=default),
# prints the float16-compute speedup over float32 of each model, then runs
# benchmarks/compile_time.py (skip it with COMPILE_TIME=0).
#
# Settings (environment): OUT (output directory, default .), SIZE (large or
# default), ROUNDS (30), VARIANTS (overhead.py's --variants, default its own),
# COMPILE_REPEATS (1).
set -euo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-.}
if [ "${LOSS_SCALE_NO_INSTALL:-0}" != 1 ]; then
  python3 -m pip install -q -e ".[bench]" "jax[cuda12]"
else
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
size_flag=--large
[ "${SIZE:-large}" = default ] && size_flag=
python3 - <<'PY'
import jax
backend = jax.default_backend()
print("jax", jax.__version__, "devices:", jax.devices())
if backend != "gpu":
    raise SystemExit(f"no GPU visible to jax (backend {backend!r}); this script measures a GPU")
PY
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true
variants_flag=()
[ -n "${VARIANTS:-}" ] && variants_flag=(--variants "$VARIANTS")
python3 benchmarks/overhead.py $size_flag --models mlp,transformer --precisions f32,mixed --rounds "${ROUNDS:-30}" \
  ${variants_flag[@]+"${variants_flag[@]}"} --json "$out/gpu_overhead.json" | tee "$out/gpu_overhead.txt"
python3 benchmarks/speedup.py "$out/gpu_overhead.json" | tee "$out/gpu_speedup.txt"
if [ "${COMPILE_TIME:-1}" != 0 ]; then
  python3 benchmarks/compile_time.py --repeats "${COMPILE_REPEATS:-1}" --json "$out/gpu_compile_time.json" \
    | tee "$out/gpu_compile_time.txt"
fi
