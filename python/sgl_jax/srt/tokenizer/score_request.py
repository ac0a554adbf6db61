"""/v1/score: what is scored, and how the three algorithms lay it out (pure functions, no I/O).

For each item, the score is the next-token distribution after the scored sequence ``query + item``
(``item + query`` with item_first; ``query D item D`` with a delimiter token D, SGLang's multi-item
format), restricted to the label token ids: either each label's probability under the full vocabulary,
or (apply_softmax) a softmax over the labels' logits -- the same as a softmax over their log-probabilities.

Text is tokenized as the query and each item separately, without special tokens, and the tokenizer's
leading special tokens (BOS) are put once at the start of the whole sequence; token-id inputs are used
as given. So every algorithm scores exactly the same token sequences:

- serial: each scored sequence is an ordinary sequence; logits at its last position.
- packed: ``prefix + item_1 + item_2 + ...`` as one sequence, where prefix = special + query (+ D) and
  item_k = item tokens (+ D); each item sees the prefix and itself (a segment mask), and its rotary
  positions restart right after the prefix, so it is computed as if it stood alone after the query.
- prefill_extend: the prefix is prefilled once into a scoring-cache handle; each item extends it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import List, Optional, Sequence, Tuple, Union

from sgl_jax.srt.errors import RequestError
from sgl_jax.srt.io_struct import ScoreSeq

ALGORITHMS = ("auto", "serial", "packed", "prefill_extend")

TextOrIds = Union[str, List[int]]


@dataclasses.dataclass
class ScoreReqInput:
    """SGLang's /v1/score request: ``query`` and ``items`` as text or token ids, ``label_token_ids``,
    ``apply_softmax``, ``item_first``, ``model``; ``algorithm`` forces one of ALGORITHMS. ``use_delimiter``
    (not an HTTP field): False scores exactly ``query + item`` whatever --multi-item-scoring-delimiter says
    (/v1/rerank's templates)."""

    query: Optional[TextOrIds] = None
    items: Optional[List[TextOrIds]] = None
    label_token_ids: Optional[List[int]] = None
    apply_softmax: bool = False
    item_first: bool = False
    model: Optional[str] = None
    algorithm: Optional[str] = None
    rid: Optional[str] = None
    use_delimiter: bool = True
    lora_path: Optional[str] = None  # a loaded LoRA adapter's name (None: the base model)


def _is_ids(x) -> bool:
    return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)


def validate_score_input(obj: ScoreReqInput, vocab_size: int, max_items: int) -> None:
    """Check types and limits. Raises RequestError (400)."""
    if obj.query is None or obj.items is None or obj.label_token_ids is None:
        raise RequestError("'query', 'items' and 'label_token_ids' are required")
    if isinstance(obj.items, str):
        obj.items = [obj.items]  # a single text item (as SGLang accepts)
    if not isinstance(obj.items, list) or not obj.items:
        raise RequestError("'items' must be a non-empty list")
    if len(obj.items) > max_items:
        raise RequestError(f"{len(obj.items)} items exceed --max-multi-item-count ({max_items})")
    q_text = isinstance(obj.query, str)
    if not q_text and not _is_ids(obj.query):
        raise RequestError("'query' must be a string or a list of token ids")
    for item in obj.items:
        if not isinstance(item, (str, list)) or (not isinstance(item, str) and not _is_ids(item)):
            raise RequestError("'items' must be a list of strings or a list of token-id lists")
        if isinstance(item, str) != q_text:
            raise RequestError("'query' and 'items' must all be text or all be token-id lists (no mixing)")
        if len(item) == 0:
            raise RequestError("items must not be empty")
    if not q_text:
        for t in obj.query + [t for item in obj.items for t in item]:
            if not 0 <= t < vocab_size:
                raise RequestError(f"token id {t} is outside the vocabulary [0, {vocab_size})")
    if not _is_ids(obj.label_token_ids) or not obj.label_token_ids:
        raise RequestError("'label_token_ids' must be a non-empty list of token ids")
    bad = [t for t in obj.label_token_ids if not 0 <= t < vocab_size]
    if bad:
        raise RequestError(f"label_token_ids {bad[:5]} are outside the vocabulary [0, {vocab_size})")
    for name in ("apply_softmax", "item_first"):
        if not isinstance(getattr(obj, name), bool):
            raise RequestError(f"'{name}' must be a boolean")
    if obj.algorithm is not None and obj.algorithm not in ALGORITHMS:
        raise RequestError(f"'algorithm' must be one of {list(ALGORITHMS)}, got {obj.algorithm!r}")


def leading_special_tokens(tokenizer) -> List[int]:
    """The special tokens the tokenizer puts before a text (e.g. [BOS]); [] if none."""
    with_special = tokenizer.encode("a", add_special_tokens=True)
    plain = tokenizer.encode("a", add_special_tokens=False)
    for i in range(len(with_special)):
        if with_special[i:i + len(plain)] == plain:
            return list(with_special[:i])
    return []


def tokenize_score_input(tokenizer, obj: ScoreReqInput) -> Tuple[List[int], List[int], List[List[int]]]:
    """(special, query_ids, item_ids): text parts tokenized separately without special tokens."""
    if isinstance(obj.query, str):
        special = leading_special_tokens(tokenizer)
        query = tokenizer.encode(obj.query, add_special_tokens=False)
        items = [tokenizer.encode(t, add_special_tokens=False) for t in obj.items]
        return special, query, items
    return [], list(obj.query), [list(x) for x in obj.items]


def choose_algorithm(requested: Optional[str], server_default: str, item_first: bool,
                     prefill_extend_allowed: bool) -> str:
    """The algorithm for one request.

    Raises:
        RequestError: item_first forced onto a shared-query algorithm (the item precedes the query, so
            there is no shared prefix), or prefill_extend requested from a server that does not allow it
            (its scoring-cache handles hold request slots and KV, so the operator opts in).
    """
    algo = requested if requested not in (None, "auto") else server_default
    if algo == "auto":
        if item_first:
            return "serial"
        return "prefill_extend" if prefill_extend_allowed else "packed"
    if algo == "prefill_extend" and not prefill_extend_allowed:
        raise RequestError("algorithm 'prefill_extend' needs a server started with --enable-scoring-cache (or "
                           "--multi-item-enable-prefill-extend); use 'packed' or 'serial'")
    if item_first and algo != "serial":
        raise RequestError(f"item_first scoring needs the serial algorithm, not {algo}")
    return algo


@dataclasses.dataclass
class ScoreLayout:
    """The token sequences of one request. prefix: shared tokens (special + query (+ D)); segments: per
    item, the tokens after the prefix (item (+ D)); sequences: every scored sequence, in item order
    (with item_first only these are used)."""

    prefix: List[int]
    segments: List[List[int]]
    sequences: List[List[int]]

    @property
    def prompt_tokens(self) -> int:
        return sum(len(s) for s in self.sequences)


def build_layout(special: List[int], query: List[int], items: List[List[int]], item_first: bool,
                 delimiter: Optional[int]) -> ScoreLayout:
    d = [] if delimiter is None else [delimiter]
    if item_first:
        seqs = [special + item + d + query + d for item in items]
        return ScoreLayout([], [], seqs)
    prefix = special + query + d
    segments = [item + d for item in items]
    return ScoreLayout(prefix, segments, [prefix + seg for seg in segments])


def serial_seqs(layout: ScoreLayout) -> List[ScoreSeq]:
    return [ScoreSeq(input_ids=s, score_positions=[len(s) - 1]) for s in layout.sequences]


def extend_seqs(layout: ScoreLayout) -> List[ScoreSeq]:
    """prefill_extend items: tokens after the handle's prefix; positions count the prefix."""
    p = len(layout.prefix)
    return [ScoreSeq(input_ids=seg, score_positions=[p + len(seg) - 1]) for seg in layout.segments]


POOLING = ("last", "mean", "cls")


def _pooled_positions(start: int, n: int, pool: Optional[str]) -> List[int]:
    """The KV positions of a segment [start, start + n) that give its output: its last one (scoring, and
    last-token pooling), all of them (mean pooling) or its first (CLS pooling)."""
    if pool == "mean":
        return list(range(start, start + n))
    return [start] if pool == "cls" else [start + n - 1]


def pack_seqs(layout: ScoreLayout, max_pack_len: int,
              pool: Optional[str] = None) -> Tuple[List[ScoreSeq], List[Tuple[int, int]]]:
    """Pack the items after one copy of the prefix, each into the first pack with room for it (first-fit, in item
    order: packs of short items run nearly full, the step buckets they fill padded little), new packs of at most
    `max_pack_len` tokens as needed.

    `pool` (one of POOLING; embeddings, with an empty prefix): each item's hidden states at `_pooled_positions`
    are its output, and the packs' ``pool_index`` says which item each score position belongs to.
    Returns (packs, where): ``where[i] = (pack index, output index in that pack)`` for item i; a pack's items
    keep their order.
    Raises RequestError when the prefix and one item do not fit a pack.
    """
    prefix = layout.prefix
    p = len(prefix)
    packs: List[ScoreSeq] = []
    outputs: List[int] = []  # items in each pack
    where: List[Tuple[int, int]] = []
    for seg in layout.segments:
        if p + len(seg) > max_pack_len:
            raise RequestError(f"a scored sequence of {p + len(seg)} tokens exceeds the pack limit "
                               f"({max_pack_len} tokens)")
        k = next((k for k, pack in enumerate(packs) if len(pack.input_ids) + len(seg) <= max_pack_len), None)
        if k is None:
            packs.append(ScoreSeq(input_ids=list(prefix), score_positions=[], rope_positions=list(range(p)),
                                  segment_starts=[0] * p, prefix_len=p, pool_index=None if pool is None else []))
            outputs.append(0)
            k = len(packs) - 1
        cur = packs[k]
        start = len(cur.input_ids)
        cur.input_ids += seg
        cur.rope_positions += range(p, p + len(seg))
        cur.segment_starts += [start] * len(seg)
        positions = _pooled_positions(start, len(seg), pool)
        cur.score_positions += positions
        if pool is not None:
            cur.pool_index += [outputs[k]] * len(positions)
        where.append((k, outputs[k]))
        outputs[k] += 1
    return packs, where


def scores_from_logprobs(label_logprobs: Sequence[Sequence[float]], apply_softmax: bool) -> List[List[float]]:
    """Per item: exp(logprob) of each label, or a softmax over the labels (computed in float64)."""
    out = []
    for lps in label_logprobs:
        if apply_softmax:
            m = max(lps)
            e = [math.exp(x - m) for x in lps]
            total = sum(e)
            out.append([x / total for x in e])
        else:
            out.append([math.exp(x) for x in lps])
    return out


def chunks(seq: list, n: int) -> List[list]:
    return [seq[i:i + n] for i in range(0, len(seq), n)]
