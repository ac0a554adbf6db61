"""Build a model and fill its parameters from a GGUF file, safetensors files, or random (dummy) values.

Parameter paths of our NNX models equal HF state-dict keys (see `models/llama.py`), so loading is a
rename-free copy: each checkpoint tensor goes to the parameter with the same dotted path.
"""

from __future__ import annotations

import glob
import logging
import os
from typing import Iterator, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm import tqdm

from sgl_jax.srt.models.registry import get_model_class

logger = logging.getLogger(__name__)

JNP_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def _path_name(path) -> str:
    return ".".join(str(p) for p in path)


def _safetensors_files(model_dir: str):
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"No *.safetensors files in {model_dir}")
    return files


def _iterate_safetensors(model_dir: str) -> Iterator[Tuple[str, object]]:
    from safetensors import safe_open

    for path in _safetensors_files(model_dir):
        with safe_open(path, framework="flax") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def _count_safetensors(model_dir: str) -> int:
    from safetensors import safe_open

    n = 0
    for path in _safetensors_files(model_dir):
        with safe_open(path, framework="flax") as f:
            n += len(list(f.keys()))
    return n


def _weight_source(model_config, load_format: str):
    """(iterator of (hf_name, array), total count) for the model's checkpoint."""
    import gguf as gguf_lib

    from sgl_jax.srt.model_loader.gguf_file import iterate_gguf_tensors

    gguf = model_config.resolved.gguf_file
    fmt = load_format
    if fmt == "auto":
        fmt = "gguf" if gguf else "safetensors"
    if fmt == "gguf":
        if not gguf:
            raise ValueError("--load-format gguf needs a .gguf --model-path")
        reader = gguf_lib.GGUFReader(gguf)
        return iterate_gguf_tensors(gguf, reader), len(reader.tensors)
    if fmt == "safetensors":
        d = model_config.resolved.hf_dir
        return _iterate_safetensors(d), _count_safetensors(d)
    raise ValueError(f"--load-format {load_format!r} is not a checkpoint format")


def load_model(model_config, load_format: str = "auto", seed: int = 0):
    """Instantiate the model for ``model_config.architecture`` and load its weights.

    Args:
        model_config: `ModelConfig` (its ``dtype`` picks the parameter dtype).
        load_format: "auto" | "gguf" | "safetensors" | "dummy" (random normal(0, 0.02) weights, norms 1).
        seed: randomness for dummy weights.
    Returns:
        (graphdef, params): the NNX graph definition and a State of device arrays.
    Raises:
        ValueError: a checkpoint tensor has the wrong shape, or a parameter has no tensor.
    """
    cls = get_model_class(model_config.architecture)
    dtype = JNP_DTYPES[model_config.dtype]
    abstract = nnx.eval_shape(lambda: cls(model_config, dtype=dtype, rngs=nnx.Rngs(0)))
    graphdef, abstract_state = nnx.split(abstract)
    flat = list(nnx.to_flat_state(abstract_state))
    by_name = {_path_name(path): (i, var) for i, (path, var) in enumerate(flat)}
    values = {}

    if load_format == "dummy":
        rng = np.random.default_rng(seed)
        for name, (_, var) in tqdm(by_name.items(), desc="Initializing dummy weights", unit="tensor"):
            shape = var.get_value().shape
            if name.endswith("norm.weight"):
                arr = np.ones(shape, np.float32)
            else:
                arr = rng.standard_normal(shape, dtype=np.float32) * 0.02
            values[name] = jnp.asarray(arr, dtype=dtype)
    else:
        source, total = _weight_source(model_config, load_format)
        for name, arr in tqdm(source, total=total, desc="Loading weights", unit="tensor"):
            if name not in by_name:
                logger.debug("Ignoring checkpoint tensor %s (no matching parameter)", name)
                continue
            expected = tuple(by_name[name][1].get_value().shape)
            if tuple(arr.shape) != expected:
                raise ValueError(f"Checkpoint tensor {name} has shape {tuple(arr.shape)}, model expects {expected}")
            values[name] = jnp.asarray(arr, dtype=dtype)
    missing = [n for n in by_name if n not in values]
    if missing:
        raise ValueError(f"Checkpoint has no tensors for {len(missing)} parameters, e.g. {missing[:5]}")
    new_flat = [(path, var.replace(values[_path_name(path)])) for path, var in flat]
    params = nnx.from_flat_state(new_flat)
    n_params = sum(int(np.prod(v.shape)) for v in jax.tree.leaves(params))
    logger.info("Loaded %s: %.1fM parameters in %s", model_config.architecture, n_params / 1e6, model_config.dtype)
    return graphdef, params
