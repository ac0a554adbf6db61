"""Model building blocks (linear, attention, sampler, ...). Importing the package registers the batch
descriptions that layers read as JAX pytrees (pytrees.py)."""

from sgl_jax.srt.layers import pytrees  # noqa: F401
