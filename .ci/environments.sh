#!/usr/bin/env bash
# The environments of .ci/run's later stages, made while the first stage's
# suite runs (.ci/run starts this in the background and waits for it before
# the second stage): downloading and unpacking wait on the network and the
# disk more than on the CPU, so they cost the suite little of its time.
#
# Usage: bash .ci/environments.sh SYSTEM_PYTHON
#   .venv-newest            CPython 3.13 (.ci/python3.13.sh) with the newest jax
#   .venv-min               the core at .ci/minimum-versions.txt
#   .venv-min-integrations  flax and Equinox at .ci/minimum-versions-integrations.txt
#   dist/                   the sdist and the wheel, checked with twine
#   .venv-package-install   a fresh environment with the wheel installed
# and, in pip's cache, the CUDA plugins of .venv's jaxlib and the newest
# (.ci/gpu-program.sh installs them from there).
set -euo pipefail
cd "$(dirname "$0")/.."
system_python=$1

cache_plugins() {
  # The plugin of the environment's jaxlib, CUDA 12's or CUDA 13's, into
  # pip's cache only (nothing is installed here).
  local python=$1 version cuda into
  version=$("$python" -c "import jaxlib; print(jaxlib.__version__)")
  into=$(mktemp -d)
  for cuda in cuda12 cuda13; do
    if "$python" -m pip download -q --no-deps -d "$into" "jax-$cuda-plugin==$version" "jax-$cuda-pjrt==$version" 2>/dev/null; then
      break
    fi
  done
  rm -rf "$into"
}

echo "== the CUDA plugin of the first stage's jaxlib (.venv), into pip's cache"
cache_plugins .venv/bin/python

echo "== the newest jax's environment"
python313=$(bash .ci/python3.13.sh)
"$python313" -m venv .venv-newest
.venv-newest/bin/python -m pip install -q --upgrade pip
.venv-newest/bin/pip install -q -e ".[test]"
.venv-newest/bin/pip install -q --upgrade jax jaxlib optax chex flax equinox
cache_plugins .venv-newest/bin/python

echo "== the core at its minimum versions"
"$system_python" -m venv .venv-min
.venv-min/bin/python -m pip install -q --upgrade pip
.venv-min/bin/pip install -q -c .ci/minimum-versions.txt -e . chex pytest hypothesis pytest-xdist

echo "== flax and Equinox at their minimum versions"
"$system_python" -m venv .venv-min-integrations
.venv-min-integrations/bin/python -m pip install -q --upgrade pip
.venv-min-integrations/bin/pip install -q -c .ci/minimum-versions-integrations.txt -e . chex flax equinox \
  orbax-checkpoint pytest hypothesis pytest-xdist

echo "== the sdist and the wheel"
"$system_python" -m venv .venv-package
.venv-package/bin/python -m pip install -q --upgrade pip build twine
rm -rf dist
.venv-package/bin/python -m build
.venv-package/bin/twine check --strict dist/*
"$system_python" -m venv .venv-package-install
.venv-package-install/bin/python -m pip install -q --upgrade pip
wheel=$(ls dist/loss_scale-*.whl)
.venv-package-install/bin/pip install -q "$wheel[examples]"
echo "== environments ready"
