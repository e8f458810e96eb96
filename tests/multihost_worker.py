"""One process of the two-process test in tests/test_multihost.py.

Run as ``python tests/multihost_worker.py PROCESS_ID PORT OUT_JSON``: joins a
two-process JAX cluster on localhost (CPU collectives over gloo), trains a
small model data-parallel with the batch split across the processes, injects
an overflow into this process's gradients only on some steps, and writes the
scale and skip trajectory it saw.
"""

import json
import sys

import jax

jax.config.update("jax_cpu_collectives_implementation", "gloo")

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import loss_scale as ls  # noqa: E402

STEPS = 60
POISON = {7: 0, 19: 1, 20: 1, 33: 0, 34: 1, 50: 0}  # step -> process that overflows


def main(process_id: int, port: int, out_path: str) -> None:
    jax.distributed.initialize(f"localhost:{port}", num_processes=2, process_id=process_id)
    mesh = Mesh(np.array(jax.devices()), ("data",))
    batch_sharding = NamedSharding(mesh, P("data"))
    replicated = NamedSharding(mesh, P())

    tx = ls.dynamic(optax.adam(0.05), initial_scale=2.0**10, growth_interval=8)
    params = {"w": jnp.zeros((4, 1)), "b": jnp.zeros((1, 1))}
    params = jax.device_put(params, replicated)
    state = jax.device_put(tx.init(params), replicated)

    @jax.jit
    def step(params, state, x, y, poison):
        def loss_fn(p):
            return jnp.mean((x @ p["w"] + p["b"] - y) ** 2)

        loss, grads = ls.value_and_grad(loss_fn)(state, params)
        # poison is per-example, sharded like the batch: only the rows this
        # process holds can carry it, so one host alone sees the overflow.
        grads = jax.tree.map(lambda g: g * jnp.max(poison), grads)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    rng = np.random.default_rng(0)
    record = {"scale": [], "skipped": [], "loss": []}
    for i in range(STEPS):
        x = rng.normal(size=(16, 4)).astype(np.float32)
        y = x @ np.array([[1.0], [-2.0], [0.5], [3.0]], np.float32) + 0.25
        poison = np.ones((16,), np.float32)
        if i in POISON:
            rows = slice(0, 8) if POISON[i] == 0 else slice(8, 16)
            poison[rows] = np.inf
        local = slice(8 * process_id, 8 * process_id + 8)
        x_g, y_g, p_g = (
            multihost_utils.host_local_array_to_global_array(a[local], mesh, P("data")) for a in (x, y, poison)
        )
        params, state, loss = step(params, state, x_g, y_g, p_g)
        record["scale"].append(float(state.scale))
        record["skipped"].append(bool(state.skipped))
        record["loss"].append(float(loss))
    record["w"] = np.asarray(multihost_utils.process_allgather(params["w"], tiled=True)).ravel().tolist()
    del batch_sharding
    with open(out_path, "w") as f:
        json.dump(record, f)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
