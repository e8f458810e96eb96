#!/usr/bin/env bash
# Fetches, into .whl/, the two peers benchmarks/gpu.sh installs on a GPU
# machine that can download nothing: jmp and MPX (mixed-precision-for-JAX),
# both pure Python (MPX ships only an sdist: its wheel is built here). Their
# own needs (numpy, jax, equinox, optax, jaxtyping, wadler-lindig) are on
# such a machine's image. .whl/ is ignored by git; carry it to the machine.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
python3 -m pip download -q --no-deps -d .whl jmp==0.0.4
python3 -m pip wheel -q --no-deps -w .whl mixed-precision-for-JAX==0.1.8
ls .whl
