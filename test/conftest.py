"""Shared test setup: CPU JAX, single-threaded torch (the reference must not fight the engine for cores)."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

try:
    import torch

    torch.set_num_threads(1)
except ImportError:  # the runtime does not need torch; only reference tests do
    pass
