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


def make_tx():
    return ls.dynamic(optax.adam(0.05), initial_scale=2.0**10, growth_interval=8)


def init_params():
    return {"w": jnp.zeros((4, 1)), "b": jnp.zeros((1, 1))}


def global_batches():
    """(x, y, poison) of every step, for the whole global batch of 16."""
    rng = np.random.default_rng(0)
    for i in range(STEPS):
        x = rng.normal(size=(16, 4)).astype(np.float32)
        y = x @ np.array([[1.0], [-2.0], [0.5], [3.0]], np.float32) + 0.25
        poison = np.ones((16,), np.float32)
        if i in POISON:
            rows = slice(0, 8) if POISON[i] == 0 else slice(8, 16)
            poison[rows] = np.inf
        yield x, y, poison


def make_step(tx):
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

    return step


def train(params, state, step, batches):
    record = {"scale": [], "skipped": [], "loss": []}
    for x, y, poison in batches:
        params, state, loss = step(params, state, x, y, poison)
        record["scale"].append(float(state.scale))
        record["skipped"].append(bool(state.skipped))
        record["loss"].append(float(loss))
    return params, record


def single_device_run() -> dict:
    """The same training on one device with the whole batch: the reference."""
    tx = make_tx()
    params, record = train(init_params(), tx.init(init_params()), make_step(tx), global_batches())
    record["w"] = np.asarray(params["w"]).ravel().tolist()
    return record


def main(process_id: int, port: int, out_path: str) -> None:
    jax.distributed.initialize(f"localhost:{port}", num_processes=2, process_id=process_id)
    mesh = Mesh(np.array(jax.devices()), ("data",))
    replicated = NamedSharding(mesh, P())

    tx = make_tx()
    params = jax.device_put(init_params(), replicated)
    state = jax.device_put(tx.init(params), replicated)
    local = slice(8 * process_id, 8 * process_id + 8)
    batches = (
        [multihost_utils.host_local_array_to_global_array(a[local], mesh, P("data")) for a in batch]
        for batch in global_batches()
    )
    params, record = train(params, state, make_step(tx), batches)
    record["w"] = np.asarray(multihost_utils.process_allgather(params["w"], tiled=True)).ravel().tolist()
    with open(out_path, "w") as f:
        json.dump(record, f)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
