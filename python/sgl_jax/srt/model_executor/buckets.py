"""Shape buckets: the padded (T tokens, S sequences) shapes compiled at start-up, chosen in one place.

Extend batches are keyed by T only: their S is derived from T (the smallest batch-size padding that
holds min(T, largest batch-size padding) sequences), because attention work follows the real sequences
and only the logits/sampling rows grow with S. Decode batches are keyed by S (T == S). With speculative decoding,
verify batches (TARGET_VERIFY) are keyed by S too: T == S x draft slots per request, every token a sampling row.
"""

from __future__ import annotations

import bisect
import dataclasses
from typing import List, Optional, Tuple

from sgl_jax.srt.forward_batch import ForwardMode


def _smallest_at_least(sorted_values: List[int], n: int) -> int:
    i = bisect.bisect_left(sorted_values, n)
    if i == len(sorted_values):
        raise ValueError(f"{n} exceeds the largest bucket {sorted_values[-1]}")
    return sorted_values[i]


@dataclasses.dataclass(frozen=True)
class ShapeBuckets:
    """token_paddings: sorted extend token counts; bs_paddings: sorted batch sizes; verify_tokens: draft-tree
    slots per request of a verify step (--speculative-num-draft-tokens; 0: no speculative decoding)."""

    token_paddings: Tuple[int, ...]
    bs_paddings: Tuple[int, ...]
    verify_tokens: int = 0

    @property
    def max_tokens(self) -> int:
        return self.token_paddings[-1]

    @property
    def max_bs(self) -> int:
        return self.bs_paddings[-1]

    def extend_bs(self, padded_tokens: int) -> int:
        return _smallest_at_least(list(self.bs_paddings), min(padded_tokens, self.max_bs))

    def extend_shape(self, num_tokens: int, num_seqs: int) -> Tuple[int, int]:
        """(T_pad, S_pad) for an extend batch. Raises ValueError when nothing holds it."""
        for t in self.token_paddings:
            if t >= num_tokens and self.extend_bs(t) >= num_seqs:
                return t, self.extend_bs(t)
        raise ValueError(f"no extend bucket holds {num_tokens} tokens in {num_seqs} sequences")

    def extend_cut(self, num_tokens: int, page_size: int = 1) -> Optional[int]:
        """Where to cut an extend batch of `num_tokens` tokens (in one sequence's bucket) so that it pays for less
        padding, or None to run it whole.

        An extend step's matmuls run on its whole token bucket: 257 tokens run a 1024-token step when the
        buckets are 64, 256, 1024. Running a smaller bucket's worth now (T, page-aligned) and the rest in the next
        step (num_tokens - T tokens in their own bucket) computes fewer padded tokens but runs one more step. The
        cut is taken when it saves more tokens than the smallest bucket, the stand-in for a step's fixed cost:
        on this project's CPU machines a step's time is about a fixed ~60-80 tokens' worth plus its tokens
        (reports/buckets-cpu-2026-12-05.md). The cut computing the fewest tokens wins, the larger one on a tie.
        A rule in tokens, not in measured times, so the batches a workload gets do not depend on the machine's
        load. The rest may be cut again in its step."""
        try:
            whole = self.extend_shape(num_tokens, 1)[0]
        except ValueError:
            return None
        best, best_tokens = None, whole - self.token_paddings[0]  # must save more than the smallest bucket
        for t in self.token_paddings:
            cut = t // page_size * page_size
            if t >= whole or cut <= 0 or cut >= num_tokens:
                continue
            tokens = t + self.extend_shape(num_tokens - cut, 1)[0]
            if tokens < best_tokens or (tokens == best_tokens and best is not None):  # ties: the larger cut
                best, best_tokens = cut, tokens
        return best

    def decode_shape(self, num_seqs: int) -> Tuple[int, int]:
        """(T_pad, S_pad) for a decode batch (one token per sequence)."""
        s = _smallest_at_least(list(self.bs_paddings), num_seqs)
        return s, s

    def verify_shape(self, num_seqs: int) -> Tuple[int, int]:
        """(T_pad, S_pad) for a verify batch of `num_seqs` draft trees. Raises ValueError without speculative
        decoding (verify_tokens 0) or when no batch-size padding holds them."""
        if self.verify_tokens <= 0:
            raise ValueError("verify batches need speculative decoding (verify_tokens > 0)")
        s = _smallest_at_least(list(self.bs_paddings), num_seqs)
        return s * self.verify_tokens, s

    def all_shapes(self) -> List[Tuple[ForwardMode, int, int]]:
        """Every (mode, T_pad, S_pad) that serving can produce; warm-up compiles exactly these."""
        shapes = [(ForwardMode.EXTEND, t, self.extend_bs(t)) for t in self.token_paddings]
        shapes += [(ForwardMode.DECODE, s, s) for s in self.bs_paddings]
        if self.verify_tokens > 0:
            shapes += [(ForwardMode.TARGET_VERIFY, s * self.verify_tokens, s) for s in self.bs_paddings]
        return shapes


def default_token_paddings(max_extend_tokens: int, start: int = 64) -> List[int]:
    """Powers of four from `start` below max_extend_tokens, then the first power of two >= max_extend_tokens
    (64, 256, 1024, 2048 for a 2048-token chunk).

    Every bucket is a program compiled at start-up (and loaded on each restart); an extend batch just above a
    bucket pays for the next one up, which the scheduler's cut (`ShapeBuckets.extend_cut`) avoids where a
    smaller bucket's step plus the rest's step computes fewer tokens. Against powers of two (6 programs for a
    2048-token chunk) these 4 cost 1.14x the step time padded and 0.97x with the cut, averaged over batch sizes
    1..2048 (reports/buckets-cpu-2026-12-05.md)."""
    out, t = [], start
    while t < max_extend_tokens:
        out.append(t)
        t *= 4
    return out + [powers_of_two(start, max_extend_tokens)[-1]]  # (every one in `out` is below it)


def powers_of_two(start: int, end: int) -> List[int]:
    """start, 2 start, 4 start, ... up to the first >= end."""
    out = [start]
    while out[-1] < end:
        out.append(out[-1] * 2)
    return out


def default_bs_paddings(max_running_requests: int) -> List[int]:
    """Powers of four from 1, ending with max_running_requests."""
    out, b = [], 1
    while b < max_running_requests:
        out.append(b)
        b *= 4
    out.append(max_running_requests)
    return out


def derive_limits(server_args, model_config, platform: str):
    """(max_running_requests, ShapeBuckets, max_prefill_tokens, chunk_size) from the flags and the model.

    Default token paddings reach the chunk size (or the context length without chunking).
    Raises:
        ValueError: --max-running-requests exceeds the largest --precompile-bs-paddings, or
            --chunked-prefill-size exceeds the largest --precompile-token-paddings.
    """
    bs = server_args.precompile_bs_paddings
    max_running = server_args.max_running_requests
    if max_running is None:
        max_running = bs[-1] if bs else (64 if platform == "cpu" else 256)
    if bs is None:
        bs = default_bs_paddings(max_running)
    elif max_running > bs[-1]:
        raise ValueError(f"--max-running-requests ({max_running}) exceeds the largest "
                         f"--precompile-bs-paddings ({bs[-1]})")
    chunk = server_args.chunked_prefill_size if server_args.chunked_prefill_size > 0 else None
    if chunk is not None:
        chunk = min(chunk, model_config.context_len)
    tokens = server_args.precompile_token_paddings or default_token_paddings(chunk or model_config.context_len)
    if chunk is not None and chunk > tokens[-1]:
        raise ValueError(f"--chunked-prefill-size ({chunk}) exceeds the largest --precompile-token-paddings "
                         f"({tokens[-1]})")
    verify = server_args.speculative_num_draft_tokens if server_args.speculative_algorithm else 0
    buckets = ShapeBuckets(tuple(tokens), tuple(bs), verify or 0)
    if server_args.dp_size > 1 and buckets.max_tokens < max_running:
        raise ValueError(f"--dp-size {server_args.dp_size} runs a rank's decode batch inside another rank's extend "
                         f"step: the largest --precompile-token-paddings ({buckets.max_tokens}) must hold "
                         f"--max-running-requests ({max_running})")
    return max_running, buckets, min(server_args.max_prefill_tokens, buckets.max_tokens), chunk
