"""The program an H100 runs, compiled here without a GPU.

XLA:GPU compiles for a target config (``benchmarks/gpu_targets/``) with the
CUDA plugin of jax's version and no GPU (``benchmarks/_harness/gpu.py``).
These tests read what it made: how many kernels each update and step runs
(``_harness/hlo.py``, deterministic for one jax version), the operand dtypes
of its GEMMs, that no host callback runs in a step, that the roundings of
``ls.low_precision`` survived the compiler. Every path that a user trains
with compiles.

They need the plugin and ``JAX_PLATFORMS=cpu,cuda`` (with
``JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1``) set before jax is imported, as
``.ci/run`` does::

    pip install "jax-cuda12-plugin==$V" "jax-cuda12-pjrt==$V"   # V: jax's version
    JAX_PLATFORMS=cpu,cuda JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 python -m pytest tests/test_gpu_program.py

Without them every test skips and says why.
"""

import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import loss_scale as ls
from tests._scripts import ROOT, load_script

sys.path.insert(0, str(ROOT / "benchmarks"))
from _harness import gpu, hlo, models  # noqa: E402

REASON = gpu.unavailable()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"no deviceless GPU compilation: {REASON}")
if REASON is None:
    # An executable compiled for a GPU cannot be read back from the
    # persistent cache by a process without one.
    jax.config.update("jax_enable_compilation_cache", False)
TARGET = "h100"
MIB = 1 << 20


@pytest.fixture(scope="module")
def hlo_kernels():
    return load_script(ROOT / "benchmarks" / "hlo_kernels.py", "hlo_kernels_script")


def compiled_text(fn, *args, donate=(), target=TARGET) -> str:
    return gpu.compile_for(target, fn, args, donate).as_text()


def kernels_of(fn, *args, donate=(), target=TARGET) -> hlo.Kernels:
    return hlo.kernels(compiled_text(fn, *args, donate=donate, target=target))


# ---------------------------------------------------------------------------
# The kernel budget
# ---------------------------------------------------------------------------

UNSCALED = ("ls-no-op", "ls-bf16")
PEERS = ("apply-if-finite", "jmp", "flax")
SCALERS = ("ls", "ls-fused", "ls-static", "ls-nnx", "ls-trainstate")


def model_bytes(name, size) -> int:
    """The bytes of model ``name``'s float32 params at ``size``."""
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(models.build_abstract(name, "f32", size).params))


def budget_rows(hlo_kernels, name, precision, size, kinds, variants):
    rows = hlo_kernels.measure(name, precision, size, ["bare", *variants], kinds, 1.0, target=TARGET)
    return {(r["variant"], r["kind"]): r for r in rows}


@pytest.mark.parametrize(
    "name,size,precision",
    [
        *((name, size, precision) for name, size in (("tree", "quick"), ("mlp", "quick"), ("mlp", "default"))
          for precision in ("f32", "mixed")),
        ("tree", "default", "mixed"),
        ("tree", "gpu", "f32"),  # the update alone: 160 leaves' step takes minutes to compile here
    ],
)  # fmt: skip
def test_no_op_and_bfloat16_add_no_kernel_and_no_byte(hlo_kernels, name, size, precision):
    """No kernel more than bare Adam's, and no byte more at the scale of the
    params (+0.00 P): the scale that each kernel reads to divide by it (1
    unless a scaled run's state was restored), counted as the whole packed
    array it is a word of (13 words), and, in a whole step, the few KiB by
    which XLA may fuse the forward pass differently (jax 0.12.1: 8 KiB more
    written in a 21 MiB step)."""
    from _harness import peers

    kinds = ["update"] if size == "gpu" else ["update", "step"]
    rows = budget_rows(hlo_kernels, name, precision, size, kinds, UNSCALED)
    params_bytes = model_bytes(name, size)
    for kind in kinds:
        bare = rows[peers.BARE, kind]
        packed = jax.eval_shape(ls.no_op(optax.adam(1e-3)).init, {}).packed.data
        packed_bytes = packed.size * packed.dtype.itemsize
        tolerance = max(bare["kernels"] * packed_bytes / MIB, 1e-3 * params_bytes / MIB)
        for label in (peers.LS_NO_OP, peers.LS_BF16):
            row = rows[label, kind]
            # Fewer is no cost: XLA may give leaves of one shape one kernel
            # when they read the same scale.
            assert row["kernels"] <= bare["kernels"], f"{label} {kind}: {row['kernels']} against {bare['kernels']}"
            for moved in ("read_mib", "written_mib"):  # less is no cost (jax 0.12.1's 160-leaf step reads less)
                assert row[moved] - bare[moved] <= tolerance, (label, kind, moved, row[moved], bare[moved])


def update_kernels(tx, params) -> int:
    """Kernels of ``tx``'s update of ``params`` (arrays or shapes) with
    ``optax.apply_updates``, params and state donated."""

    def update(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    return kernels_of(update, params, jax.eval_shape(tx.init, params), params, donate=(0, 1)).count


def test_no_op_measures_again_when_a_statistic_is_asked_for():
    params = {"w": jnp.zeros((512, 512)), "b": jnp.zeros((512,))}

    def step(tx):
        return update_kernels(tx, params)

    bare, no_op = step(optax.adam(1e-3)), step(ls.no_op(optax.adam(1e-3)))
    assert no_op <= bare
    assert step(ls.no_op(optax.adam(1e-3), skip_nonfinite=True)) > bare
    assert step(ls.for_dtype(optax.adam(1e-3), jnp.bfloat16, track_grad_norm=True)) > bare


@pytest.mark.parametrize("size", ["quick", "default"])  # the tree's 4 and 40 leaves
def test_the_other_paths_stay_within_the_budget(size):
    """ls.no_op and ls.for_dtype(bfloat16) with skip_nonfinite=True add no
    more kernels than optax.apply_if_finite, which does what they do (skip a
    non-finite step, scale 1); ls.predictive's update without a measured
    peak (the steps between measurements) adds no more than ls.dynamic's."""
    params = models.build_abstract("tree", "f32", size).params
    adam = lambda: optax.adam(1e-3)  # noqa: E731 - a fresh optimizer per transformation
    bare = update_kernels(adam(), params)
    apply_if_finite = update_kernels(optax.apply_if_finite(adam(), 5), params) - bare
    for tx in (ls.no_op(adam(), skip_nonfinite=True), ls.for_dtype(adam(), jnp.bfloat16, skip_nonfinite=True)):
        assert update_kernels(tx, params) - bare <= apply_if_finite
    dynamic = update_kernels(ls.dynamic(adam()), params) - bare
    assert update_kernels(ls.predictive(adam()), params) - bare <= dynamic


@pytest.mark.parametrize(
    "name,size,against",
    [("tree", "default", PEERS), ("tree", "gpu", ("apply-if-finite",)), ("transformer", "gpu", ("apply-if-finite",))],
)
def test_the_scalers_add_fewer_kernels_than_the_peers_on_many_leaves(hlo_kernels, name, size, against):
    """At 40 leaves against every peer; at 160, and on the 2-layer
    transformer (``--size gpu``), against optax.apply_if_finite, the leanest
    of them there (jax 0.10.2, 160 leaves: +244 kernels, jmp +246, flax
    +247; compiling all three takes minutes on a 2-core CPU)."""
    from _harness import peers

    rows = budget_rows(hlo_kernels, name, "f32", size, ["update"], ("ls", *against))
    labels = {"apply-if-finite": peers.APPLY_IF_FINITE, "jmp": peers.JMP, "flax": peers.FLAX}
    fewest = min(rows[labels[key], "update"]["extra_kernels"] for key in against)
    for label in (peers.LS,):
        assert rows[label, "update"]["extra_kernels"] <= fewest, (label, rows[label, "update"]["extra_kernels"], fewest)


@pytest.mark.parametrize("name,size", [("tree", "quick"), ("mlp", "quick"), ("mlp", "default")])
@pytest.mark.parametrize("precision", ["f32", "mixed"])
def test_the_scalers_update_reads_the_gradients_once_more_than_bare_adam(hlo_kernels, name, size, precision):
    from _harness import peers

    rows = budget_rows(hlo_kernels, name, precision, size, ["update"], ("ls", "ls-fused", "ls-static"))
    params_bytes = model_bytes(name, size)
    for label in (peers.LS, peers.LS_FUSED, peers.LS_STATIC):
        extra = rows[label, "update"]["extra_mib"] / (params_bytes / MIB)
        assert extra == pytest.approx(1.0, abs=0.02), (label, extra)


@pytest.mark.parametrize(
    "name,size,precision",
    [
        *((name, size, precision) for name, size in (("tree", "quick"), ("mlp", "quick"), ("mlp", "default"))
          for precision in ("f32", "mixed")),
    ],
)  # fmt: skip
def test_the_scalers_add_no_more_kernels_than_the_leanest_peer(hlo_kernels, name, size, precision):
    """ls.dynamic through optax, ls.apply_gradients, the flax TrainState,
    the NNX Optimizer, Equinox (``loss_scale.equinox``, against Adam on the
    same ``eqx.Module``; the MLP has an Equinox version) and ls.static: no
    more kernels than the fewest of optax.apply_if_finite, jmp and flax add,
    in the update and in the whole step. The state's values are one buffer
    (``loss_scale/_packed.py``), updated by one kernel."""
    from _harness import peers

    scalers = [peers.LS, peers.LS_FUSED, peers.LS_STATIC, peers.LS_NNX, peers.LS_TRAIN_STATE]
    equinox = ("eqx-ls",) if name == "mlp" else ()
    rows = budget_rows(hlo_kernels, name, precision, size, ["update", "step"], (*SCALERS, *PEERS, *equinox))
    if equinox:
        scalers.append(peers.EQX_LS)
    for kind in ("update", "step"):
        fewest = min(rows[label, kind]["extra_kernels"] for label in (peers.APPLY_IF_FINITE, peers.JMP, peers.FLAX))
        for label in scalers:
            assert rows[label, kind]["baseline"] == (peers.EQX_BARE if label == peers.EQX_LS else peers.BARE)
            assert rows[label, kind]["extra_kernels"] <= fewest, (label, kind, rows[label, kind]["extra_kernels"])


def test_the_budget_counts_a_kernel_more():
    """The counting sees one scalar field more: a state with an extra
    counter, updated apart, costs a kernel."""
    params = {"w": jnp.zeros((256, 256))}

    def with_counter(update):
        def counted(params, state, counter, grads):
            params, state = update(params, state, grads)
            return params, state, counter + jnp.all(jnp.isfinite(grads["w"])).astype(jnp.int32)

        return counted

    tx = optax.adam(1e-3)

    def update(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    state = jax.eval_shape(tx.init, params)
    bare = kernels_of(update, params, state, params, donate=(0, 1)).count
    counted = kernels_of(with_counter(update), params, state, jnp.zeros((), jnp.int32), params, donate=(0, 1, 2))
    assert counted.count > bare


# ---------------------------------------------------------------------------
# Every public path compiles, with no host callback in a step
# ---------------------------------------------------------------------------

CALLBACK = re.compile(r"custom_call_target=\"[^\"]*(callback|host)[^\"]*\"", re.IGNORECASE)


def assert_no_callback(text: str) -> None:
    found = CALLBACK.findall(text)
    assert not found, f"the step calls the host: {found}"


PARAMS = {"w1": jnp.zeros((64, 128)), "b1": jnp.zeros((128,)), "w2": jnp.zeros((128, 10)), "b2": jnp.zeros((10,))}
BATCH = (jnp.zeros((32, 64)), jnp.zeros((32,), jnp.int32))


def mlp_loss(params, x, y, dtype=jnp.float16):
    h = jax.nn.relu(x.astype(dtype) @ params["w1"].astype(dtype) + params["b1"].astype(dtype)[None])
    logits = (h @ params["w2"].astype(dtype) + params["b2"].astype(dtype)[None]).astype(jnp.float32)
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], axis=1))


def f32_loss(params, x, y):
    return mlp_loss(params, x, y, jnp.float32)


TRANSFORMATIONS = {
    "dynamic": lambda: ls.dynamic(optax.adam(1e-3)),
    "dynamic_all_options": lambda: ls.dynamic(
        optax.adam(1e-3), max_grad_norm=1.0, track_underflow=True, locate_overflows=True
    ),
    "static": lambda: ls.static(optax.adam(1e-3), scale=1024.0),
    "no_op": lambda: ls.no_op(optax.adam(1e-3)),
    "no_op_skipping": lambda: ls.no_op(optax.adam(1e-3), skip_nonfinite=True),
    "for_dtype_bf16": lambda: ls.for_dtype(optax.adam(1e-3), jnp.bfloat16),
    "predictive": lambda: ls.predictive(optax.adam(1e-3)),
    "torch_preset": lambda: ls.presets.torch(optax.adam(1e-3)),
    "deepspeed_preset": lambda: ls.presets.deepspeed(optax.adam(1e-3)),
    "multisteps": lambda: ls.dynamic(optax.MultiSteps(optax.adam(1e-3), 2)),
}


@pytest.mark.parametrize("name", sorted(TRANSFORMATIONS))
@pytest.mark.parametrize("fused", [False, True])
def test_every_rule_compiles_for_the_gpu_with_no_host_callback(name, fused):
    tx = TRANSFORMATIONS[name]()

    def step(params, state, x, y):
        loss, grads = ls.value_and_grad(mlp_loss)(state, params, x, y)
        if fused:
            params, state = ls.apply_gradients(tx, grads, state, params, value=loss)
        else:
            updates, state = tx.update(grads, state, params, value=loss)
            params = optax.apply_updates(params, updates)
        return params, state, loss

    state = jax.eval_shape(tx.init, PARAMS)
    assert_no_callback(compiled_text(step, PARAMS, state, *BATCH, donate=(0, 1)))


def assert_measured_step_compiles(tx, loss_fn, params):
    """A step that measures its backward peak (``value_grad_and_peak``)
    and gives it to the predictive update."""

    def step(params, state, x, y):
        loss, grads, peak = ls.value_grad_and_peak(loss_fn)(state, params, x, y)
        updates, state = tx.update(grads, state, params, backward_peak=peak)
        return optax.apply_updates(params, updates), state, loss

    state = jax.eval_shape(tx.init, params)
    assert_no_callback(compiled_text(step, params, state, *BATCH, donate=(0, 1)))


def test_range_reports_measurement_compiles_for_the_gpu(monkeypatch):
    """range_report's measurement (the backward pass at a scale, with the
    statistics of every cotangent) is the function it jits; compiled for
    the H100 from the same arguments, it has no host callback."""
    from loss_scale import _range_report

    compiled = []

    class Compiled(Exception):
        pass

    def compile_for_the_gpu(backward):
        def run(leaves, scale):
            compiled.append(gpu.compile_for(TARGET, backward, (leaves, scale)).as_text())
            raise Compiled

        return run

    monkeypatch.setattr(_range_report, "_compile_measurement", compile_for_the_gpu)
    x, y = BATCH
    with pytest.raises(Compiled):
        ls.range_report(f32_loss, PARAMS, x, y, compute_dtype=jnp.float16)
    (text,) = compiled
    assert "ENTRY" in text and "f16" in text
    assert_no_callback(text)


def test_value_grad_and_peak_and_the_predictive_update_compile():
    assert_measured_step_compiles(ls.predictive(optax.adam(1e-3)), mlp_loss, PARAMS)


def test_segments_compile():
    def loss_fn(params, x, y):
        h = jax.nn.relu(x.astype(jnp.float16) @ params["w1"].astype(jnp.float16))
        h = ls.segment(h, "hidden")
        logits = (h @ params["w2"].astype(jnp.float16)).astype(jnp.float32)
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], axis=1))

    params = {"w1": PARAMS["w1"], "w2": PARAMS["w2"]}
    assert_measured_step_compiles(ls.predictive(optax.adam(1e-3), segments=("hidden",)), loss_fn, params)


@pytest.mark.parametrize("rounding", ["nearest", "kahan", "stochastic"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_low_precision_roundings_survive_in_the_gpu_program(rounding, dtype):
    """A rounding written as a cast round trip would be deleted by XLA:GPU;
    the library's are ``reduce-precision`` (nearest, Kahan) and integer bit
    operations (stochastic), which the compiled program must still hold."""
    dtype = jnp.dtype(dtype)
    params = jax.tree.map(lambda x: x.astype(dtype), PARAMS)
    tx = ls.low_precision(optax.adamw(1e-3), rounding, state_dtype=dtype)
    if dtype == jnp.float16:
        tx = ls.dynamic(tx)

    def step(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    state = jax.eval_shape(tx.init, params)
    text = compiled_text(step, params, state, params, donate=(0, 1))
    assert_no_callback(text)
    if rounding in ("nearest", "kahan"):
        assert "reduce-precision(" in text, "the rounding to the half grid is gone from the program"
    else:
        assert "shift-right-logical(" in text and "xor(" in text, "the stochastic rounding's bits are gone"


def transformer_f32():
    return models.build_abstract("transformer", "f32", "quick")


def test_autocast_keeps_the_attention_probabilities_in_half_precision():
    """The temporary memory of a Llama-style decoder's gradient at sequence
    2048 (benchmarks/autocast_memory.py): autocast's within 1.35x the
    hand-cast float16 model's (jax 0.10.2: 1.04x, 0.12.1: 1.30x; 1.93x and
    1.71x when the backward pass kept a float32 copy of the probabilities)."""
    script = load_script(ROOT / "benchmarks" / "autocast_memory.py", "autocast_memory_script")
    versions = script.measure("llama", script.decoder_config(2048), TARGET, ("hand-cast", "autocast"))["versions"]
    ratio = versions["autocast"]["temp_mib"] / versions["hand-cast"]["temp_mib"]
    assert ratio <= 1.35, versions


def test_the_autocast_memory_benchmark_runs(capsys):
    script = load_script(ROOT / "benchmarks" / "autocast_memory.py", "autocast_memory_script")
    results = script.main(["--quick"])["results"]
    assert [(r["style"], r["seq"]) for r in results] == [("llama", 128)]
    assert "| llama | 128 |" in capsys.readouterr().out


@pytest.mark.parametrize("builder", ["mlp", "transformer"])
def test_autocast_products_are_float16_gemms(builder):
    if builder == "mlp":
        loss_fn, params, batch = f32_loss, PARAMS, BATCH
    else:
        model = transformer_f32()
        loss_fn, params, batch = model.loss_fn, model.params, (model.batch,)
    tx = ls.dynamic(optax.adam(1e-3))

    def step(params, state, *batch):
        loss, grads = ls.value_and_grad(ls.autocast(loss_fn, dtype=jnp.float16))(state, params, *batch)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    state = jax.eval_shape(tx.init, params)
    text = compiled_text(step, params, state, *batch, donate=(0, 1))
    assert_no_callback(text)
    products = gemm_operand_dtypes(text)
    assert products, "no product found in the program"
    wide = [p for p in products if set(p) != {"f16"}]
    assert not wide, f"products not in float16: {wide} of {len(products)}"


DEFINITION = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+) = \(?(\w+)\[")
PRODUCT = re.compile(r" (dot|convolution|custom-call)\(([^)]*)\)(.*)$")


def gemm_operand_dtypes(text: str) -> list[tuple[str, ...]]:
    """The operand dtypes of each product the program runs: every ``dot``
    and ``convolution``, inside a GEMM fusion (Triton) or alone, read where
    the product reads them (after the casts fused into the GEMM), and every
    cuBLAS call."""
    found, dtypes = [], {}
    for line in text.splitlines():
        if line.rstrip().endswith("{") and "->" in line:
            dtypes = {}  # a new computation: its own names
            continue
        definition = DEFINITION.match(line)
        if definition is None:
            continue
        dtypes[definition.group(1)] = definition.group(2)
        product = PRODUCT.search(line)
        if product is None:
            continue
        if product.group(1) == "custom-call" and "__cublas$" not in product.group(3):
            continue
        operands = re.findall(r"%([\w.\-]+)", product.group(2))
        found.append(tuple(dtypes.get(name, "?") for name in operands))
    return found


def test_the_gemm_reader_sees_a_float32_product():
    def f(a, b):
        return a @ b

    text = compiled_text(f, jnp.zeros((256, 256)), jnp.zeros((256, 256)))
    products = gemm_operand_dtypes(text)
    assert products and all("f32" in p for p in products), products
    text = compiled_text(f, jnp.zeros((256, 256), jnp.float16), jnp.zeros((256, 256), jnp.float16))
    assert {p for p in gemm_operand_dtypes(text)} == {("f16", "f16")}


def test_the_flax_and_equinox_helpers_compile():
    import equinox as eqx
    from flax import nnx

    import loss_scale.equinox as lsq
    import loss_scale.flax as lsf

    model = eqx.nn.MLP(64, 10, 128, 2, key=jax.random.key(0))
    tx = ls.dynamic(optax.adam(1e-3))

    def eqx_loss(model, x, y):
        logits = jax.vmap(model)(x)
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], axis=1))

    def eqx_step(model, state, x, y):
        loss, grads = lsq.filter_value_and_grad(eqx_loss)(state, model, x, y)
        model, state = lsq.apply_gradients(tx, grads, state, model)
        return model, state, loss

    arrays, static = eqx.partition(model, eqx.is_array)
    state = jax.eval_shape(tx.init, eqx.filter(arrays, eqx.is_inexact_array))

    def eqx_arrays_step(arrays, state, x, y):
        model, state, loss = eqx_step(eqx.combine(arrays, static), state, x, y)
        return eqx.filter(model, eqx.is_array), state, loss

    assert_no_callback(compiled_text(eqx_arrays_step, arrays, state, *BATCH))

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.a = nnx.Linear(64, 128, rngs=rngs)
            self.b = nnx.Linear(128, 10, rngs=rngs)

        def __call__(self, x):
            return self.b(jax.nn.relu(self.a(x)))

    net = Net(nnx.Rngs(0))
    optimizer = lsf.Optimizer(net, ls.dynamic(optax.adam(1e-3)), wrt=nnx.Param)
    graphdef, nnx_state = nnx.split((net, optimizer))

    def nnx_loss(net, x, y):
        logits = net(x)
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], axis=1))

    def nnx_step(nnx_state, x, y):
        net, optimizer = nnx.merge(graphdef, nnx_state)
        loss, grads = lsf.nnx_value_and_grad(nnx_loss)(optimizer, net, x, y)
        optimizer.update(net, grads)
        return nnx.state((net, optimizer)), loss

    assert_no_callback(compiled_text(nnx_step, nnx_state, *BATCH, donate=(0,)))

    train_state = lsf.TrainState.create(apply_fn=None, params=PARAMS, tx=ls.dynamic(optax.adam(1e-3)))

    def linen_step(train_state, x, y):
        loss, grads = ls.value_and_grad(mlp_loss)(train_state.opt_state, train_state.params, x, y)
        return train_state.apply_gradients(grads=grads), loss

    assert_no_callback(compiled_text(linen_step, train_state, *BATCH, donate=(0,)))


def test_a_four_gpu_shard_map_step_compiles():
    from jax.sharding import NamedSharding, PartitionSpec

    mesh = gpu.mesh(TARGET, 4)
    tx = ls.dynamic(optax.adam(1e-3), axis_name="d")

    def local_step(params, state, x, y):
        loss, grads = ls.value_and_grad(mlp_loss)(state, params, x, y)
        grads = jax.lax.pmean(grads, "d")
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, jax.lax.pmean(loss, "d")

    state = jax.eval_shape(tx.init, PARAMS)
    replicated, batched = PartitionSpec(), PartitionSpec("d")
    step = jax.shard_map(
        local_step,
        mesh=mesh,
        in_specs=(replicated, replicated, batched, batched),
        out_specs=(replicated, replicated, replicated),
        check_vma=False,
    )

    def spec(x, p):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, p))

    args = (
        jax.tree.map(lambda x: spec(x, replicated), PARAMS),
        jax.tree.map(lambda x: spec(x, replicated), state),
        spec(jnp.zeros((128, 64)), batched),
        spec(jnp.zeros((128,), jnp.int32), batched),
    )
    text = jax.jit(step).lower(*args).compile().as_text()
    assert_no_callback(text)
    assert "all-reduce" in text


@pytest.mark.parametrize("target", gpu.TARGETS)
def test_every_target_config_compiles_a_step(target):
    tx = ls.dynamic(optax.adam(1e-3))

    def step(params, state, x, y):
        loss, grads = ls.value_and_grad(mlp_loss)(state, params, x, y)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    state = jax.eval_shape(tx.init, PARAMS)
    compiled = gpu.compile_for(target, step, (PARAMS, state, *BATCH), donate_argnums=(0, 1))
    assert hlo.kernels(compiled.as_text()).count > 0
    assert compiled.memory_analysis().temp_size_in_bytes >= 0
    assert gpu.device_kind(target) == gpu.target_config(target).split('device_description_str: "')[1].split('"')[0]


def test_the_large_transformer_compiles_from_shapes_alone_within_the_budget(hlo_kernels):
    """218M parameters (125 leaves): never allocated, only their shapes
    travel. ls.dynamic's update and mixed step add fewer kernels than
    optax.apply_if_finite's (jax 0.10.2: +62 and +61 against +180), the
    update reads the gradients once more than bare Adam, and the step moves
    no more bytes than apply_if_finite's."""
    from _harness import peers

    model = models.build_abstract("transformer", "mixed", "large")
    assert sum(np.prod(x.shape) for x in jax.tree.leaves(model.params)) > 2e8
    rows = budget_rows(hlo_kernels, "transformer", "mixed", "large", ["update", "step"], ("ls", "apply-if-finite"))
    params_mib = model_bytes("transformer", "large") / MIB
    for kind in ("update", "step"):
        ours, theirs = rows[peers.LS, kind], rows[peers.APPLY_IF_FINITE, kind]
        assert ours["extra_kernels"] < theirs["extra_kernels"], (kind, ours["extra_kernels"], theirs["extra_kernels"])
        assert ours["extra_mib"] / params_mib <= theirs["extra_mib"] / params_mib + 0.02, kind
    assert rows[peers.LS, "update"]["extra_mib"] / params_mib == pytest.approx(1.0, abs=0.02)


def test_the_gpu_sized_mlp_is_within_the_budget(hlo_kernels):
    """The 243M-parameter MLP (``--size gpu``, the one timed on the H200),
    update and mixed step: ls.dynamic adds no more kernels than
    optax.apply_if_finite, and the update reads the gradients once more
    than bare Adam."""
    from _harness import peers

    rows = budget_rows(hlo_kernels, "mlp", "mixed", "gpu", ["update", "step"], ("ls", "apply-if-finite"))
    for kind in ("update", "step"):
        ours, theirs = rows[peers.LS, kind]["extra_kernels"], rows[peers.APPLY_IF_FINITE, kind]["extra_kernels"]
        assert ours <= theirs, (kind, ours, theirs)
    extra = rows[peers.LS, "update"]["extra_mib"] / (model_bytes("mlp", "gpu") / MIB)
    assert extra == pytest.approx(1.0, abs=0.02)
