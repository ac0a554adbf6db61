"""/v1/embeddings (OpenAI's embeddings API) on an embedding model: its pooling, the request's inputs, and the
vectors' last steps (pure functions and one file read, no I/O otherwise).

Pooling follows sentence-transformers, the reference for embedding models: a model directory with ``modules.json``
names its modules; its ``sentence_transformers.models.Pooling`` module's ``config.json`` says which pooling
(``pooling_mode_lasttoken``, ``pooling_mode_mean_tokens``, ``pooling_mode_cls_token``, or 6.x's
``pooling_mode``) and a
``sentence_transformers.models.Normalize`` module L2-normalizes. Without ``modules.json`` a decoder model pools its
last token and normalizes (Qwen3-Embedding's and gte-Qwen2's recipe).

The inputs of one request are packed into few sequences of at most --max-multi-item-seq-len tokens, each input a
segment that sees only itself (the packed-scoring mask), rotary positions from 0 in each; the scheduler returns the
mean of the final hidden states at each input's pooled positions (scheduler/scoring.pooled_outputs).
"""

from __future__ import annotations

import base64
import dataclasses
import json
import os
from typing import List, Optional, Sequence, Union

import numpy as np

from sgl_jax.srt.errors import RequestError

ST_POOLING = "sentence_transformers.models.Pooling"  # (sentence-transformers 6 writes longer module paths that
ST_NORMALIZE = "sentence_transformers.models.Normalize"  # end the same: `_module_kind` reads the last part)
# sentence-transformers' Pooling config: the boolean keys of published models and its 6.x ``pooling_mode`` names
_ST_MODES = (("pooling_mode_cls_token", "cls"), ("pooling_mode_lasttoken", "last"),
             ("pooling_mode_mean_tokens", "mean"))
_ST_MODE_NAMES = {"cls": "cls", "lasttoken": "last", "mean": "mean"}

EmbeddingInput = Union[str, List[str], List[int], List[List[int]]]


@dataclasses.dataclass(frozen=True)
class Pooling:
    """How an embedding model turns final hidden states into one vector: ``mode`` one of POOLING (last token,
    mean over the tokens, first (CLS) token) and whether the vector is L2-normalized."""

    mode: str = "last"
    normalize: bool = True
    max_seq_length: Optional[int] = None  # sentence-transformers' truncation of text inputs (tokens)


def read_pooling(model_dir: str, default: Pooling = Pooling()) -> Pooling:
    """The model's `Pooling` from sentence-transformers' ``modules.json`` and its Pooling module's
    ``config.json``; `default` when the directory has no ``modules.json`` (sentence-transformers' own default for a
    plain encoder is the mean, not normalized; a decoder embedding model's, the last token, normalized).

    Raises:
        ValueError: a Pooling config with none of the supported modes set, or only unsupported ones
            (max, weighted mean, sqrt-len), naming the file.
    """
    modules_path = os.path.join(model_dir, "modules.json")
    if not os.path.isfile(modules_path):
        return default
    with open(modules_path, encoding="utf-8") as f:
        modules = json.load(f)
    normalize = any(_module_kind(m) == "Normalize" for m in modules)
    mode = "last"
    for m in modules:
        if _module_kind(m) != "Pooling":
            continue
        cfg_path = os.path.join(model_dir, m.get("path", ""), "config.json")
        with open(cfg_path, encoding="utf-8") as f:
            cfg = json.load(f)
        modes = [name for key, name in _ST_MODES if cfg.get(key)]
        others = [k for k, v in cfg.items() if k.startswith("pooling_mode_") and v and k not in dict(_ST_MODES)]
        if isinstance(cfg.get("pooling_mode"), str):
            modes = [_ST_MODE_NAMES[cfg["pooling_mode"]]] if cfg["pooling_mode"] in _ST_MODE_NAMES else []
        if len(modes) + len(others) > 1:
            raise ValueError(f"{cfg_path}: several pooling modes set ({modes + others}); sentence-transformers "
                             "concatenates them, which is not served")
        if not modes:
            raise ValueError(f"{cfg_path}: no supported pooling mode set (supported: "
                             f"{[key for key, _ in _ST_MODES]})")
        mode = modes[0]
    return Pooling(mode, normalize, _max_seq_length(model_dir))


def _max_seq_length(model_dir: str) -> Optional[int]:
    """sentence-transformers' ``max_seq_length``: ``sentence_bert_config.json``'s (the published models), else the
    tokenizer's ``model_max_length`` (sentence-transformers 6 saves it there); None when neither is set."""
    for name, key in (("sentence_bert_config.json", "max_seq_length"), ("tokenizer_config.json", "model_max_length")):
        path = os.path.join(model_dir, name)
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                value = json.load(f).get(key)
            if isinstance(value, (int, float)) and 0 < value < 1e9:  # (transformers' "no limit" is ~1e30)
                return int(value)
    return None


def _module_kind(module: dict) -> str:
    """A modules.json entry's class name (``...Pooling``, ``...Normalize``)."""
    return str(module.get("type", "")).rsplit(".", 1)[-1]


def _is_ids(x) -> bool:
    return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)


def split_inputs(value: EmbeddingInput, vocab_size: int, max_inputs: int) -> List[Union[str, List[int]]]:
    """OpenAI's ``input``: a string, a list of strings, a list of token ids or a list of token-id lists, as a
    list of texts or id lists (one per output vector).

    Raises:
        RequestError (400, param ``input``): another type, an empty string or list, more than `max_inputs`
            inputs, or a token id outside the vocabulary.
    """
    if isinstance(value, str):
        items = [value]
    elif _is_ids(value) and value:
        items = [value]
    elif isinstance(value, list) and value and all(isinstance(x, str) for x in value):
        items = list(value)
    elif isinstance(value, list) and value and all(_is_ids(x) for x in value):
        items = [list(x) for x in value]
    else:
        raise RequestError("'input' must be a non-empty string, list of strings, list of token ids or list of "
                           "token-id lists", param="input")
    if len(items) > max_inputs:
        raise RequestError(f"{len(items)} inputs exceed --max-multi-item-count ({max_inputs})", param="input")
    for i, item in enumerate(items):
        if len(item) == 0:
            raise RequestError(f"input[{i}] is empty", param="input")
        if not isinstance(item, str):
            bad = [t for t in item if not 0 <= t < vocab_size]
            if bad:
                raise RequestError(f"input[{i}]: token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})",
                                   param="input")
    return items


def tokenize_inputs(tokenizer, items: Sequence[Union[str, List[int]]],
                    max_seq_length: Optional[int] = None) -> List[List[int]]:
    """Texts tokenized with the tokenizer's special tokens and cut to `max_seq_length` tokens (special tokens
    kept), as sentence-transformers does; ids as given."""
    kw = {"truncation": True, "max_length": max_seq_length} if max_seq_length else {}
    return [tokenizer.encode(x, **kw) if isinstance(x, str) else list(x) for x in items]


def tokenize_pairs(tokenizer, query: str, documents: Sequence[str], max_len: int) -> tuple:
    """(token ids, token types) per (query, document) pair, as the tokenizer encodes a text pair (BERT's
    ``[CLS] q [SEP] d [SEP]`` with types 0 / 1, XLM-RoBERTa's ``<s> q </s></s> d </s>``, a decoder's q + d),
    truncated longest-first to `max_len` tokens: what sentence-transformers' CrossEncoder feeds its model."""
    enc = tokenizer([query] * len(documents), list(documents), truncation=True, max_length=max_len)
    ids = [list(x) for x in enc["input_ids"]]
    types = enc.get("token_type_ids") or [[0] * len(x) for x in ids]
    return ids, [list(t) for t in types]


def relevance(logits: np.ndarray) -> float:
    """A cross-encoder's relevance score from its logits: the sigmoid of the one logit (sentence-transformers'
    CrossEncoder with one label), else the softmax probability of the last label."""
    z = np.asarray(logits, np.float64)
    if z.shape[-1] == 1:
        return float(1.0 / (1.0 + np.exp(-z[0])))
    e = np.exp(z - z.max())
    return float(e[-1] / e.sum())


def finish(vector: np.ndarray, pooling: Pooling, dimensions: Optional[int]) -> np.ndarray:
    """The vector a client gets: L2-normalized when the model's pooling says so; with `dimensions`, its first
    `dimensions` values, normalized again (Matryoshka truncation, as OpenAI's ``dimensions``).

    Raises RequestError (400, param ``dimensions``) when `dimensions` exceeds the model's hidden size.
    """
    v = np.asarray(vector, np.float32)
    if dimensions is not None:
        if dimensions > v.shape[-1]:
            raise RequestError(f"'dimensions' {dimensions} exceeds this model's {v.shape[-1]}",
                               param="dimensions")
        v = v[:dimensions]
    if pooling.normalize or dimensions is not None:
        norm = float(np.linalg.norm(v))
        v = v / max(norm, 1e-12)  # (sentence-transformers' Normalize: torch's F.normalize, eps 1e-12)
    return v.astype(np.float32)


def encode_vector(v: np.ndarray, encoding_format: str) -> Union[List[float], str]:
    """OpenAI's ``embedding``: a list of floats, or (``base64``) the float32 little-endian bytes in base64."""
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(v, "<f4").tobytes()).decode("ascii")
    return [float(x) for x in v]
