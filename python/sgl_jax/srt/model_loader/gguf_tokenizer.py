"""An HF fast tokenizer rebuilt from a GGUF file's ``tokenizer.ggml.*`` metadata (no tokenizer.json needed).

Two of llama.cpp's tokenizer models are supported:

- ``gpt2``: byte-level BPE with the file's merges (SmolLM2, Llama 3, Qwen). The pre-tokenizer split pattern is
  picked from ``tokenizer.ggml.pre``.
- ``llama``: SentencePiece BPE with byte fallback, as written for Gemma (``tokenizer.ggml.add_space_prefix``
  false). The file has pieces and scores but no merges; the merges are derived from the pieces (see
  `sentencepiece_merges`).

The result equals transformers' own GGUF tokenizer (``AutoTokenizer.from_pretrained(dir, gguf_file=...)``) on
Gemma 3, and on SmolLM2 once that one is given llama.cpp's digit split for ``tokenizer.ggml.pre`` "smollm"
(transformers' converter gives every gpt2 vocabulary the plain GPT-2 pattern): test/srt/test_gguf_tokenizer.py,
on 303 strings of prose, code, Unicode and whitespace. A ``tokenizer.ggml.pre`` this module cannot reproduce
is refused (`UnsupportedGGUFTokenizer`) rather than approximated.
"""

from __future__ import annotations

from typing import List, Tuple

# GGUF token types (gguf-py TokenType)
_TOKEN_CONTROL = 3
_TOKEN_USER_DEFINED = 4

# SentencePiece's meta symbol: the normalized form of a space.
SPIECE_SPACE = "\u2581"

# Pre-tokenizer split patterns of llama.cpp's `tokenizer.ggml.pre` values (byte-level BPE vocabularies).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


# tokenizer.ggml.pre values of byte-level BPE vocabularies whose pre-tokenizer this module reproduces ("default"
# also stands for a file without the key: GPT-2's split, llama.cpp's fallback)
_BYTE_LEVEL_SPLITS = {"llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT, "smaug-bpe": _LLAMA3_SPLIT,
                      "qwen2": _QWEN2_SPLIT}
SUPPORTED_BYTE_LEVEL_PRE = tuple(sorted([*_BYTE_LEVEL_SPLITS, "smollm", "default", "gpt-2"]))


class UnsupportedGGUFTokenizer(ValueError):
    """The GGUF's tokenizer cannot be rebuilt faithfully (e.g. an unknown ``tokenizer.ggml.pre``): text would
    be split differently from llama.cpp and transformers. `--tokenizer-path` with an HF tokenizer avoids it."""


def sentencepiece_merges(pieces: List[str]) -> List[Tuple[str, str]]:
    """BPE merges, best first, that reproduce SentencePiece BPE over `pieces` (listed best first).

    SentencePiece BPE repeatedly joins the adjacent pair whose joined piece has the best score. The file lists
    the normal pieces in strictly decreasing score order, so a piece's position is its rank. (Control and
    user-defined pieces carry a placeholder score of -1000 written by llama.cpp's converter, so the position,
    not the score, is the rank that holds for every piece.) Each way of cutting a piece into two vocabulary
    pieces is one merge of that rank; among the cuts of one piece the longer left part comes first, the order
    HF's SentencePiece conversion uses.
    """
    vocab = set(pieces)
    merges = []
    for piece in pieces:
        for cut in range(len(piece) - 1, 0, -1):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                merges.append((left, right))
    return merges


def _byte_level_bpe(meta, tokens, types):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    tk = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in SUPPORTED_BYTE_LEVEL_PRE:
        raise UnsupportedGGUFTokenizer(
            f"GGUF tokenizer.ggml.pre {pre!r} is not supported (supported: {', '.join(SUPPORTED_BYTE_LEVEL_PRE)}): "
            f"its pre-tokenizer would split text differently from llama.cpp and transformers; pass "
            f"--tokenizer-path with the model's HF tokenizer (a directory or hub id)")
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    split = _BYTE_LEVEL_SPLITS.get(pre)
    if split is not None:
        tk.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False),
        ])
    elif pre == "smollm":
        tk.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    else:
        tk.pre_tokenizer = byte_level
    tk.decoder = decoders.ByteLevel()
    return tk, tokens, set()


def _sentencepiece_bpe(meta, tokens, types):
    """SentencePiece BPE with byte fallback (Gemma).

    llama.cpp's converter writes user-defined pieces with the meta symbol turned back into spaces (Gemma's
    whitespace runs are stored as "  ", "   ", ...); they are respelled with the meta symbol so that they are
    ordinary BPE pieces of the normalized text again.
    """
    from tokenizers import Tokenizer, decoders, models, normalizers

    if meta.get("tokenizer.ggml.add_space_prefix", True):
        raise NotImplementedError(
            "SentencePiece GGUF vocabularies with add_space_prefix (Llama 2 / Mistral style) are not supported; "
            "only Gemma's (no space prefix)"
        )
    pieces = list(tokens)
    respelled = set()
    for i, ty in enumerate(types):
        if ty == _TOKEN_USER_DEFINED and " " in tokens[i]:
            pieces[i] = tokens[i].replace(" ", SPIECE_SPACE)
            respelled.add(i)
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    tk = Tokenizer(models.BPE(
        vocab={p: i for i, p in enumerate(pieces)}, merges=sentencepiece_merges(pieces),
        unk_token=pieces[int(unk_id)] if unk_id is not None else None, fuse_unk=True, byte_fallback=True,
    ))
    tk.normalizer = normalizers.Replace(" ", SPIECE_SPACE)
    tk.decoder = decoders.Sequence([decoders.Replace(SPIECE_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()])
    return tk, pieces, respelled


_BUILDERS = {"gpt2": _byte_level_bpe, "llama": _sentencepiece_bpe}


def build_gguf_tokenizer(reader):
    """A `transformers.PreTrainedTokenizerFast` rebuilt from the GGUF vocabulary and special tokens of
    `reader` (a `gguf_reader.GGUFFile`).

    Control tokens become special added tokens; user-defined tokens (e.g. Gemma's newline runs and HTML tags)
    become plain added tokens, matched whole, unless they are BPE pieces of the normalized text (Gemma's space
    runs). BOS / EOS are added per ``tokenizer.ggml.add_bos_token`` / ``add_eos_token``; the chat template is
    ``tokenizer.chat_template`` (None when the file has none).

    Raises:
        NotImplementedError: a ``tokenizer.ggml.model`` other than ``gpt2`` and ``llama``, or a ``llama``
            vocabulary with a space prefix.
        UnsupportedGGUFTokenizer: a ``gpt2`` vocabulary whose ``tokenizer.ggml.pre`` is not in
            `SUPPORTED_BYTE_LEVEL_PRE` (llama.cpp names dozens; a wrong split would silently change every
            prompt's tokens).
    """
    from tokenizers import AddedToken, processors
    from transformers import PreTrainedTokenizerFast

    meta = reader.metadata
    kind = meta.get("tokenizer.ggml.model")
    if kind not in _BUILDERS:
        raise NotImplementedError(
            f"GGUF tokenizer model {kind!r} is not supported (supported: {sorted(_BUILDERS)})"
        )
    tokens = list(meta["tokenizer.ggml.tokens"])
    types = [int(t) for t in meta["tokenizer.ggml.token_type"]]
    # builder -> (tokenizer, the pieces as its vocabulary spells them, ids of user-defined pieces left to BPE)
    tk, pieces, bpe_pieces = _BUILDERS[kind](meta, tokens, types)
    tk.add_special_tokens([
        AddedToken(pieces[i], special=True, normalized=False) for i, t in enumerate(types) if t == _TOKEN_CONTROL
    ])
    tk.add_tokens([
        AddedToken(pieces[i], special=False, normalized=False)
        for i, t in enumerate(types) if t == _TOKEN_USER_DEFINED and i not in bpe_pieces
    ])

    def special_id(key):
        idx = meta.get(f"tokenizer.ggml.{key}")
        return int(idx) if idx is not None and int(idx) < len(pieces) else None

    def special(key):
        idx = special_id(key)
        return None if idx is None else pieces[idx]

    bos_id, eos_id = special_id("bos_token_id"), special_id("eos_token_id")
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False)) and bos_id is not None
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False)) and eos_id is not None
    if add_bos or add_eos:
        def template(seq: str, type_id: int) -> str:
            return " ".join(([f"{pieces[bos_id]}:{type_id}"] if add_bos else []) + [f"${seq}:{type_id}"]
                            + ([f"{pieces[eos_id]}:{type_id}"] if add_eos else []))

        tk.post_processor = processors.TemplateProcessing(
            single=template("A", 0), pair=f"{template('A', 0)} {template('B', 1)}",
            special_tokens=[(pieces[i], i) for i, on in ((bos_id, add_bos), (eos_id, add_eos)) if on],
        )
    return PreTrainedTokenizerFast(
        tokenizer_object=tk,
        bos_token=special("bos_token_id"),
        eos_token=special("eos_token_id"),
        unk_token=special("unknown_token_id"),
        pad_token=special("padding_token_id"),
        chat_template=meta.get("tokenizer.chat_template"),
        add_bos_token=add_bos,
        add_eos_token=add_eos,
        clean_up_tokenization_spaces=False,
    )
