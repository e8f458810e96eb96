#!/usr/bin/env bash
# The virtual environments of .ci/run's later stages, made while its first
# stage runs the suite:
#   .venv-newest                 the newest jax on CPython 3.13 (.ci/python3.13.sh
#                                builds it, once, into a cache folder)
#   .venv-min                    the core's declared minimum versions
#   .venv-min-integrations       flax's and Equinox's declared minimum versions
# One after another: each pip install builds the project in this folder.
set -euo pipefail
cd "$(dirname "$0")/.."
step() { echo "-- $* (at ${SECONDS} s)"; }

step "CPython 3.13"
python313=$(bash .ci/python3.13.sh)
step "the newest jax, on $python313"
"$python313" -m venv .venv-newest
.venv-newest/bin/python -m pip install -q --upgrade pip
.venv-newest/bin/pip install -q -e ".[test]"
.venv-newest/bin/pip install -q --upgrade jax jaxlib optax chex flax equinox

step "the core's minimum versions (.ci/minimum-versions.txt)"
python3 -m venv .venv-min
.venv-min/bin/python -m pip install -q --upgrade pip
.venv-min/bin/pip install -q -c .ci/minimum-versions.txt -e . chex pytest hypothesis pytest-xdist

step "the integrations' minimum versions (.ci/minimum-versions-integrations.txt)"
python3 -m venv .venv-min-integrations
.venv-min-integrations/bin/python -m pip install -q --upgrade pip
.venv-min-integrations/bin/pip install -q -c .ci/minimum-versions-integrations.txt -e . \
  chex flax equinox orbax-checkpoint pytest hypothesis pytest-xdist
step "done"
