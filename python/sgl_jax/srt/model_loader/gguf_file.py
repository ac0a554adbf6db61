"""Reading a llama.cpp GGUF file without torch: HF config, fast tokenizer and dequantized tensors.

- Metadata is read with `gguf.GGUFReader` and mapped to an HF ``config.json`` (llama and qwen3 archs).
- The tokenizer is rebuilt with the `tokenizers` library from ``tokenizer.ggml.*`` (byte-level BPE, the
  ``gpt2`` tokenizer model of llama.cpp) and saved as an HF tokenizer directory.
- Both are cached on disk (`prepare_gguf_hf_dir`), keyed by the file's path, size and mtime, so every
  process after the first loads them as a plain HF directory.
- Tensors are dequantized with `gguf.quants.dequantize` and renamed to HF state-dict names. llama.cpp's
  converter permutes the rows of q/k projections of llama models for its rotary layout; we undo it, after
  which every tensor equals transformers' GGUF-loaded state dict bit for bit.

Source of the layout conventions: llama.cpp ``convert_hf_to_gguf.py`` (``LlamaModel.permute``) and the
GGUF spec (``gguf-py/gguf/constants.py``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from typing import Dict, Iterator, Tuple

import numpy as np

logger = logging.getLogger(__name__)

_CACHE_FORMAT_VERSION = "1"

# GGUF architecture -> (HF architectures entry, HF model_type)
_ARCHS = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
}

# llama.cpp tensor name (after "blk.N.") -> HF name (after "model.layers.N.")
_LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}

# GGUF token types (gguf-py TokenType)
_TOKEN_CONTROL = 3
_TOKEN_USER_DEFINED = 4

# Pre-tokenizer split patterns of llama.cpp's `tokenizer.ggml.pre` values (byte-level BPE vocabularies).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _reader(path: str):
    import gguf

    return gguf.GGUFReader(path)


def _scalar_fields(reader) -> Dict[str, object]:
    """All metadata fields except the large token arrays, as Python values."""
    out = {}
    for key, field in reader.fields.items():
        if key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type",
                   "tokenizer.ggml.scores"):
            continue
        try:
            out[key] = field.contents()
        except Exception:  # unreadable exotic field types are not needed
            continue
    return out


def gguf_to_hf_config(reader) -> dict:
    """HF ``config.json`` contents for a GGUF file.

    Raises:
        NotImplementedError: the file's ``general.architecture`` is not llama or qwen3, or it carries
            llama3-style ``rope_freqs`` (use the HF checkpoint for those).
    """
    meta = _scalar_fields(reader)
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
    n_tokens = len(reader.fields["tokenizer.ggml.tokens"].data)
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
        "attention_bias": "blk.0.attn_q.bias" in tensor_names,
        "torch_dtype": "float32",
    }
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
    return config


def build_gguf_tokenizer(reader):
    """A `transformers.PreTrainedTokenizerFast` rebuilt from the GGUF vocabulary, merges and special tokens.

    Only llama.cpp's ``gpt2`` tokenizer model (byte-level BPE: SmolLM2, Llama 3, Qwen) is supported.

    Raises:
        NotImplementedError: another ``tokenizer.ggml.model`` (e.g. sentencepiece ``llama``).
    """
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    meta = _scalar_fields(reader)
    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise NotImplementedError(f"GGUF tokenizer model {kind!r} is not supported (only byte-level BPE 'gpt2')")
    tokens = list(reader.fields["tokenizer.ggml.tokens"].contents())
    merges = [tuple(m.split(" ", 1)) for m in reader.fields["tokenizer.ggml.merges"].contents()]
    types = list(reader.fields["tokenizer.ggml.token_type"].contents())

    vocab = {tok: i for i, tok in enumerate(tokens)}
    tk = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    pre = meta.get("tokenizer.ggml.pre", "default")
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    if pre in ("llama-bpe", "llama3", "smaug-bpe"):
        tk.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False),
        ])
    elif pre == "qwen2":
        tk.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_QWEN2_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False),
        ])
    elif pre == "smollm":
        tk.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    else:
        tk.pre_tokenizer = byte_level
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens([
        AddedToken(tokens[i], special=True, normalized=False) for i, t in enumerate(types) if t == _TOKEN_CONTROL
    ])
    tk.add_tokens([
        AddedToken(tokens[i], special=False, normalized=False) for i, t in enumerate(types) if t == _TOKEN_USER_DEFINED
    ])

    def special(key):
        idx = meta.get(f"tokenizer.ggml.{key}")
        return tokens[int(idx)] if idx is not None and int(idx) < len(tokens) else None

    bos = special("bos_token_id")
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False))
    if add_bos and bos is not None:
        bos_id = int(meta["tokenizer.ggml.bos_token_id"])
        tk.post_processor = processors.TemplateProcessing(
            single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1", special_tokens=[(bos, bos_id)]
        )
    return PreTrainedTokenizerFast(
        tokenizer_object=tk,
        bos_token=bos,
        eos_token=special("eos_token_id"),
        unk_token=special("unknown_token_id"),
        pad_token=special("padding_token_id"),
        chat_template=meta.get("tokenizer.chat_template"),
        add_bos_token=add_bos,
        clean_up_tokenization_spaces=False,
    )


def _cache_dir_for(path: str) -> str:
    from sgl_jax.srt.server_args import _default_cache_root

    st = os.stat(path)
    key = f"{os.path.abspath(path)}|{st.st_size}|{st.st_mtime_ns}|{_CACHE_FORMAT_VERSION}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    name = os.path.splitext(os.path.basename(path))[0]
    return os.path.join(_default_cache_root(), "gguf", f"{name}-{digest}")


def prepare_gguf_hf_dir(path: str) -> str:
    """An HF-style directory (config.json + tokenizer files) describing the GGUF file at `path`.

    Built once and cached under ``$SGL_JAX_CACHE_DIR/gguf`` (default ``~/.cache/sgl_jax``); later calls
    return the cached directory. Written atomically (temp dir + rename) so concurrent processes are safe.
    """
    out = _cache_dir_for(path)
    if os.path.exists(os.path.join(out, "config.json")):
        return out
    logger.info("Building HF config and tokenizer from GGUF metadata of %s (cached in %s)", path, out)
    reader = _reader(path)
    tmp = f"{out}.tmp{os.getpid()}"
    os.makedirs(tmp, exist_ok=True)
    build_gguf_tokenizer(reader).save_pretrained(tmp)
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(gguf_to_hf_config(reader), f, indent=2)
    with open(os.path.join(tmp, "gguf_source.txt"), "w") as f:
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
        w: [n_heads * head_dim, hidden] weight as stored in the GGUF (rows permuted).
        n_heads: query heads for q_proj, KV heads for k_proj.
    Returns:
        The HF-layout weight, same shape and dtype.
    """
    head_dim = w.shape[0] // n_heads
    return w.reshape(n_heads, head_dim // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _hf_name(gguf_name: str) -> str | None:
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    if gguf_name.startswith("blk."):
        _, layer, rest = gguf_name.split(".", 2)
        if rest in _LAYER_TENSORS:
            return f"model.layers.{layer}.{_LAYER_TENSORS[rest]}"
    return None


def iterate_gguf_tensors(path: str, reader=None) -> Iterator[Tuple[str, np.ndarray]]:
    """Yield ``(hf_name, float32 array)`` for every tensor of the GGUF file, in file order.

    Arrays are dequantized (any type `gguf.quants.dequantize` supports: F32, F16, BF16, Q4_0/1, Q5_0/1,
    Q8_0, K-quants, IQ types) and have HF state-dict shapes ([out, in] for projections).
    Tensors with no HF counterpart are skipped with a debug log. Pass an open `gguf.GGUFReader` as
    `reader` to avoid parsing the file's metadata again.
    """
    from gguf.quants import dequantize

    reader = reader or _reader(path)
    meta = _scalar_fields(reader)
    arch = meta["general.architecture"]
    n_heads = int(meta[f"{arch}.attention.head_count"])
    n_kv = int(meta.get(f"{arch}.attention.head_count_kv", n_heads))
    for t in reader.tensors:
        name = _hf_name(t.name)
        if name is None:
            logger.debug("Skipping GGUF tensor %s", t.name)
            continue
        arr = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        arr = arr.reshape([int(d) for d in reversed(t.shape)])
        if arch == "llama":
            if name.endswith("q_proj.weight"):
                arr = unpermute_qk(arr, n_heads)
            elif name.endswith("k_proj.weight"):
                arr = unpermute_qk(arr, n_kv)
        yield name, arr
