"""Shared test configuration."""

import jax

# The fixture recorder imports torch, which the tests do not need.
collect_ignore = ["data"]

jax.config.update("jax_numpy_rank_promotion", "raise")
