"""The benchmarks' shared harness: one place for what every script needs.

* ``models``: the model zoo (an MLP and a causal transformer LM in plain
  ``jax.numpy``, the same MLP as an Equinox module), in float32 or mixed
  precision;
* ``peers``: one function per training variant (bare Adam, loss_scale's
  paths, optax.apply_if_finite, jmp, flax DynamicScale, MPX), each a full
  train step and the update alone, and the checks that they compute the same
  update;
* ``timing``: compiling with the phases timed, interleaved rounds, paired
  ratios with an order-statistic confidence interval, the tuned-malloc rerun;
* ``tables``: markdown tables and writing a report to ``benchmarks/results/``;
* ``provenance``: versions, device, date and command line for the header;
* ``cli``: the scripts' argument parser style and their ``--out`` flag.

The scripts next to this package (``overhead.py``, ``compile_time.py``,
``predictive.py``, ``speedup.py``) each answer one question with it.
"""
