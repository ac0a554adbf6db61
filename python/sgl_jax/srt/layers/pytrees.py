"""The JAX-free batch descriptions (forward_batch.ForwardBatch and DecodeRows, sampling.sampling_batch.SamplingBatch)
as JAX pytrees, registered here, where JAX is: importing any layer registers them, so every model step, warm-up and
test that runs a layer can pass them into jit. The data and meta fields come from the dataclasses (a field
whose metadata says ``static`` is part of the compiled program's identity; every other field is a leaf)."""

from __future__ import annotations

import jax

from sgl_jax.srt.forward_batch import DecodeRows, ForwardBatch, array_fields, static_fields
from sgl_jax.srt.sampling.sampling_batch import SamplingBatch

for _cls in (ForwardBatch, SamplingBatch, DecodeRows):
    jax.tree_util.register_dataclass(_cls, data_fields=array_fields(_cls), meta_fields=static_fields(_cls))
