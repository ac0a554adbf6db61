"""Next-token sampling on device: penalties, logit bias, grammar masks, greedy, temperature, top-k, top-p
(nucleus), min-p, typical-p, per-request seeds.

Semantics follow SGLang's sampler: temperature 0 (or top_k 1) is greedy argmax; otherwise logits are
divided by the temperature and filtered by top-k, top-p (keep the smallest prefix of tokens, by
probability, whose mass reaches top_p; Holtzman et al. 2019), min-p (keep tokens with probability
>= min_p * max probability) and typical-p (keep the locally typical set of mass typical_p; Meister et al. 2022),
each computed on the whole temperature-scaled distribution and the kept sets intersected. A row's token is drawn by
inversion of its distribution's CDF with one uniform number (`draw`); each request draws that number from its own
stream, fold_in(key(seed), step), so a seeded request samples the same tokens alone or inside any batch.

Before that, in this order (`adjust_logits`): repetition penalty over prompt + output tokens (CTRL, Keskar
et al. 2019: a positive logit is divided by it, a negative one multiplied), frequency and presence penalties
over output tokens (OpenAI / vLLM / SGLang: logit -= frequency * count + presence * [count > 0]), logit_bias
(OpenAI: added), then the grammar's vocabulary bitmask (disallowed tokens get -inf). The history these need
lives on device in a `PenaltyState` indexed by request slot (ReqToTokenPool row), so the batch's shapes never
change and no per-step transfer grows with the output; every row is computed from its own slot, so results
do not depend on the batch.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp

from sgl_jax.srt.sampling.sampling_batch import SamplingBatch

NEG_INF = -jnp.inf


SAMPLE_BLOCK = 256  # vocabulary entries per block of the two-level inverse-CDF draw (`draw`)


def _row_uniform(seed: jax.Array, step: jax.Array) -> jax.Array:
    key = jax.random.fold_in(jax.random.key(seed.astype(jnp.uint32)), step)
    return jax.random.uniform(key, (), jnp.float32)


def uniforms(meta: SamplingBatch) -> jax.Array:
    """float32[S] in [0, 1): one number per row from its request's stream fold_in(key(seed), step)."""
    return jax.vmap(_row_uniform)(meta.seeds, meta.steps)


def _blocks(x: jax.Array, fill: float) -> jax.Array:
    """float32[S, V] -> [S, ceil(V / SAMPLE_BLOCK), SAMPLE_BLOCK], the tail block padded with `fill`."""
    S, V = x.shape
    nb = -(-V // SAMPLE_BLOCK)
    return jnp.pad(x, ((0, 0), (0, nb * SAMPLE_BLOCK - V)), constant_values=fill).reshape(S, nb, SAMPLE_BLOCK)


def _last_positive(x: jax.Array) -> jax.Array:
    """int32[...]: index of the last entry > 0 along the last axis (0 when none)."""
    idx = jnp.arange(x.shape[-1], dtype=jnp.int32)
    return jnp.max(jnp.where(x > 0, idx, 0), axis=-1)


def draw(logits: jax.Array, u: jax.Array, temperature: Optional[jax.Array] = None) -> jax.Array:
    """Draw one token per row from softmax(logits / temperature) by inverting its CDF at u (inverse transform
    sampling).

    Args:
        logits: float32[S, V] (-inf: never drawn; a row holding +inf draws among its +inf entries only).
        u: float32[S] uniform in [0, 1).
        temperature: float32[S] > 0, or None for 1 (applied inside, so no scaled copy of the logits is written).
    Returns:
        int32[S]: the first token whose cumulative probability exceeds u, so token j has probability
        p_j / sum(p) up to float32 rounding; a token of probability 0 is never returned.

    Two levels keep it to a few passes over the row: the cumulative mass of blocks of SAMPLE_BLOCK tokens picks
    the block, then the cumulative mass inside that block picks the token. One random number per row instead of
    one per vocabulary entry (Gumbel-max): on a 2-core CPU, 64 x 49,152 took ~2 ms against ~60 ms.
    """
    B = SAMPLE_BLOCK
    top = jnp.max(logits, axis=-1, keepdims=True)
    # a row holding +inf (a near-zero repetition penalty divides by ~0) draws uniformly among its +inf entries,
    # the limit of its softmax (inf - inf would make the masses NaN)
    logits = jnp.where(top == jnp.inf, jnp.where(logits == jnp.inf, 0.0, NEG_INF), logits)
    top = jnp.where(jnp.isfinite(top), top, 0.0)
    inv_t = 1.0 if temperature is None else (1.0 / temperature)[:, None]
    p = jnp.where(logits == NEG_INF, 0.0, jnp.exp((logits - top) * inv_t))  # (1 / a huge temperature may be 0)
    p = _blocks(p, 0.0)
    block_mass = jnp.sum(p, axis=-1)  # [S, nb]
    block_cum = jnp.cumsum(block_mass, axis=-1)
    target = u * block_cum[:, -1]
    blk = jnp.minimum(jnp.sum(block_cum <= target[:, None], axis=-1), _last_positive(block_mass))
    before = jnp.where(blk > 0, jnp.take_along_axis(block_cum, jnp.maximum(blk - 1, 0)[:, None], axis=-1)[:, 0], 0.0)
    rows = jnp.take_along_axis(p, blk[:, None, None], axis=1)[:, 0]  # [S, B]
    cum = before[:, None] + jnp.cumsum(rows, axis=-1)
    idx = jnp.minimum(jnp.sum(cum <= target[:, None], axis=-1), _last_positive(rows))
    return (blk * B + idx).astype(jnp.int32)


def first_argmax(x: jax.Array) -> jax.Array:
    """int32[S]: the index of each row's largest entry of float32[S, V], the first on ties (as jnp.argmax).

    In two levels over blocks of SAMPLE_BLOCK entries (the first block holding the row's maximum, then the first
    maximum inside it): inside the sampling step on a 2-core CPU, 64 x 49,152 took ~2 ms where jnp.argmax took ~7
    and a max-then-first-index formulation ~20 (XLA materialised the broadcast maximum)."""
    blocks = _blocks(x, NEG_INF)
    blk = jnp.argmax(jnp.max(blocks, axis=-1), axis=-1)
    idx = jnp.argmax(jnp.take_along_axis(blocks, blk[:, None, None], axis=1)[:, 0], axis=-1)
    return (blk * SAMPLE_BLOCK + idx).astype(jnp.int32)


def _typical_keep(scaled: jax.Array, typical_p: jax.Array) -> jax.Array:
    """bool[S, V] (vocabulary order): the locally typical set of each row (Meister et al. 2022), as transformers'
    TypicalLogitsWarper computes it: tokens ordered by their shift |-log p - entropy|, ascending; the boundary
    token is the first whose cumulative mass reaches typical_p, and every token whose shift is at most the
    boundary's stays (ties included). typical_p 1 keeps all."""
    V = scaled.shape[1]
    logp = jax.nn.log_softmax(scaled, axis=-1)
    p = jnp.exp(logp)
    entropy = -jnp.sum(jnp.where(p > 0, p * logp, 0.0), axis=-1, keepdims=True)
    shift = jnp.abs(-logp - entropy)
    order = jnp.argsort(shift, axis=-1)
    sorted_shift = jnp.take_along_axis(shift, order, axis=-1)
    cum = jnp.cumsum(jnp.take_along_axis(p, order, axis=-1), axis=-1)
    last = jnp.minimum(jnp.sum(cum < typical_p[:, None], axis=-1), V - 1)
    return shift <= jnp.take_along_axis(sorted_shift, last[:, None], axis=-1)


# Candidate counts tried, in order, before the threshold search over whole rows (`_sample_filtered`). On a 2-core
# CPU XLA sorts a 49,152-entry row in ~13 ms (a speculative verify step of 256 top-p rows spent 3.3 s there);
# lax.top_k of 128 of them costs ~0.15 ms, and the threshold search (`_kept_by_threshold`) ~1.5 ms. A filtering
# step of 16 top-p 0.95 rows at temperature 0.8 took 11 ms (logits drawn at standard deviation 6: the candidates
# hold the set) and 27 ms (at 2: the search) against the sort's ~225 ms.
CANDIDATE_TIERS = (128,)
SORT_FREE = True  # False: every filtering step sorts whole rows (the reference the tests compare with)


def _kept_candidates(sorted_scaled: jax.Array, lse: jax.Array, meta: SamplingBatch, V: int):
    """(keep bool[S, K], fits bool[S]) for each row's K most likely tokens, most likely first (`sorted_scaled`:
    their temperature-scaled logits; `lse`: float32[S], the log-sum-exp of the whole scaled row): the top-k, top-p
    and min-p sets, and whether the row keeps no token beyond these K (so its kept set is exact): top_k <= K, or
    the K tokens' mass already reaches top_p, or the K-th one falls below min_p. K = V always fits."""
    K = sorted_scaled.shape[1]
    probs = jnp.exp(sorted_scaled - lse[:, None])
    rank = jnp.arange(K)[None, :]
    top_k = jnp.where(meta.params["top_k"] > 0, meta.params["top_k"], V)
    keep = rank < top_k[:, None]
    mass = jnp.cumsum(probs, axis=-1)
    keep &= (mass - probs) < meta.params["top_p"][:, None]
    min_prob = meta.params["min_p"] * probs[:, 0]
    keep &= probs >= min_prob[:, None]
    keep = keep.at[:, 0].set(True)  # (the most likely token survives top-k, top-p and min-p)
    if K == V:
        return keep, jnp.ones(keep.shape[:1], bool)
    fits = (top_k <= K) | (mass[:, -1] >= meta.params["top_p"]) | (probs[:, -1] < min_prob)
    return keep, fits


def _order_key(x: jax.Array) -> jax.Array:
    """int32 keys ordered as the float32 values `x` are (-0.0 taken as 0.0): a search over keys is one over values."""
    i = jax.lax.bitcast_convert_type(x + 0.0, jnp.int32)
    return jnp.where(i < 0, i ^ 0x7FFFFFFF, i)


def _key_value(key: jax.Array) -> jax.Array:
    """The float32 value of an `_order_key` key."""
    return jax.lax.bitcast_convert_type(jnp.where(key < 0, key ^ 0x7FFFFFFF, key), jnp.float32)


def _boundary(scaled: jax.Array, weight: jax.Array, target: jax.Array) -> jax.Array:
    """float32[S]: per row the largest value v of `scaled` [S, V] whose entries >= v weigh (`weight` summed) at
    least `target` [S]: the value of the boundary token in the row's descending order. A search over the values'
    `_order_key`s, 32 halvings of [min, max + 1] (one pass over the row each); the row's minimum when even the
    whole row falls short (a rounded mass below a top_p near 1)."""
    lo, hi = _order_key(jnp.min(scaled, axis=-1)), _order_key(jnp.max(scaled, axis=-1)) + 1

    def halve(_, bounds):
        lo, hi = bounds
        mid = (lo >> 1) + (hi >> 1) + (lo & hi & 1)  # floor((lo + hi) / 2) without int32 overflow
        meets = jnp.sum(jnp.where(scaled >= _key_value(mid)[:, None], weight, 0.0), axis=-1) >= target
        return jnp.where(meets, mid, lo), jnp.where(meets, hi, mid)

    return _key_value(jax.lax.fori_loop(0, 32, halve, (lo, hi))[0])


def _kept_by_threshold(scaled: jax.Array, lse: jax.Array, meta: SamplingBatch, V: int) -> jax.Array:
    """bool[S, V] (vocabulary order): the top-k, top-p and min-p sets `_kept_candidates` computes on sorted rows,
    found without sorting: each set's boundary value by `_boundary`, every token above it kept, and the tokens tied
    with it kept in id order (the sort's order) while the set's rule still admits them. The most likely token (the
    first on ties) always stays."""
    probs = jnp.exp(scaled - lse[:, None])
    top_p, min_p = meta.params["top_p"], meta.params["min_p"]
    top_k = jnp.where(meta.params["top_k"] > 0, jnp.minimum(meta.params["top_k"], V), V)

    def by_top_p():
        v = _boundary(scaled, probs, top_p)
        tie = scaled == v[:, None]
        mass_above = jnp.sum(jnp.where(scaled > v[:, None], probs, 0.0), axis=-1, keepdims=True)
        mass_before = mass_above + (jnp.cumsum(tie, axis=-1) - 1) * jnp.exp(v - lse)[:, None]
        return (scaled > v[:, None]) | (tie & (mass_before < top_p[:, None])) | (top_p >= 1.0)[:, None]

    def by_top_k():
        v = _boundary(scaled, jnp.ones_like(scaled), top_k.astype(jnp.float32))
        tie = scaled == v[:, None]
        above = jnp.sum(scaled > v[:, None], axis=-1, keepdims=True)
        return (scaled > v[:, None]) | (tie & (jnp.cumsum(tie, axis=-1) <= top_k[:, None] - above))

    everything = lambda: jnp.ones(scaled.shape, bool)  # noqa: E731
    keep = jax.lax.cond(jnp.any(top_p < 1.0), by_top_p, everything)
    keep &= jax.lax.cond(jnp.any(top_k < V), by_top_k, everything)
    keep &= probs >= (min_p * jnp.exp(jnp.max(scaled, axis=-1) - lse))[:, None]
    return keep | (jnp.arange(V)[None, :] == first_argmax(scaled)[:, None])


def _sample_filtered(logits: jax.Array, temperature: jax.Array, meta: SamplingBatch, filters: jax.Array,
                     u: jax.Array) -> jax.Array:
    """Sample from softmax(logits / temperature) after top-k / top-p / min-p / typical-p filtering. The kept set
    goes back to vocabulary order and the draw is `draw`'s, as for unfiltered rows, so a row that filters nothing
    draws the same token in either branch (its token does not depend on the other rows of the batch).

    The kept sets come from each row's CANDIDATE_TIERS most likely tokens (lax.top_k) when every filtering row's
    set lies inside them (`_kept_candidates`), the next tier when not, and a threshold search over whole rows last
    (`_kept_by_threshold`); a row that uses typical_p sorts whole rows (as SORT_FREE False does for every row). Each
    way keeps the same tokens, up to float rounding of the masses: the sort's order with its ties (the lower id
    first, as top_k's). `filters`: bool[S], the rows whose token is taken from here and whose kept set is cut
    (`sample`'s: not greedy, and some filter on); the others keep every token. `u`: float32[S], each row's uniform
    (`uniforms`), drawn once by `sample` for both branches that draw."""
    S, V = logits.shape
    scaled = logits / temperature[:, None]
    lse = jax.nn.logsumexp(scaled, axis=-1)
    rows = jnp.arange(S)[:, None]

    def draw_kept(keep, ids=None):  # (ids None: `keep` is in vocabulary order already)
        keep_by_id = keep if ids is None else jnp.zeros((S, V), bool).at[rows, ids].set(keep)
        return draw(jnp.where(keep_by_id | ~filters[:, None], logits, NEG_INF), u, temperature)

    def whole_rows():
        order = jnp.argsort(-scaled, axis=-1)
        keep, _ = _kept_candidates(jnp.take_along_axis(scaled, order, axis=-1), lse, meta, V)
        typical_p = meta.params["typical_p"]
        keep &= jax.lax.cond(jnp.any(typical_p < 1.0),
                             lambda: jnp.take_along_axis(_typical_keep(scaled, typical_p), order, axis=-1),
                             lambda: jnp.ones((S, V), bool))
        keep = keep | (~jnp.any(keep, axis=-1, keepdims=True) & (jnp.arange(V) == 0)[None, :])  # never empty
        return draw_kept(keep, order)

    def tier(k, otherwise):
        def run():
            values, ids = jax.lax.top_k(scaled, k)
            keep, fits = _kept_candidates(values, lse, meta, V)
            return jax.lax.cond(jnp.all(fits | ~filters), lambda: draw_kept(keep, ids), otherwise)
        return run

    if not SORT_FREE:
        return whole_rows()
    chain = lambda: draw_kept(_kept_by_threshold(scaled, lse, meta, V))  # noqa: E731
    for k in sorted((k for k in CANDIDATE_TIERS if k < V), reverse=True):
        chain = tier(k, chain)
    return jax.lax.cond(jnp.any(filters & (meta.params["typical_p"] < 1.0)), whole_rows, chain)


@dataclasses.dataclass
class PenaltyState:
    """Per request slot token history for penalties and the slot's logit bias, on device (R slots, V vocab).

    counts: int32[R, V] occurrences of each token in the slot's output so far.
    seen: bool[R, V] tokens of the prompt and of the output at initialisation (repetition penalty).
    bias: float32[R, V] the request's logit_bias as a dense row.
    last_counted: int32[R] index (in the output) of the last output token counted; updates carry the index
        of the token they add, so re-running a step (fault isolation) never counts a token twice.

    A row is (re)initialised from the host by `init_penalty_row` when a request with penalties or a bias
    takes the slot (admission, or re-admission after a retract); rows of other requests hold garbage that
    is never read (``SamplingBatch.penalized`` is false for them).
    """

    counts: jax.Array
    seen: jax.Array
    bias: jax.Array
    last_counted: jax.Array


jax.tree_util.register_dataclass(PenaltyState)  # every field a leaf (the fields follow from the dataclass)


def new_penalty_state(num_slots: int, vocab: int) -> PenaltyState:
    """Zeroed state for `num_slots` request slots (bytes: num_slots * vocab * 9)."""
    return PenaltyState(counts=jnp.zeros((num_slots, vocab), jnp.int32), seen=jnp.zeros((num_slots, vocab), bool),
                        bias=jnp.zeros((num_slots, vocab), jnp.float32),
                        last_counted=jnp.full((num_slots,), -1, jnp.int32))


def init_penalty_row(state: PenaltyState, slot: jax.Array, token_ids: jax.Array, num_prompt: jax.Array,
                     num_tokens: jax.Array, bias_row: jax.Array) -> PenaltyState:
    """Set slot `slot` from a request's tokens.

    Args:
        slot: int32[] the request's ReqToTokenPool row.
        token_ids: int32[L] prompt then output tokens, padded to L (the context length) with anything.
        num_prompt: int32[] prompt tokens; num_tokens: int32[] prompt + output tokens (<= L).
        bias_row: float32[V] logit_bias as a dense row (zeros: none).
    """
    pos = jnp.arange(token_ids.shape[0])
    valid = pos < num_tokens
    out = valid & (pos >= num_prompt)
    V = state.counts.shape[1]
    seen = jnp.zeros((V,), bool).at[token_ids].max(valid)
    counts = jnp.zeros((V,), jnp.int32).at[token_ids].add(out.astype(jnp.int32))
    return PenaltyState(counts=state.counts.at[slot].set(counts), seen=state.seen.at[slot].set(seen),
                        bias=state.bias.at[slot].set(bias_row),
                        last_counted=state.last_counted.at[slot].set(num_tokens - num_prompt - 1))


def count_last_tokens(state: PenaltyState, meta: SamplingBatch) -> PenaltyState:
    """Add each penalized row's newest output token (``last_token`` at output index ``last_token_index``)
    to its slot's counts, once."""
    add = meta.penalized & (meta.last_token_index > state.last_counted[meta.slots])
    counts = state.counts.at[meta.slots, meta.last_token].add(add.astype(jnp.int32))
    last = state.last_counted.at[meta.slots].max(jnp.where(add, meta.last_token_index, -1))
    return dataclasses.replace(state, counts=counts, last_counted=last)


def _penalize(logits: jax.Array, state: PenaltyState, meta: SamplingBatch) -> jax.Array:
    counts = state.counts[meta.slots]
    in_output = counts > 0
    seen = state.seen[meta.slots] | in_output
    rep = meta.params["repetition_penalty"][:, None]
    out = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
    out = (out - meta.params["frequency_penalty"][:, None] * counts.astype(jnp.float32)
           - meta.params["presence_penalty"][:, None] * in_output.astype(jnp.float32))
    out = out + state.bias[meta.slots]
    return jnp.where(meta.penalized[:, None], out, logits)


def _mask_vocab(logits: jax.Array, meta: SamplingBatch) -> jax.Array:
    V = logits.shape[1]
    idx = jnp.arange(V, dtype=jnp.int32)
    words = jnp.asarray(meta.vocab_mask)[:, idx // 32]
    allowed = ((words >> (idx % 32)[None, :]) & 1) == 1
    return jnp.where(allowed | ~meta.constrained[:, None], logits, NEG_INF)


def adjust_logits(logits: jax.Array, state: PenaltyState, meta: SamplingBatch) -> jax.Array:
    """Penalties, logit bias and grammar masks (see the module docstring); each skipped at run time when no
    row of the batch uses it. float32[S, V] -> float32[S, V]."""
    logits = jax.lax.cond(jnp.any(meta.penalized), lambda x: _penalize(x, state, meta), lambda x: x, logits)
    return jax.lax.cond(jnp.any(meta.constrained), lambda x: _mask_vocab(x, meta), lambda x: x, logits)


def sample(logits: jax.Array, meta: SamplingBatch, eos_token_ids: jax.Array, state: PenaltyState,
           filtering: bool = True):
    """Pick the next token of every row.

    Args:
        logits: float32[S, V] next-token logits.
        meta: per-row parameters (see SamplingBatch).
        eos_token_ids: int32[E] ids masked for rows with ``suppress_eos``.
        state: the penalty state (see PenaltyState); updated with each row's newest output token.
        filtering: trace the top-k / top-p / min-p / typical-p branch (`_sample_filtered`). False leaves it out of
            the program, for steps whose caller knows no row filters (`SamplingParams.filters` of each row false):
            a row that filters would then draw from its whole distribution. Every other row draws the same token
            either way. (XLA's CPU runtime allocates each constant buffer of a program at every execution, taken
            branch or not; the branch held ~40 of a decode step's ~70: issue #69.)
    Returns:
        (next_token_ids int32[S], lse float32[S], state) where lse is the log-sum-exp of each row's raw logits, so
        ``logits - lse[:, None]`` is the log-softmax of the raw logits (before penalties, masks, temperature and
        filtering), the distribution `return_logprob` reports. (The full log-softmax is not materialised here: on
        a 2-core CPU it cost ~8 ms a step at 64 x 49,152, and most steps read one logprob per row.)
    """
    S, V = logits.shape
    lse = jax.nn.logsumexp(logits, axis=-1)
    state = count_last_tokens(state, meta)
    is_eos = jnp.zeros((V,), bool).at[eos_token_ids].set(True)

    def adjusted(x):
        x = adjust_logits(x, state, meta)
        return jnp.where(meta.suppress_eos[:, None] & is_eos[None, :], NEG_INF, x)

    # one conditional for every adjustment: most steps have none, and each [S, V] pass or pass-through copy costs
    # ~1.5-3.5 ms at 64 x 49,152 on a 2-core CPU
    uses = jnp.any(meta.penalized) | jnp.any(meta.constrained) | jnp.any(meta.suppress_eos)
    logits = jax.lax.cond(uses, adjusted, lambda x: x, logits)
    greedy_rows = (meta.params["temperature"] <= 0.0) | (meta.params["top_k"] == 1)
    greedy = first_argmax(logits)
    top_k = meta.params["top_k"]
    needs_filter = ((meta.params["top_p"] < 1.0) | ((top_k > 0) & (top_k < V)) | (meta.params["min_p"] > 0.0)
                    | (meta.params["typical_p"] < 1.0))
    filters = needs_filter & ~greedy_rows
    branch = jnp.where(jnp.all(greedy_rows), 0, jnp.where(jnp.any(filters), 2, 1))

    temperature = jnp.where(greedy_rows, 1.0, meta.params["temperature"])
    # one copy of the threefry draw outside the branches, not one in each draw site: XLA's CPU runtime allocates
    # every constant buffer of a program (threefry's rolled loops hold several) at each execution, ~1 us apiece in
    # the scheduler (issue #69); the numbers drawn are the same
    u = uniforms(meta)
    branches = [lambda: greedy, lambda: draw(logits, u, temperature)]
    if filtering:
        branches.append(lambda: _sample_filtered(logits, temperature, meta, filters, u))
    sampled = jax.lax.switch(jnp.minimum(branch, len(branches) - 1), branches)
    next_ids = jnp.where(greedy_rows, greedy, sampled).astype(jnp.int32)
    return next_ids, lse, state
