"""The served model as Ollama's /api/tags, /api/show and /api/ps describe it
(https://github.com/ollama/ollama/blob/main/docs/api.md): sizes, dates and a digest of its weight files, the
parameter count and quantization (read from the GGUF metadata through ``gguf``, or from the safetensors headers
through ``safetensors``), Ollama's ``details`` and ``model_info`` keys."""

from __future__ import annotations

import dataclasses
import datetime
import glob
import hashlib
import json
import os
from typing import Dict, List

from sgl_jax.srt.configs.model_config import resolve_model
from sgl_jax.srt.entrypoints.ollama.protocol import DEFAULT_TEMPERATURE, DEFAULT_TOP_K, DEFAULT_TOP_P
from sgl_jax.srt.tokenizer.tokenizer_manager import TokenizerManager

# /api/ps: Ollama's keep-alive expiry; the served model is never unloaded
NEVER_EXPIRES = "9999-12-31T23:59:59Z"


@dataclasses.dataclass(frozen=True)
class ModelFacts:
    """What /api/tags, /api/show and /api/ps say about the served model: its weight files' total `size`
    (bytes) and newest mtime (`modified_at`, RFC 3339), a `digest` (sha256 of the name, paths, size and mtime:
    an identity, not a hash of the weights), Ollama's `details` and the `model_info` key/values (a GGUF's
    scalar metadata, else built from config.json)."""

    size: int
    modified_at: str
    digest: str
    details: dict
    model_info: dict


def human_number(n: int) -> str:
    """A parameter count as Ollama prints ``parameter_size`` (its format.HumanNumber): 134515008 -> "134.52M"."""
    for unit, scale, decimals in (("B", 10**9, 1), ("M", 10**6, 2), ("K", 10**3, 0)):
        if n >= scale:
            value = n / scale
            return f"{value:.0f}{unit}" if value == int(value) or unit == "K" else f"{value:.{decimals}f}{unit}"
    return str(n)


def _gguf_facts(path: str) -> tuple:
    """(parameter count, quantization level, model_info) of a GGUF file: llama.cpp's file type name
    (``Q4_1``), its scalar metadata (arrays listed empty, as Ollama's non-verbose /api/show)."""
    import gguf.constants
    import numpy as np

    from sgl_jax.srt.model_loader.gguf_reader import open_gguf

    f = open_gguf(path)
    params = sum(int(np.prod(t.shape, dtype=np.int64)) for t in f.tensors)
    try:
        quant = gguf.constants.LlamaFileType(int(f.metadata["general.file_type"])).name.replace("MOSTLY_", "")
    except (KeyError, ValueError):
        quant = ""
    info = {k: ([] if isinstance(v, (list, np.ndarray)) else v) for k, v in f.metadata.items()
            if k != "tokenizer.chat_template"}
    return params, quant, info


def _safetensors_facts(files: List[str]) -> tuple:
    """(parameter count, the most common dtype) from the safetensors files' headers (no tensor is read)."""
    from safetensors import safe_open

    params, by_dtype = 0, {}
    for path in files:
        with safe_open(path, "np") as fh:
            for name in fh.keys():
                view = fh.get_slice(name)
                count = 1
                for d in view.get_shape():
                    count *= d
                params += count
                by_dtype[view.get_dtype()] = by_dtype.get(view.get_dtype(), 0) + count
    return params, (max(by_dtype, key=by_dtype.get) if by_dtype else "")


def model_facts(tm: TokenizerManager) -> ModelFacts:
    """The served model's `ModelFacts` (reads file headers: call off the event loop, once; `cached_facts`)."""
    resolved = resolve_model(tm.server_args)
    with open(os.path.join(resolved.hf_dir, "config.json")) as fh:
        config = json.load(fh)
    family = str(config.get("model_type") or tm.info.architecture).lower()
    if resolved.gguf_file:
        files, fmt = [resolved.gguf_file], "gguf"
        params, quant, info = _gguf_facts(resolved.gguf_file)
        family = str(info.get("general.architecture", family))
    else:
        files, fmt = sorted(glob.glob(os.path.join(resolved.hf_dir, "*.safetensors"))), "safetensors"
        (params, quant), info = _safetensors_facts(files), {"general.architecture": family}
        for key, name in (("hidden_size", "embedding_length"), ("num_hidden_layers", "block_count"),
                          ("num_attention_heads", "attention.head_count"),
                          ("num_key_value_heads", "attention.head_count_kv"), ("vocab_size", "vocab_size")):
            if isinstance(config.get(key), int):
                info[f"{family}.{name}"] = config[key]
    info.update({"general.parameter_count": params, f"{family}.context_length": tm.context_len})
    size = sum(os.path.getsize(p) for p in files)
    mtime = max((os.path.getmtime(p) for p in files), default=0.0)
    modified = datetime.datetime.fromtimestamp(mtime, datetime.timezone.utc).isoformat().replace("+00:00", "Z")
    digest = hashlib.sha256(f"{tm.served_model_name}|{'|'.join(files)}|{size}|{mtime}".encode()).hexdigest()
    details = {"parent_model": "", "format": fmt, "family": family, "families": [family],
               "parameter_size": human_number(params) if params else "", "quantization_level": quant}
    return ModelFacts(size, modified, digest, details, info)


_FACTS: Dict[int, ModelFacts] = {}


async def cached_facts(tm: TokenizerManager) -> ModelFacts:
    """`model_facts` of `tm`, computed on the tokenizer thread the first time and kept."""
    facts = _FACTS.get(id(tm))
    if facts is None:
        facts = _FACTS[id(tm)] = await tm.run_blocking(model_facts, tm)
    return facts


def is_served_model(tm: TokenizerManager, name: str) -> bool:
    """Whether `name` names the served model (case-insensitive; Ollama's default tag ``:latest`` allowed)."""
    name = name.strip().casefold()
    served = tm.served_model_name.casefold()
    return name in (served, f"{served}:latest")


def capabilities(tm: TokenizerManager) -> List[str]:
    """Ollama's capability names this server has for the model: completion, tools, and thinking with
    --reasoning-parser."""
    return ["completion", "tools"] + (["thinking"] if tm.server_args.reasoning_parser else [])


def tag_entry(tm: TokenizerManager, facts: ModelFacts) -> dict:
    """The model's entry in /api/tags."""
    name = tm.served_model_name
    return {"name": name, "model": name, "modified_at": facts.modified_at, "size": facts.size,
            "digest": facts.digest, "details": facts.details}


def ps_entry(tm: TokenizerManager, facts: ModelFacts) -> dict:
    """The model's entry in /api/ps (always loaded; all of it in device memory)."""
    name = tm.served_model_name
    return {"name": name, "model": name, "size": facts.size, "digest": facts.digest, "details": facts.details,
            "expires_at": NEVER_EXPIRES, "size_vram": facts.size, "context_length": tm.context_len}


def show_body(tm: TokenizerManager, facts: ModelFacts) -> dict:
    """The /api/show object: a Modelfile and ``parameters`` with this server's defaults, the chat template
    (Jinja, not Ollama's Go template), details, model_info, capabilities."""
    params = [("num_ctx", tm.context_len), ("temperature", DEFAULT_TEMPERATURE), ("top_k", DEFAULT_TOP_K),
              ("top_p", DEFAULT_TOP_P)]
    parameters = "\n".join(f"{k:<30} {v}" for k, v in params)
    modelfile = "\n".join([f"# Modelfile of {tm.served_model_name}, served by sgl-jax",
                           f"FROM {tm.served_model_name}", *(f"PARAMETER {k} {v}" for k, v in params)])
    return {"modelfile": modelfile, "parameters": parameters,
            "template": getattr(tm.tokenizer, "chat_template", None) or "", "details": facts.details,
            "model_info": facts.model_info, "capabilities": capabilities(tm), "modified_at": facts.modified_at}
