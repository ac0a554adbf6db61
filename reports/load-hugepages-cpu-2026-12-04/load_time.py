"""Seconds to load a model's weights onto the device (`load_model`, every array ready), one line per run.

    JAX_PLATFORMS=cpu python load_time.py {smollm2,gemma3} {none,int8}
"""
import sys
import time

import jax

from sgl_jax.srt.configs.model_config import ModelConfig
from sgl_jax.srt.model_loader.default_model import GEMMA3_270M_PACKAGE, find_packaged_gguf
from sgl_jax.srt.model_loader.loader import load_model
from sgl_jax.srt.server_args import ServerArgs

model, method = sys.argv[1], sys.argv[2]
path = find_packaged_gguf(GEMMA3_270M_PACKAGE) if model == "gemma3" else None
sa = ServerArgs(model_path=path, quantization=None if method == "none" else method, dtype="float32")
mc = ModelConfig.from_server_args(sa, "cpu")
t0 = time.perf_counter()
_, params = load_model(mc)
jax.block_until_ready(jax.tree.leaves(params))
print(f"{model} {method} load {time.perf_counter() - t0:.2f} s")
