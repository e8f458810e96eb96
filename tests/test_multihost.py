"""Two processes on this machine form one JAX cluster (jax.distributed on
localhost, CPU collectives): an overflow on one host only is skipped by both,
both keep the same scale, and both train exactly as one device with the
whole batch does."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np

from tests.multihost_worker import POISON, STEPS, single_device_run

WORKER = Path(__file__).with_name("multihost_worker.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def test_two_processes_skip_the_same_steps(tmp_path):
    port = free_port()
    # One CPU device per process; no shared compilation cache (the two
    # processes compile the same programs at the same time).
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_COMPILATION_CACHE_DIR")}
    env["PYTHONPATH"] = str(WORKER.parents[1]) + os.pathsep + env.get("PYTHONPATH", "")
    outs = [tmp_path / f"p{i}.json" for i in range(2)]
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(i), str(port), str(outs[i])],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    logs = [p.communicate(timeout=240)[0] for p in procs]
    for p, log in zip(procs, logs, strict=True):
        assert p.returncode == 0, log[-3000:]
    a, b = (json.loads(o.read_text()) for o in outs)
    assert a["scale"] == b["scale"] and a["skipped"] == b["skipped"] and a["w"] == b["w"]
    assert [i for i, s in enumerate(a["skipped"]) if s] == sorted(POISON)
    assert len(a["scale"]) == STEPS and len(set(a["scale"])) > 2
    assert a["loss"][-1] < 0.2 * a["loss"][0]
    reference = single_device_run()
    assert a["scale"] == reference["scale"] and a["skipped"] == reference["skipped"]
    np.testing.assert_allclose(a["w"], reference["w"], rtol=2e-5)
    # The loss each host reports is the global mean, as on one device.
    np.testing.assert_allclose(a["loss"], reference["loss"], rtol=2e-5)
