"""Memory preflight: can a request ever fit this server? One function for every path that admits work.

A request whose prompt fits the context but whose prompt plus its least output cannot fit the KV pool even
with every cached prefix evicted would wait forever (or be retracted forever): it is refused at once with
HTTP 413 and both numbers. Used by the TokenizerManager (generation, before and after tokenizing), the
score client (/v1/score: each scored sequence, query + largest item for prefill_extend) and the scheduler
(the whole prompt of a session's turn, which only it sees; score and scoring-cache messages).

The lesson follows oMLX's prefill guard: check what the pool can hold before queueing work, not after.
"""

from __future__ import annotations

import dataclasses

from sgl_jax.srt.errors import RequestError


@dataclasses.dataclass(frozen=True)
class KVLimits:
    """What one request may use on this server (one DP rank's pool: a request lives on one rank).

    context_len: the model's context length (tokens).
    max_req_input_len: the longest prompt one prefill takes (tokens): the largest compiled extend bucket,
        or context_len - 1 with chunked prefill.
    kv_pool_tokens: the KV pool's capacity (tokens, whole pages) of one rank.
    page_size: tokens per KV page.
    """

    context_len: int
    max_req_input_len: int
    kv_pool_tokens: int
    page_size: int = 1

    @classmethod
    def from_info(cls, info) -> "KVLimits":
        """From what the scheduler reported when ready (`io_struct.SchedulerInfo`)."""
        return cls(info.context_len, info.max_req_input_len, info.max_total_tokens, info.page_size)


def kv_tokens_needed(prompt_tokens: int, min_output: int, num_seqs: int, page_size: int) -> int:
    """KV tokens (whole pages) that `num_seqs` sequences of one prompt need at once, each with `min_output`
    tokens of output: the first holds ceil((prompt + out) / page_size) pages; the others share the prompt's
    full pages through the prefix cache and add the rest."""
    per_seq = -(-(prompt_tokens + min_output) // page_size)
    shared = prompt_tokens // page_size
    return (per_seq + (num_seqs - 1) * (per_seq - shared)) * page_size


def check_fits(limits: KVLimits, prompt_tokens: int, *, min_output: int = 1, num_seqs: int = 1,
               what: str = "The input", at_least: bool = False) -> None:
    """Refuse a request that can never run on this server.

    Args:
        limits: the server's `KVLimits`.
        prompt_tokens: the prompt's length in tokens (a lower bound when `at_least`: text not yet tokenized).
        min_output: the fewest output tokens it needs KV for (1 for generation -- its first sampled token;
            ``min_new_tokens`` when larger).
        num_seqs: sequences of this prompt admitted together (a request's n / best_of fan-out).
        what: how the error names the input ("The input", "a scored sequence", ...).
    Raises:
        RequestError: 413 when the prompt exceeds the largest prefill, or when prompt + `min_output`
            (for each of `num_seqs` sequences, sharing the prompt) needs more KV than the whole pool.
    """
    n = f"{'at least ' if at_least else ''}{prompt_tokens} tokens"
    if prompt_tokens > limits.max_req_input_len:
        raise RequestError(f"{what} ({n}) exceeds the largest prefill this server compiled "
                           f"({limits.max_req_input_len} tokens); raise --precompile-token-paddings or use "
                           "chunked prefill", 413)
    need = kv_tokens_needed(prompt_tokens, min_output, num_seqs, limits.page_size)
    if need > limits.kv_pool_tokens:
        seqs = f" for each of {num_seqs} sequences sharing the prompt" if num_seqs > 1 else ""
        raise RequestError(f"{what} ({n}) plus at least {min_output} output token(s){seqs} needs {need} KV "
                           f"tokens, but the KV pool holds {limits.kv_pool_tokens} tokens even with every cached "
                           "prefix evicted", 413)
