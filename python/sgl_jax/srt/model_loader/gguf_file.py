"""Reading a llama.cpp GGUF file without torch: HF config, fast tokenizer and dequantized tensors.

- Metadata is read with `gguf_reader.GGUFFile` and mapped to an HF ``config.json`` (llama, qwen3 and
  gemma3).
- The tokenizer is rebuilt with the `tokenizers` library from ``tokenizer.ggml.*`` (`gguf_tokenizer`) and
  saved as an HF tokenizer directory. A file without ``tokenizer.chat_template`` gets its architecture's
  built-in template, if there is one (`chat_templates.BUILTIN_CHAT_TEMPLATES`: gemma3).
- Both are cached on disk (`prepare_gguf_hf_dir`), keyed by the file's path, size and mtime, so every
  process after the first loads them as a plain HF directory.
- Tensors are dequantized with `gguf.quants.dequantize` and renamed to HF state-dict names. llama.cpp's
  converter permutes the rows of q/k projections of llama models for its rotary layout, and stores Gemma's
  RMSNorm weights as ``1 + w``; we undo both, after which every tensor equals transformers' GGUF-loaded state
  dict bit for bit.

Source of the layout conventions: llama.cpp ``convert_hf_to_gguf.py`` (``LlamaModel.permute``,
``Gemma3Model.modify_tensors``), ``src/llama-model.cpp`` (the hyper-parameters a GGUF leaves implicit) and
the GGUF spec (``gguf-py/gguf/constants.py``).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
from typing import Iterator, Optional, Tuple

import numpy as np

from sgl_jax.srt.chat_templates import BUILTIN_CHAT_TEMPLATES
from sgl_jax.srt.model_loader.gguf_blocks import BLOCK_DTYPES, GROUP, GroupQuantized, dequantize_blocks, read_blocks
from sgl_jax.srt.model_loader.gguf_reader import open_gguf
from sgl_jax.srt.quantization.checkpoint import GGUF_LINEAR_SUFFIXES

logger = logging.getLogger(__name__)

_CACHE_FORMAT_VERSION = "5"  # 2: gemma3 support, generation_config.json; 3: built-in chat template fallback;
# 4: no tokenizer for an unknown tokenizer.ggml.pre (UNSUPPORTED_TOKENIZER_FILE instead of an approximation);
# 5: attention_bias only with attn_output.bias (o_proj's), qkv_bias with attn_q.bias alone

# GGUF architecture -> (HF architectures entry, HF model_type)
_ARCHS = {
    "llama": ("LlamaForCausalLM", "llama"),  # with experts (``llama.expert_count``): Mixtral
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    "qwen3moe": ("Qwen3MoeForCausalLM", "qwen3_moe"),
    "qwen2moe": ("Qwen2MoeForCausalLM", "qwen2_moe"),
    "gemma3": ("Gemma3ForCausalLM", "gemma3_text"),
}
MIXTRAL = ("MixtralForCausalLM", "mixtral")

# llama.cpp tensor name (after "blk.N.") -> HF name (after "model.layers.N.")
_LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.bias": "self_attn.o_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
# Gemma 3 has four norms per layer ("sandwich" norms): after attention and around the MLP.
_GEMMA3_LAYER_TENSORS = {
    **_LAYER_TENSORS,
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
# Mixture-of-experts layers (llama.cpp's names): the router, the experts' weights stacked [E, out, in] (made
# [E, in, out] for the model's stacked parameters, layers/moe.py), Qwen2-MoE's shared expert and its gate.
_MOE_LAYER_TENSORS = {
    **_LAYER_TENSORS,
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "ffn_gate_exps.weight": "mlp.experts.gate_proj",
    "ffn_up_exps.weight": "mlp.experts.up_proj",
    "ffn_down_exps.weight": "mlp.experts.down_proj",
    "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
    "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
}
_MIXTRAL_LAYER_TENSORS = {
    **_LAYER_TENSORS,
    "ffn_gate_inp.weight": "block_sparse_moe.gate.weight",
    "ffn_gate_exps.weight": "block_sparse_moe.experts.w1",
    "ffn_up_exps.weight": "block_sparse_moe.experts.w3",
    "ffn_down_exps.weight": "block_sparse_moe.experts.w2",
}
_ARCH_LAYER_TENSORS = {"gemma3": _GEMMA3_LAYER_TENSORS, "qwen3moe": _MOE_LAYER_TENSORS,
                       "qwen2moe": _MOE_LAYER_TENSORS, "mixtral": _MIXTRAL_LAYER_TENSORS}
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}

# ---- Gemma 3: what a GGUF file does not store (llama.cpp hard-codes these in src/llama-model.cpp,
# ``case LLM_ARCH_GEMMA3`` of load_hparams, and convert_hf_to_gguf.py ``Gemma3Model``).
# Every layer whose index i has (i + 1) % 6 == 0 is global (full) attention, the other five of each six use
# the sliding window: ``hparams.set_swa_pattern(6)``; HF Gemma3TextConfig's sliding_window_pattern=6.
GEMMA3_SLIDING_WINDOW_PATTERN = 6
# Rope base of the sliding-window (local) layers; ``gemma3.rope.freq_base`` is the global layers' base.
# ``hparams.rope_freq_base_train_swa = 10000.0f``; HF config ``rope_local_base_freq`` 10000.0.
GEMMA3_LOCAL_ROPE_BASE = 10000.0
# RMSNorm computes x * (1 + w) (HF Gemma3RMSNorm); the converter stores every ``*norm.weight`` as w + 1.0
# (``norm_shift = 1.0``), so the HF weight is the stored value minus this.
GEMMA3_NORM_SHIFT = 1.0
# Attention scores are scaled by query_pre_attn_scalar ** -0.5: head_dim, except Gemma 3 27B (62 layers),
# which uses hidden_size / num_heads (``f_attention_scale`` in llama-model.cpp; HF 27B config: 168).
GEMMA3_27B_LAYERS = 62
# MLP activation: GELU, tanh approximation (llama.cpp ``LLM_FFN_GELU`` in the gemma3 graph).
GEMMA3_ACTIVATION = "gelu_pytorch_tanh"
# Gemma's end-of-turn token: an end of generation besides the file's EOS (see `gguf_generation_config`).
GEMMA3_END_OF_TURN = "<end_of_turn>"


def gguf_to_hf_config(reader) -> dict:
    """HF ``config.json`` contents for a GGUF file.

    Raises:
        NotImplementedError: the file's ``general.architecture`` is not one of _ARCHS, or it carries
            llama3-style ``rope_freqs`` (use the HF checkpoint for those).
    """
    meta = reader.metadata
    arch = meta["general.architecture"]
    if arch not in _ARCHS:
        raise NotImplementedError(f"GGUF architecture {arch!r} is not supported; supported: {sorted(_ARCHS)}")
    tensor_names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in tensor_names:
        raise NotImplementedError("GGUF files with rope_freqs (llama3 rope scaling) are not supported; use the HF checkpoint")

    def get(key, default=None):
        return meta.get(f"{arch}.{key}", default)

    n_heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    head_dim = int(get("attention.key_length", get("rope.dimension_count", hidden // n_heads)))
    n_tokens = len(meta["tokenizer.ggml.tokens"])
    hf_arch, model_type = _ARCHS[arch]
    config = {
        "architectures": [hf_arch],
        "model_type": model_type,
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": n_heads,
        "num_key_value_heads": int(get("attention.head_count_kv", n_heads)),
        "head_dim": head_dim,
        "max_position_embeddings": int(get("context_length", 2048)),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "vocab_size": int(get("vocab_size", n_tokens)),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "hidden_act": "silu",
        # transformers' attention_bias puts a bias on q/k/v and o; qkv_bias (below) on q/k/v only
        "attention_bias": "blk.0.attn_output.bias" in tensor_names,
        "torch_dtype": "float32",
    }
    if "blk.0.attn_q.bias" in tensor_names and not config["attention_bias"]:  # Qwen2-MoE's (and dense Qwen2's)
        config["qkv_bias"] = True
    scaling_type = get("rope.scaling.type")
    if scaling_type in ("linear", "yarn"):
        config["rope_scaling"] = {"rope_type": scaling_type, "factor": float(get("rope.scaling.factor", 1.0))}
        if scaling_type == "yarn":
            config["rope_scaling"]["original_max_position_embeddings"] = int(
                get("rope.scaling.original_context_length", config["max_position_embeddings"])
            )
    for name, key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                      ("pad_token_id", "padding_token_id")):
        if f"tokenizer.ggml.{key}" in meta:
            config[name] = int(meta[f"tokenizer.ggml.{key}"])
    if arch == "gemma3":
        _add_gemma3_config(config, get)
    if get("expert_count"):
        _add_moe_config(config, arch, get, tensor_names)
    return config


def _add_moe_config(config: dict, arch: str, get, tensor_names: set) -> None:
    """The mixture-of-experts fields of a qwen3moe / qwen2moe / llama-with-experts (Mixtral) file: expert counts
    and sizes from ``<arch>.expert_*``; the layers without a router (``ffn_gate_inp``) are dense
    (``mlp_only_layers``); top-k renormalised for qwen3moe and Mixtral, not for qwen2moe (llama.cpp's graphs and
    the released HF configs), unless ``<arch>.expert_weights_norm`` says otherwise."""
    experts, top_k = int(get("expert_count")), int(get("expert_used_count"))
    if arch == "llama":
        config["architectures"], config["model_type"] = [MIXTRAL[0]], MIXTRAL[1]
        config.update(num_local_experts=experts, num_experts_per_tok=top_k)
        return
    dense = [i for i in range(config["num_hidden_layers"]) if f"blk.{i}.ffn_gate_inp.weight" not in tensor_names]
    config.update(num_experts=experts, num_experts_per_tok=top_k, decoder_sparse_step=1, mlp_only_layers=dense,
                  moe_intermediate_size=int(get("expert_feed_forward_length")),
                  norm_topk_prob=bool(get("expert_weights_norm", arch == "qwen3moe")))
    if arch == "qwen2moe":
        config["shared_expert_intermediate_size"] = int(get("expert_shared_feed_forward_length", 0))


def _add_gemma3_config(config: dict, get) -> None:
    """The Gemma 3 fields of `config` (HF Gemma3TextConfig), with what the GGUF leaves out filled in from
    the GEMMA3_* constants, as llama.cpp does when it loads the file."""
    n_layers = config["num_hidden_layers"]
    window = int(get("attention.sliding_window", 0))
    pattern = get("attention.sliding_window_pattern")  # per-layer bools (True: sliding), rarely written
    if not window:  # llama.cpp: no sliding window key -> every layer is global
        layer_types = ["full_attention"] * n_layers
    elif pattern is not None and len(pattern) == n_layers:
        layer_types = ["sliding_attention" if p else "full_attention" for p in pattern]
    else:
        layer_types = ["full_attention" if (i + 1) % GEMMA3_SLIDING_WINDOW_PATTERN == 0 else "sliding_attention"
                       for i in range(n_layers)]
    scalar = (config["hidden_size"] // config["num_attention_heads"] if n_layers == GEMMA3_27B_LAYERS
              else config["head_dim"])
    softcap = get("final_logit_softcapping")
    del config["hidden_act"]
    config.update({
        "hidden_activation": GEMMA3_ACTIVATION,
        "sliding_window": window or None,
        "layer_types": layer_types,
        "rope_local_base_freq": GEMMA3_LOCAL_ROPE_BASE,
        "query_pre_attn_scalar": scalar,
        "final_logit_softcapping": float(softcap) if softcap else None,
        "attn_logit_softcapping": None,  # removed in Gemma 3 (the converter asserts it is unset)
    })


def gguf_generation_config(config: dict, tokenizer) -> dict:
    """HF ``generation_config.json`` contents: the config's BOS / EOS / PAD, plus for gemma3 the end-of-turn
    token as a second EOS (the GGUF names one EOS; llama.cpp ends generation at a token spelled
    ``<end_of_turn>`` too, and so do Gemma 3's own generation configs)."""
    gen = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in config}
    if config["model_type"] != "gemma3_text" or "eos_token_id" not in gen or tokenizer is None:
        return gen
    end_of_turn = tokenizer.convert_tokens_to_ids(GEMMA3_END_OF_TURN)
    if end_of_turn is not None and end_of_turn != tokenizer.unk_token_id:
        gen["eos_token_id"] = [gen["eos_token_id"], end_of_turn]
    return gen


def _cache_dir_for(path: str) -> str:
    from sgl_jax.srt.server_args import _default_cache_root

    st = os.stat(path)
    key = f"{os.path.abspath(path)}|{st.st_size}|{st.st_mtime_ns}|{_CACHE_FORMAT_VERSION}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    name = os.path.splitext(os.path.basename(path))[0]
    return os.path.join(_default_cache_root(), "gguf", f"{name}-{digest}")


UNSUPPORTED_TOKENIZER_FILE = "tokenizer_unsupported.txt"
GGUF_SOURCE_FILE = "gguf_source.txt"  # in a directory prepare_gguf_hf_dir built: the GGUF's path


def check_gguf_tokenizer_dir(path: str) -> None:
    """Raise `UnsupportedGGUFTokenizer` (its message names the GGUF, the reason and --tokenizer-path) when
    `path` is a directory `prepare_gguf_hf_dir` built without a tokenizer; otherwise do nothing."""
    from sgl_jax.srt.model_loader.gguf_tokenizer import UnsupportedGGUFTokenizer

    marker = os.path.join(path, UNSUPPORTED_TOKENIZER_FILE)
    if os.path.isfile(marker):
        with open(marker) as f:
            raise UnsupportedGGUFTokenizer(f.read().strip())


def gguf_tokenizer_class(path: str):
    """The transformers tokenizer class that saved the tokenizer of `path` when `path` is a directory
    `prepare_gguf_hf_dir` built (its `GGUF_SOURCE_FILE` and ``tokenizer_config.json``'s ``tokenizer_class``,
    a class transformers exports); None for any other path (a hub or local HF tokenizer: AutoTokenizer's)."""
    config = os.path.join(path, "tokenizer_config.json")
    if not (os.path.isfile(os.path.join(path, GGUF_SOURCE_FILE)) and os.path.isfile(config)):
        return None
    with open(config) as f:
        name = json.load(f).get("tokenizer_class")
    import transformers

    return getattr(transformers, name, None) if isinstance(name, str) and name.isidentifier() else None


def prepare_gguf_hf_dir(path: str) -> str:
    """An HF-style directory (config.json + tokenizer files) describing the GGUF file at `path`.

    Built once and cached under ``$SGL_JAX_CACHE_DIR/gguf`` (default ``~/.cache/sgl_jax``); later calls
    return the cached directory. The tokenizer's chat template is the file's ``tokenizer.chat_template``, else
    the built-in template of its architecture (`BUILTIN_CHAT_TEMPLATES`; logged), else none. A tokenizer that
    cannot be rebuilt (`UnsupportedGGUFTokenizer`) is not written; `UNSUPPORTED_TOKENIZER_FILE` holds why, and
    `check_gguf_tokenizer_dir` raises it when that directory is used as the tokenizer. Written atomically
    (temp dir + rename) so concurrent processes are safe.
    """
    from sgl_jax.srt.model_loader.gguf_tokenizer import UnsupportedGGUFTokenizer, build_gguf_tokenizer

    out = _cache_dir_for(path)
    if os.path.exists(os.path.join(out, "config.json")):
        return out
    logger.info("Building HF config and tokenizer from GGUF metadata of %s (cached in %s)", path, out)
    reader = open_gguf(path)
    tmp = f"{out}.tmp{os.getpid()}"
    os.makedirs(tmp, exist_ok=True)
    arch = reader.metadata["general.architecture"]
    try:
        tokenizer = build_gguf_tokenizer(reader)
    except UnsupportedGGUFTokenizer as e:
        logger.warning("%s: %s", os.path.basename(path), e)
        tokenizer = None
        with open(os.path.join(tmp, UNSUPPORTED_TOKENIZER_FILE), "w") as f:
            f.write(f"{os.path.basename(path)}: {e}\n")
    if tokenizer is not None:
        if not tokenizer.chat_template and arch in BUILTIN_CHAT_TEMPLATES:
            logger.info("%s has no chat template: using the built-in %s chat template", os.path.basename(path),
                        arch)
            tokenizer.chat_template = BUILTIN_CHAT_TEMPLATES[arch]
        tokenizer.save_pretrained(tmp)
    config = gguf_to_hf_config(reader)
    for name, contents in (("config.json", config),
                           ("generation_config.json", gguf_generation_config(config, tokenizer))):
        with open(os.path.join(tmp, name), "w") as f:
            json.dump(contents, f, indent=2)
    with open(os.path.join(tmp, GGUF_SOURCE_FILE), "w") as f:
        f.write(os.path.abspath(path) + "\n")
    try:
        os.rename(tmp, out)
    except OSError:  # another process won the race
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return out


def unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's rotary row permutation of a q or k projection.

    Args:
        w: [n_heads * head_dim, hidden] weight (or [n_heads * head_dim] bias) as stored in the GGUF (rows
            permuted).
        n_heads: query heads for q_proj, KV heads for k_proj.
    Returns:
        The HF-layout weight, same shape and dtype.
    """
    head_dim = w.shape[0] // n_heads
    return w.reshape(n_heads, head_dim // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _hf_name(gguf_name: str, arch: str) -> Optional[str]:
    """The model's parameter name of a GGUF tensor (`arch`: the file's architecture, "mixtral" for llama with
    experts), or None."""
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    if gguf_name.startswith("blk."):
        _, layer, rest = gguf_name.split(".", 2)
        table = _ARCH_LAYER_TENSORS.get(arch, _LAYER_TENSORS)
        if rest in table:
            return f"model.layers.{layer}.{table[rest]}"
    return None


def iterate_gguf_tensors(path: str, reader=None, keep_blocks: bool = False) -> Iterator[Tuple[str, object]]:
    """Yield ``(hf_name, float32 array)`` for every tensor of the GGUF file, in file order.

    Arrays are dequantized (any type `gguf.quants.dequantize` supports: F32, F16, BF16, Q4_0/1, Q5_0/1,
    Q8_0, K-quants, IQ types) and have HF state-dict shapes ([out, in] for projections).
    Tensors with no HF counterpart are skipped with a debug log. llama q/k rows are un-permuted and gemma3
    norm weights shifted back (``w = stored - 1``), so the arrays are HF's. Pass an open
    `gguf_reader.GGUFFile` as `reader` to avoid parsing the file's metadata again.

    `keep_blocks` (--quantization gguf): the dense linear layers' Q8_0 / Q4_0 / Q4_1 weights come as
    `gguf_blocks.GroupQuantized` (int8 values, per-block scales and mins, rows un-permuted alike) instead.
    """
    from gguf.quants import dequantize

    reader = reader or open_gguf(path)
    meta = reader.metadata
    arch = meta["general.architecture"]
    n_heads = int(meta[f"{arch}.attention.head_count"])
    n_kv = int(meta.get(f"{arch}.attention.head_count_kv", n_heads))
    table_arch = "mixtral" if arch == "llama" and meta.get("llama.expert_count") else arch
    for t in reader.tensors:
        name = _hf_name(t.name, table_arch)
        if name is None:
            logger.debug("Skipping GGUF tensor %s", t.name)
            continue
        if keep_blocks and t.name.endswith(GGUF_LINEAR_SUFFIXES) and t.tensor_type.name in BLOCK_DTYPES:
            arr = read_blocks(t.data, t.tensor_type.name, t.shape)
        elif t.tensor_type.name in BLOCK_DTYPES and t.shape[-1] % GROUP == 0:
            arr = dequantize_blocks(t.data, t.tensor_type.name, t.shape)  # (the library's values, ~4x faster)
        else:
            arr = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(t.shape)
        if "_exps." in t.name:  # stacked experts [E, out, in] -> the model's [E, in, out]
            arr = np.ascontiguousarray(arr.transpose(0, 2, 1))
        elif t.name.endswith("ffn_gate_inp_shexp.weight"):
            arr = arr.reshape(1, -1)  # HF's shared_expert_gate is a Linear(hidden, 1)
        if arch == "llama":
            if name.endswith(("q_proj.weight", "q_proj.bias")):
                arr = _rows(arr, functools.partial(unpermute_qk, n_heads=n_heads))
            elif name.endswith(("k_proj.weight", "k_proj.bias")):
                arr = _rows(arr, functools.partial(unpermute_qk, n_heads=n_kv))
        elif arch == "gemma3" and name.endswith("norm.weight"):
            arr = arr - np.float32(GEMMA3_NORM_SHIFT)
        yield name, arr


def _rows(arr, fn):
    """`fn` (a reordering of rows) applied to a float array or to every part of a `GroupQuantized`."""
    return arr.rows(fn) if isinstance(arr, GroupQuantized) else fn(arr)
