"""What a launched step gives back: its sampled tokens on their way to the host, and its device outputs.

A step's sampled ids and their logprobs leave the device as one int32 array (the logprobs bit for bit, `pack_tokens`)
through one asynchronous copy started at launch (`PendingStep`); the logits, their log-sum-exp and the hidden states
stay on the device until a request asks for them (top logprobs, input logprobs, scores).
"""

from __future__ import annotations

import dataclasses
import time
from typing import List, Optional

import jax
import jax.numpy as jnp
import numpy as np

from sgl_jax.srt.forward_batch import ModelWorkerBatch
from sgl_jax.srt.model_executor import host_copy
from sgl_jax.srt.sampling.sampling_batch import SamplingBatch


def pack_tokens(next_ids: jax.Array, next_lp: jax.Array) -> jax.Array:
    """int32[2, ...]: the sampled ids (int32[...]) and their logprobs (float32[...], bit for bit) in one array, so
    one device-to-host copy brings both (traced)."""
    return jnp.stack([next_ids.astype(jnp.int32), jax.lax.bitcast_convert_type(next_lp, jnp.int32)])


def unpack_tokens(host: np.ndarray):
    """(int32 ids, float32 logprobs) of a `pack_tokens` array on the host."""
    return host[0], np.ascontiguousarray(host[1]).view(np.float32)


@dataclasses.dataclass
class StepTimes:
    """Host-side times of one step, in seconds (time.perf_counter() deltas): h2d_s the explicit host-to-device copy
    of its packed inputs; dispatch_s the compiled programs' calls, from entry until they return (the device runs
    them afterwards); wait_s the time `PendingStep.resolve` blocked until the step's tokens were computed; d2h_s
    the time it then took to have them on the host (their copy started at launch)."""

    h2d_s: float = 0.0
    dispatch_s: float = 0.0
    wait_s: float = 0.0
    d2h_s: float = 0.0


@dataclasses.dataclass
class StepOutput:
    """One rank's result of one step. next_token_ids / next_token_logprobs are host arrays over the rank's
    real rows (a multi-step decode's first step; ``multi_token_ids`` / ``multi_token_logprobs`` [n, K] hold every
    step's); ``logits`` (float32[dp * S_pad, V], raw; an embedding server's: zeros [dp * S_pad, 1]; None after a
    multi-step decode), their log-sum-exp ``lse`` (float32[dp * S_pad]) and ``hidden`` (float32[dp * T_pad,
    hidden]) are the whole step's, on device until asked: this rank's rows start at ``seq_offset`` and
    ``token_offset``."""

    next_token_ids: np.ndarray
    next_token_logprobs: np.ndarray
    logits: Optional[jax.Array]
    lse: Optional[jax.Array]
    hidden: jax.Array
    seq_offset: int = 0
    token_offset: int = 0
    routed_experts: Optional[np.ndarray] = None  # int32[n, L, k]: each sampled token's experts (-1: dense layer)
    aux: Optional[jax.Array] = None  # EAGLE-3: the captured layers' outputs [dp * T_pad, n * hidden] (on device)
    multi_token_ids: Optional[np.ndarray] = None  # int32[n, K]: a multi-step decode's tokens, step by step
    multi_token_logprobs: Optional[np.ndarray] = None  # float32[n, K]

    def logprob_rows(self) -> np.ndarray:
        """float32[dp * S_pad, V] on the host: the log-softmax of the raw logits of every row of the step (copies the
        whole step's logits; for top-logprobs and token-id logprobs).

        Raises:
            ValueError: after a multi-step decode (it keeps no logits; requests that need them run single steps).
        """
        if self.logits is None:
            raise ValueError("a multi-step decode keeps no logits")
        logits, lse = jax.device_get((self.logits, self.lse))
        return logits - lse[:, None]


class PendingStep:
    """A launched step whose results are still on the device: its tokens (`pack_tokens`) are being copied to the
    host; `resolve` waits for them and splits them per rank.

    Args:
        tokens: int32[2, dp * S_pad] (or [2, K, dp * S_pad] for K decode steps) ids and logprobs.
        logits, lse, hidden, aux: the step's device outputs (see StepOutput; logits and lse None after K > 1).
        counts, routed: the MoE outputs (expert token counts, each sampled row's experts), or None.
        num_seqs: real sampling rows per rank (None: the rank idled: sequences, or tokens in a verify step); s_pad:
            sampling rows per rank, t_pad: tokens per rank.
        moe_stats: the runner's `MoeStats` (counts are added at resolve), or None; routed_on: whether routed
            experts are returned.
        times: the step's `StepTimes` (``wait_s`` is filled at resolve).
        copy_ahead: start the tokens' copy to the host now (False on a CPU device: `resolve` reads them in place).
    """

    def __init__(self, tokens, logits, lse, hidden, aux, counts, routed, num_seqs: List[Optional[int]], s_pad: int,
                 t_pad: int, moe_stats, routed_on: bool, times: Optional[StepTimes] = None, copy_ahead: bool = True):
        self.tokens, self.logits, self.lse, self.hidden, self.aux = tokens, logits, lse, hidden, aux
        self.counts, self.routed = counts, routed
        self.num_seqs, self.s_pad, self.t_pad = num_seqs, s_pad, t_pad
        self.moe_stats, self.routed_on = moe_stats, routed_on and routed is not None
        self.times = times if times is not None else StepTimes()
        if copy_ahead:
            host_copy.start_get(tokens)
        if moe_stats is not None and counts is not None:
            counts.copy_to_host_async()
        if routed_on:
            routed.copy_to_host_async()

    def resolve(self) -> List[Optional[StepOutput]]:
        """Wait for the step and return one StepOutput per rank (None for idle ranks)."""
        t0 = time.perf_counter()
        self.tokens.block_until_ready()
        t1 = time.perf_counter()
        host = host_copy.get(self.tokens)
        self.times.wait_s, self.times.d2h_s = t1 - t0, time.perf_counter() - t1
        ids, lps = unpack_tokens(host)
        if self.moe_stats is not None and self.counts is not None:
            self.moe_stats.add_step(jax.device_get(self.counts))
        routed = jax.device_get(self.routed) if self.routed_on else None
        multi = ids.ndim == 2  # [K, rows]: K decode steps
        outs = []
        for r, n in enumerate(self.num_seqs):
            if n is None:
                outs.append(None)
                continue
            a = r * self.s_pad
            out = StepOutput(ids[..., a:a + n][0] if multi else ids[a:a + n],
                             lps[..., a:a + n][0] if multi else lps[a:a + n], self.logits, self.lse, self.hidden,
                             seq_offset=a, token_offset=r * self.t_pad,
                             routed_experts=None if routed is None else routed[a:a + n], aux=self.aux)
            if multi:
                out.multi_token_ids, out.multi_token_logprobs = ids[:, a:a + n].T, lps[:, a:a + n].T
            outs.append(out)
        return outs


@dataclasses.dataclass
class LaunchedForward:
    """A step whose forward program is dispatched and whose sampling is not (`ModelRunner.launch_forward`), or a
    slot decode whose tokens are drawn again once its grammar masks are filled (`ModelRunner.launch_decode_split`).

    logits: float32[dp * S_pad, V] on device (see StepOutput); hidden, moe: the forward's other outputs (see
    StepOutput); sampling: the rank-stacked SamplingBatch (host arrays; its vocab mask None when no row has a
    grammar or the scheduler fills the masks later); num_seqs: real sampling rows per rank (None: idle); s_pad:
    sampling rows per rank (`ModelWorkerBatch.rows_pad`: S_pad, T_pad in a verify step), t_pad: tokens per rank;
    batch: one real rank batch (named when a compile is reported); aux: the captured layers' outputs (EAGLE-3) or
    None; times: the step's `StepTimes` so far; packed: (the step's packed inputs on device, their layout), which
    the sampling program reads too.
    """

    logits: jax.Array
    hidden: jax.Array
    moe: tuple
    sampling: SamplingBatch
    num_seqs: List[Optional[int]]
    s_pad: int
    t_pad: int
    batch: ModelWorkerBatch
    aux: Optional[jax.Array] = None
    times: StepTimes = dataclasses.field(default_factory=StepTimes)
    packed: Optional[tuple] = None
