"""The peers' loss-scale update rules, one module per peer: plain-Python
transcriptions used as differential oracles.

One function per peer of ``loss_scale.presets``, written after the peer's own
source (file and version in each docstring), with the peer's names, defaults
and number types: float32 where the peer keeps a float32 tensor, Python float
(float64) where it keeps a Python float. Each maps a sequence of overflow
flags to the list of ``(scale after the step, step skipped)`` pairs. They are
checked against the real peers where those run here (tests/test_presets.py:
torch, jmp and flax live; Keras 3, DeepSpeed, Megatron-LM and Cerebras
through tests/data/peer_trajectories.json, recorded from their released
sources). ``torch_gradscaler_float32``, ``megatron_general`` and
``deepspeed_consecutive`` take explicit factors, in float32, for the rule
tests of tests/test_state.py.
"""

from tests.oracles.apex import apex
from tests.oracles.cerebras import cerebras
from tests.oracles.deepspeed import DeepSpeedMinScaleError, deepspeed, deepspeed_consecutive
from tests.oracles.flax import flax_dynamic_scale
from tests.oracles.jmp import jmp_dynamic_loss_scale
from tests.oracles.keras import keras3, tf_keras
from tests.oracles.megatron import megatron, megatron_general
from tests.oracles.torch import torch_gradscaler, torch_gradscaler_float32

__all__ = [
    "DeepSpeedMinScaleError",
    "apex",
    "cerebras",
    "deepspeed",
    "deepspeed_consecutive",
    "flax_dynamic_scale",
    "jmp_dynamic_loss_scale",
    "keras3",
    "megatron",
    "megatron_general",
    "tf_keras",
    "torch_gradscaler",
    "torch_gradscaler_float32",
]
