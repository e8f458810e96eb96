"""Records the peers' loss-scale trajectories from their released sources.

The fixture ``peer_trajectories.json`` holds, for Keras 3, DeepSpeed,
megatron-core and Cerebras, scale trajectories produced by the peers' own
code, and their defaults read from their own sources, so that
tests/test_presets.py can compare ``loss_scale.presets`` (and the
transcriptions in tests/peer_rules.py) with the real thing without
installing them. Get the sources with pip (no install needed except Keras)::

    pip download --no-deps keras==3.15.1 tf-keras==2.21.0 megatron-core==0.16.1 \\
        cerebras_pytorch==2.10.0
    pip download --no-deps --no-binary :all: deepspeed==0.19.8
    pip install --no-deps --target /tmp/kerasenv keras-3.15.1-*.whl namex optree h5py
    # unpack the wheels / sdist into SRC, then (torch and jax installed):
    KERAS_BACKEND=jax PYTHONPATH=/tmp/kerasenv python tests/data/record_peer_trajectories.py SRC

``SRC`` must contain ``deepspeed-0.19.8/deepspeed/runtime/...``,
``megatron/core/optimizer/...``, ``cerebras/pytorch/amp/grad_scaler.py`` and
``tf_keras/src/mixed_precision/loss_scale_optimizer.py``.

How each peer runs:

* Keras 3.15.1: the real ``LossScaleOptimizer`` around ``SGD`` on the JAX
  backend, through ``stateless_apply`` (the JAX training path), with an
  inf/nan injected into the (scaled) gradients on overflow steps. The skip
  flag is whether the variable stayed put.
* DeepSpeed 0.19.8: ``deepspeed/runtime/fp16/loss_scaler.py`` executed as is,
  with stand-ins for the logging/communication helpers it imports
  (``deepspeed.comm.get_rank`` returns 0), built with ``CreateLossScaler``
  from the ``dynamic_loss_scale_args`` of the ``fp16`` config and driven by
  ``update_scale(overflow)``; where it raises, the trajectory ends and the
  step is recorded.
* megatron-core 0.16.1: ``megatron/core/optimizer/grad_scaler.py`` executed
  with ``device='cuda'`` replaced by ``'cpu'``, built as
  ``get_megatron_optimizer`` builds it, driven by ``update(found_inf)``.
* cerebras_pytorch 2.10.0: ``cerebras/pytorch/amp/grad_scaler.py`` executed
  with stand-ins for the Cerebras backend modules it imports (no
  optimizers registered), constructed with ``loss_scale="dynamic"``; each
  step sets the squared gradient norm (inf on overflow steps), takes
  ``isfinite`` from ``clip_gradients_and_return_isfinite`` and calls
  ``update_scale``.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.util
import inspect
import json
import logging
import pathlib
import random
import sys
import types

import numpy as np
import torch

LENGTH = 80
PER_CONFIG = 6


def overflow_sequences(rng: random.Random, count: int) -> list[list[bool]]:
    out = []
    for _ in range(count):
        rate = rng.choice([0.0, 0.05, 0.15, 0.3, 0.6, 0.9])
        out.append([rng.random() < rate for _ in range(LENGTH)])
    return out


def sha256(path: pathlib.Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def load_module(name: str, path: pathlib.Path, source: str | None = None, package: str | None = None):
    spec = importlib.util.spec_from_loader(name, loader=None)
    module = importlib.util.module_from_spec(spec)
    module.__file__ = str(path)
    if package:
        module.__package__ = package
    sys.modules[name] = module
    exec(compile(source if source is not None else path.read_text(), str(path), "exec"), module.__dict__)
    return module


def stub(name: str, **attrs) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__dict__.update(attrs)
    module.__path__ = []
    sys.modules[name] = module
    return module


def class_field_defaults(path: pathlib.Path, class_name: str, fields: list[str]) -> dict:
    """Defaults of annotated class attributes, read from the source."""
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == class_name:
            found = {}
            for item in node.body:
                named = isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)
                if named and item.target.id in fields:
                    found[item.target.id] = eval(compile(ast.Expression(item.value), str(path), "eval"))
            return found
    raise LookupError(class_name)


# --- Keras 3 ----------------------------------------------------------------


def record_keras(rng: random.Random) -> dict:
    import jax
    import jax.numpy as jnp
    import keras

    assert keras.backend.backend() == "jax", "run with KERAS_BACKEND=jax"
    lso = keras.optimizers.LossScaleOptimizer
    signature = inspect.signature(lso.__init__)
    defaults = {k: signature.parameters[k].default for k in ("initial_scale", "dynamic_growth_steps")}
    configs = [
        {"initial_scale": 2.0**15, "dynamic_growth_steps": 1},
        {"initial_scale": 2.0**15, "dynamic_growth_steps": 3},
        {"initial_scale": 4.0, "dynamic_growth_steps": 2},
        {"initial_scale": 0.125, "dynamic_growth_steps": 5},
        {"initial_scale": 2.0**120, "dynamic_growth_steps": 1},  # reaches inf in Keras
        {"initial_scale": 2.0**-120, "dynamic_growth_steps": 7},  # can reach 0 in Keras
    ]
    trajectories = []
    for config in configs:
        opt = lso(keras.optimizers.SGD(learning_rate=1.0), **config)
        var = keras.Variable(np.zeros(2, np.float32))
        opt.build([var])
        index = next(i for i, v in enumerate(opt.variables) if v is opt.dynamic_scale)
        apply = jax.jit(opt.stateless_apply)
        for overflows in overflow_sequences(rng, PER_CONFIG):
            opt_vars = [jnp.asarray(v.value) for v in opt.variables]
            trainable = [jnp.zeros(2, jnp.float32)]
            scales, skipped = [], []
            for i, overflow in enumerate(overflows):
                bad = [np.inf, -np.inf, np.nan][i % 3]
                grads = [jnp.array([bad if overflow else 1.0, 1.0], jnp.float32) * opt_vars[index]]
                new_trainable, opt_vars = apply(opt_vars, grads, trainable)
                skipped.append(bool(jnp.all(new_trainable[0] == trainable[0])))
                trainable = new_trainable
                scales.append(float(opt_vars[index]))
            trajectories.append({"config": config, "overflows": overflows, "scales": scales, "skipped": skipped})
    return {
        "version": keras.__version__,
        "source": "keras/src/optimizers/loss_scale_optimizer.py",
        "sha256": sha256(pathlib.Path(inspect.getsourcefile(lso))),
        "defaults": defaults,
        "trajectories": trajectories,
    }


# --- DeepSpeed ----------------------------------------------------------------


def record_deepspeed(src: pathlib.Path, rng: random.Random) -> dict:
    root = src / "deepspeed-0.19.8" / "deepspeed" / "runtime"
    path = root / "fp16" / "loss_scaler.py"

    class DeepSpeedConfigObject:
        pass

    stub("deepspeed", __version__="0.19.8")
    stub("deepspeed.comm", get_rank=lambda: 0)
    stub("deepspeed.utils", logger=logging.getLogger("deepspeed"), log_dist=lambda *args, **kwargs: None)
    stub("deepspeed.runtime")
    stub("deepspeed.runtime.config_utils", DeepSpeedConfigObject=DeepSpeedConfigObject)
    stub("deepspeed.runtime.utils", has_inf_or_nan=lambda x: bool(~torch.isfinite(x).all()))
    sys.modules["deepspeed"].comm = sys.modules["deepspeed.comm"]
    module = load_module("deepspeed_loss_scaler", path)

    defaults = class_field_defaults(
        root / "precision_config.py",
        "DeepSpeedFP16Config",
        [
            "loss_scale",
            "initial_scale_power",
            "loss_scale_window",
            "hysteresis",
            "consecutive_hysteresis",
            "min_loss_scale",
        ],
    )
    configs = [
        {"initial_scale_power": 16, "loss_scale_window": 1, "hysteresis": 2, "consecutive_hysteresis": False},
        {"initial_scale_power": 10, "loss_scale_window": 2, "hysteresis": 1, "consecutive_hysteresis": False},
        {"initial_scale_power": 10, "loss_scale_window": 3, "hysteresis": 2, "consecutive_hysteresis": False},
        {"initial_scale_power": 10, "loss_scale_window": 3, "hysteresis": 2, "consecutive_hysteresis": True},
        {"initial_scale_power": 12, "loss_scale_window": 5, "hysteresis": 3, "consecutive_hysteresis": False},
        {"initial_scale_power": 12, "loss_scale_window": 2, "hysteresis": 3, "consecutive_hysteresis": True},
        {"initial_scale_power": 4, "loss_scale_window": 4, "hysteresis": 2, "consecutive_hysteresis": False},
        {"initial_scale_power": 3, "loss_scale_window": 2, "hysteresis": 1, "consecutive_hysteresis": True},
    ]
    minimums = [1, 4, 1, 4, 1, 4, 4, 1]
    trajectories = []
    for config, min_loss_scale in zip(configs, minimums, strict=True):
        config = {**config, "min_loss_scale": min_loss_scale}
        for overflows in overflow_sequences(rng, PER_CONFIG):
            # DeepSpeedFP16Config.dynamic_loss_scale_args(), as in precision_config.py.
            args = {
                module.INITIAL_LOSS_SCALE: 2 ** config["initial_scale_power"],
                module.SCALE_WINDOW: config["loss_scale_window"],
                module.DELAYED_SHIFT: config["hysteresis"],
                module.CONSECUTIVE_HYSTERESIS: config["consecutive_hysteresis"],
                module.MIN_LOSS_SCALE: config["min_loss_scale"],
            }
            scaler = module.CreateLossScaler(torch.float16, 0, True, args)
            assert type(scaler).__name__ == "DynamicLossScaler"
            scales, raised_at = [], None
            for i, overflow in enumerate(overflows):
                try:
                    scaler.update_scale(overflow)
                except Exception as error:  # DeepSpeed raises a bare Exception
                    assert "already at minimum" in str(error)
                    raised_at = i
                    break
                scales.append(float(scaler.cur_scale))
            trajectories.append(
                {
                    "config": config,
                    "overflows": overflows[: len(scales)],
                    "scales": scales,
                    "skipped": overflows[: len(scales)],  # the ZeRO step skips on overflow
                    "raised_at": raised_at,
                }
            )
    return {
        "version": "0.19.8",
        "source": "deepspeed/runtime/fp16/loss_scaler.py",
        "sha256": sha256(path),
        "defaults": defaults,
        "trajectories": trajectories,
    }


# --- Megatron-LM ------------------------------------------------------------


def record_megatron(src: pathlib.Path, rng: random.Random) -> dict:
    root = src / "megatron" / "core" / "optimizer"
    path = root / "grad_scaler.py"
    source = path.read_text()
    assert source.count("device='cuda'") == 4
    module = load_module("megatron_grad_scaler", path, source.replace("device='cuda'", "device='cpu'"))
    defaults = class_field_defaults(
        root / "optimizer_config.py",
        "OptimizerConfig",
        ["loss_scale", "initial_loss_scale", "min_loss_scale", "loss_scale_window", "hysteresis"],
    )
    init_source = (root / "__init__.py").read_text()
    assert "growth_factor=2.0" in init_source and "backoff_factor=0.5" in init_source
    configs = [
        {"initial_loss_scale": 2.0**32, "min_loss_scale": 1.0, "loss_scale_window": 3, "hysteresis": 2},
        {"initial_loss_scale": 2.0**10, "min_loss_scale": 2.0**8, "loss_scale_window": 2, "hysteresis": 3},
        {"initial_loss_scale": 1.0, "min_loss_scale": 1.0, "loss_scale_window": 1, "hysteresis": 1},
        {"initial_loss_scale": 2.0**16, "min_loss_scale": 0.25, "loss_scale_window": 5, "hysteresis": 2},
        {"initial_loss_scale": 2.0**125, "min_loss_scale": 1.0, "loss_scale_window": 1, "hysteresis": 2},
    ]
    trajectories = []
    for config in configs:
        for overflows in overflow_sequences(rng, PER_CONFIG):
            # get_megatron_optimizer (megatron/core/optimizer/__init__.py)
            scaler = module.DynamicGradScaler(
                initial_scale=config["initial_loss_scale"],
                min_scale=config["min_loss_scale"],
                growth_factor=2.0,
                backoff_factor=0.5,
                growth_interval=config["loss_scale_window"],
                hysteresis=config["hysteresis"],
            )
            scales = []
            for overflow in overflows:
                scaler.update(overflow)
                scales.append(float(scaler.scale.item()))
            trajectories.append({"config": config, "overflows": overflows, "scales": scales, "skipped": overflows})
    return {
        "version": "0.16.1",
        "source": "megatron/core/optimizer/grad_scaler.py",
        "sha256": sha256(path),
        "defaults": defaults,
        "trajectories": trajectories,
    }


# --- Cerebras -----------------------------------------------------------------


def record_cerebras(src: pathlib.Path, rng: random.Random) -> dict:
    path = src / "cerebras" / "pytorch" / "amp" / "grad_scaler.py"

    class Backend:
        optimizer_registry = []

        def setup_grad_scaler(self, scaler):
            pass

    class ConditionalUpdateManager:
        pass

    stub("cerebras")
    stub("cerebras.pytorch")
    amp = stub("cerebras.pytorch.amp", setup_optimizer=lambda optimizer: None)
    stub("cerebras.pytorch.backend", current_backend_impl=Backend)
    stub(
        "cerebras.pytorch.amp._amp_state",
        _amp_state=types.SimpleNamespace(half_dtype_str="float16"),
        maybe_print=lambda *args, **kwargs: None,
    )
    stub("cerebras.pytorch.amp.conditional_update", ConditionalUpdateManager=ConditionalUpdateManager)
    sys.modules["cerebras"].pytorch = sys.modules["cerebras.pytorch"]
    sys.modules["cerebras.pytorch"].amp = amp
    module = load_module("cerebras.pytorch.amp.grad_scaler", path, package="cerebras.pytorch.amp")

    default = module.GradScaler(loss_scale="dynamic")
    signature = inspect.signature(module.GradScaler.__init__)
    defaults = {
        "init_scale": float(default._loss_scale),
        "steps_per_increase": default._steps_per_increase,
        "min_loss_scale": default._min_loss_scale,
        "max_loss_scale": default._max_loss_scale,
        "overflow_tolerance": signature.parameters["overflow_tolerance"].default,
        "max_gradient_norm": signature.parameters["max_gradient_norm"].default,
    }
    configs = [
        {"initial_loss_scale": 2.0**15, "steps_per_increase": 2, "overflow_tolerance": 0.0},
        {"initial_loss_scale": 2.0**5, "steps_per_increase": 3, "overflow_tolerance": 0.0},
        {
            "initial_loss_scale": 2.0**10,
            "steps_per_increase": 2,
            "min_loss_scale": 2.0**8,
            "max_loss_scale": 2.0**12,
            "overflow_tolerance": 0.25,
        },
        {"initial_loss_scale": 8.0, "steps_per_increase": 4, "overflow_tolerance": 0.5},
        {"initial_loss_scale": 2.0**15, "steps_per_increase": 1, "max_loss_scale": 2.0**20, "overflow_tolerance": 0.1},
        {"initial_loss_scale": 2.0**-10, "steps_per_increase": 5, "overflow_tolerance": 0.3},
        {"initial_loss_scale": 2.0**20, "steps_per_increase": 3, "max_loss_scale": 2.0**24, "overflow_tolerance": 1.0},
    ]
    trajectories = []
    for config in configs:
        for overflows in overflow_sequences(rng, PER_CONFIG):
            kwargs = {k: v for k, v in config.items() if k != "initial_loss_scale"}
            scaler = module.GradScaler(loss_scale="dynamic", init_scale=config["initial_loss_scale"], **kwargs)
            scales, skipped = [], []
            for overflow in overflows:
                scaler._squared_local_norms = [torch.tensor(float("inf") if overflow else 1.0)]
                isfinite = scaler.clip_gradients_and_return_isfinite([])
                scaler.isfinite = isfinite
                scaler.update_scale([])
                scales.append(float(scaler._loss_scale.item()))
                skipped.append(not bool(isfinite))
            trajectories.append({"config": config, "overflows": overflows, "scales": scales, "skipped": skipped})
    return {
        "version": "2.10.0",
        "source": "cerebras/pytorch/amp/grad_scaler.py",
        "sha256": sha256(path),
        "defaults": defaults,
        "trajectories": trajectories,
    }


# --- tf-keras (defaults only: running it needs TensorFlow) --------------------


def record_tf_keras(src: pathlib.Path) -> dict:
    path = src / "tf_keras" / "src" / "mixed_precision" / "loss_scale_optimizer.py"
    tree = ast.parse(path.read_text())
    constants = {}
    for node in tree.body:
        named = isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name)
        if named and node.targets[0].id in ("_DEFAULT_INITIAL_SCALE", "_DEFAULT_GROWTH_STEPS"):
            constants[node.targets[0].id] = eval(compile(ast.Expression(node.value), str(path), "eval"))
    signature = None
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == "LossScaleOptimizerV3":
            init = next(item for item in node.body if isinstance(item, ast.FunctionDef) and item.name == "__init__")
            names = [a.arg for a in init.args.args][-len(init.args.defaults) :]
            signature = {n: ast.literal_eval(d) for n, d in zip(names, init.args.defaults, strict=True)}
    return {
        "version": "2.21.0",
        "source": "tf_keras/src/mixed_precision/loss_scale_optimizer.py",
        "sha256": sha256(path),
        "defaults": {**signature, **constants},
    }


def main() -> None:
    src = pathlib.Path(sys.argv[1])
    rng = random.Random(20261122)
    fixture = {
        "keras": record_keras(rng),
        "deepspeed": record_deepspeed(src, rng),
        "megatron": record_megatron(src, rng),
        "cerebras": record_cerebras(src, rng),
        "tf_keras": record_tf_keras(src),
    }
    for peer in fixture.values():
        for t in peer.get("trajectories", []):
            t["overflows"] = "".join("1" if o else "0" for o in t["overflows"])
            t["skipped"] = "".join("1" if s else "0" for s in t["skipped"])
    out = pathlib.Path(__file__).with_name("peer_trajectories.json")
    out.write_text(json.dumps(fixture, indent=None, separators=(",", ":")) + "\n")
    counts = {k: len(v.get("trajectories", [])) for k, v in fixture.items()}
    print(f"wrote {out}: {counts}")


if __name__ == "__main__":
    main()
