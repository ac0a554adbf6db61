"""ModelConfig: what the engine needs to know about a model, read from an HF directory or a GGUF file."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import List, Optional

from sgl_jax.srt.model_loader.default_model import find_default_model_path


@dataclasses.dataclass
class ResolvedModel:
    """Where a model's pieces live.

    model_path: what the user gave (or the default GGUF file).
    hf_dir: an HF-style directory holding config.json and tokenizer files (for GGUF: a cached one).
    gguf_file: the GGUF file when weights come from one, else None.
    """

    model_path: str
    hf_dir: str
    gguf_file: Optional[str]


def resolve_model_path(model_path: Optional[str]) -> ResolvedModel:
    """Resolve ``--model-path`` (None -> the default SmolLM2 GGUF) to an HF directory and optional GGUF file.

    Raises:
        FileNotFoundError: the path does not exist, or no default model is installed.
    """
    from sgl_jax.srt.model_loader.gguf_file import prepare_gguf_hf_dir

    path = model_path or find_default_model_path()
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"--model-path {path!r} does not exist (downloading from a hub is not supported; "
            "give a local HF directory or .gguf file)"
        )
    path = os.path.abspath(path)
    if path.endswith(".gguf"):
        return ResolvedModel(model_path=path, hf_dir=prepare_gguf_hf_dir(path), gguf_file=path)
    if not os.path.exists(os.path.join(path, "config.json")):
        raise FileNotFoundError(f"--model-path {path!r} has no config.json")
    return ResolvedModel(model_path=path, hf_dir=path, gguf_file=None)


def served_model_name(server_args) -> str:
    """The name responses give the model: --served-model-name, else the model file's or directory's name
    (``SmolLM2-135M-Instruct.Q4_1`` for the default GGUF) -- never its path on disk.

    Raises:
        FileNotFoundError: as `resolve_model_path`.
    """
    if server_args.served_model_name:
        return server_args.served_model_name
    name = os.path.basename(os.path.normpath(resolve_model_path(server_args.model_path).model_path))
    return name[:-len(".gguf")] if name.endswith(".gguf") else name


def tokenizer_path_for(server_args) -> str:
    """--tokenizer-path, else the model's HF directory (for GGUF: the cached one built from its metadata)."""
    return server_args.tokenizer_path or resolve_model_path(server_args.model_path).hf_dir


def load_tokenizer(server_args):
    """The HF fast tokenizer every process uses (`transformers.AutoTokenizer`; no torch needed)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_path_for(server_args))


def _rope_parameters(hf_config) -> dict:
    """Rope settings as one dict with ``rope_theta`` and ``rope_type`` (transformers 4.x and 5.x layouts)."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    scaling = getattr(hf_config, "rope_scaling", None) or {}
    for k, v in dict(scaling).items():
        params.setdefault(k, v)
    if "type" in params and "rope_type" not in params:
        params["rope_type"] = params.pop("type")
    params.setdefault("rope_type", "default")
    params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    return params


@dataclasses.dataclass
class ModelConfig:
    """Model hyper-parameters the engine uses, plus the HF config object for the model code.

    Attributes are in the field's usual units: ``context_len`` in tokens, ``head_dim`` in elements.
    ``dtype`` is a JAX dtype name ("float32" or "bfloat16").
    """

    resolved: ResolvedModel
    hf_config: object
    architecture: str
    dtype: str
    context_len: int
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    eos_token_ids: List[int]
    rope_parameters: dict

    @property
    def model_path(self) -> str:
        return self.resolved.model_path

    @staticmethod
    def from_server_args(server_args, platform: str) -> "ModelConfig":
        """Build from `ServerArgs` once the JAX platform ("cpu", "tpu", "gpu") is known."""
        from transformers import AutoConfig

        resolved = resolve_model_path(server_args.model_path)
        hf_config = AutoConfig.from_pretrained(resolved.hf_dir, trust_remote_code=server_args.trust_remote_code)
        archs = getattr(hf_config, "architectures", None) or []
        if not archs:
            raise ValueError(f"{resolved.hf_dir}/config.json has no 'architectures' field")
        dtype = server_args.dtype
        if dtype == "auto":
            dtype = "float32" if platform == "cpu" else "bfloat16"
        model_ctx = int(getattr(hf_config, "max_position_embeddings", 2048))
        context_len = server_args.context_length or model_ctx
        heads = int(hf_config.num_attention_heads)
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
        return ModelConfig(
            resolved=resolved,
            hf_config=hf_config,
            architecture=archs[0],
            dtype=dtype,
            context_len=int(context_len),
            vocab_size=int(hf_config.vocab_size),
            hidden_size=int(hf_config.hidden_size),
            num_hidden_layers=int(hf_config.num_hidden_layers),
            num_attention_heads=heads,
            num_key_value_heads=int(getattr(hf_config, "num_key_value_heads", None) or heads),
            head_dim=int(head_dim),
            eos_token_ids=_eos_token_ids(resolved.hf_dir, hf_config),
            rope_parameters=_rope_parameters(hf_config),
        )


def _eos_token_ids(hf_dir: str, hf_config) -> List[int]:
    """EOS ids from config.json and generation_config.json (either may hold an int or a list)."""
    ids = set()
    sources = [getattr(hf_config, "eos_token_id", None)]
    gen_path = os.path.join(hf_dir, "generation_config.json")
    if os.path.exists(gen_path):
        with open(gen_path) as f:
            sources.append(json.load(f).get("eos_token_id"))
    for src in sources:
        if isinstance(src, int):
            ids.add(src)
        elif isinstance(src, (list, tuple)):
            ids.update(int(x) for x in src)
    return sorted(ids)
