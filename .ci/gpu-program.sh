#!/usr/bin/env bash
# The GPU program's tests (tests/test_gpu_program.py) in the active virtual
# environment: install the CUDA plugin of its jaxlib's version (CUDA 12's,
# or CUDA 13's where jaxlib has no CUDA 12 plugin; no GPU and no NVIDIA
# libraries: XLA:GPU compiles deviceless for the target configs in
# benchmarks/gpu_targets/), run the tests with the plugin beside the CPU,
# and uninstall it: loaded without JAX_PLATFORMS naming it, the plugin
# prints an error at every import of jax.
set -euo pipefail
cd "$(dirname "$0")/.."
version=$(python -c "import jaxlib; print(jaxlib.__version__)")
for cuda in cuda12 cuda13; do
  if pip install -q "jax-$cuda-plugin==$version" "jax-$cuda-pjrt==$version" 2>/dev/null; then
    echo "jax-$cuda-plugin $version"
    JAX_PLATFORMS=cpu,cuda JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 \
      python -m pytest -n auto -q -p no:cacheprovider -o addopts="-ra" tests/test_gpu_program.py
    pip uninstall -q -y "jax-$cuda-plugin" "jax-$cuda-pjrt"
    exit 0
  fi
done
echo "no CUDA plugin of jaxlib $version to install" >&2
exit 1
