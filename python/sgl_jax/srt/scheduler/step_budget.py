"""Prefill chunk sizing under a latency budget (--max-prefill-step-ms).

While requests are decoding, every prefill step delays their next token. This module learns how long a
step takes from the steps the scheduler has run (a least-squares fit of measured wall times to a few
features of each step) and picks the largest prefill chunk whose predicted cost adds at most the budget
to the running requests' inter-token latency (ITL), on top of their own decode step:

- without mixing, a running request waits for the whole prefill step before its decode step: the bound
  is on the prefill step's time;
- with mixed chunked prefill (--enable-mixed-chunk, SGLang's name) the decode rows ride in the prefill
  step: the bound is on what the chunk adds to that step, i.e. the step's time less the time of the same
  step with the decode rows alone (both predicted from mixed steps, the kind that runs while prefill work
  is left, so the difference never rests on a coefficient that only pure decode steps would fit).

The decode step itself is not budgeted: its cost is the running requests' own (their number and their
context), which no chunk size changes.

Features of a step (all counts of real, unpadded work except the padded token count, which sets the
matmul sizes of the compiled program): a constant (per-step overhead: dispatch, sampling, host work), the
padded token count T_pad (weights and per-token FLOPs), the KV tokens that decode rows read (split by step
kind: a DECODE step and an EXTEND step read KV through different attention paths), and the extend rows'
attention pairs sum(q * (prefix + q / 2)) (causal attention FLOPs). Coefficients are fitted on the last
`window` steps and kept non-negative (a coefficient that fits negative is dropped and the rest refitted),
so predicted cost never falls as work grows.

Pure data structures: no ZMQ, no JAX; the Scheduler feeds `observe` with each step's features and wall
time (ms, measured around forward + result processing).
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Deque, List, Optional, Sequence, Tuple

import numpy as np

from sgl_jax.srt.forward_batch import ForwardMode
from sgl_jax.srt.model_executor.buckets import ShapeBuckets
from sgl_jax.srt.scheduler.schedule_batch import step_shape

# feature scales keep the normal equations well conditioned (ms per 1k tokens, per 10k KV tokens, ...)
TOKEN_SCALE = 1e3
CTX_SCALE = 1e4
PAIR_SCALE = 1e6
NUM_FEATURES = 5  # [1, T_pad, decode-step KV reads, extend-step decode-row KV reads, extend attention pairs]


def features(t_pad: int, decode_step: bool, decode_kv_tokens: int, extend_pairs: float) -> np.ndarray:
    """float64[NUM_FEATURES] features of one step.

    Args:
        t_pad: tokens of the compiled program the step runs (padded).
        decode_step: whether the step is a DECODE step (else EXTEND, which may carry decode rows).
        decode_kv_tokens: KV tokens read by the step's one-token (decode) rows, summed over rows.
        extend_pairs: sum over the extend rows of q * (prefix + q / 2) (query-key pairs of causal attention).
    """
    ctx = decode_kv_tokens / CTX_SCALE
    return np.array([1.0, t_pad / TOKEN_SCALE, ctx if decode_step else 0.0, 0.0 if decode_step else ctx,
                     extend_pairs / PAIR_SCALE])


def extend_pairs(q_len: int, prefix_len: int) -> float:
    """Query-key pairs of causal attention for q_len new tokens after prefix_len cached ones."""
    return q_len * (prefix_len + q_len / 2.0)


class StepTimeModel:
    """Least-squares model of a step's wall time (ms) from its `features`, over a sliding window.

    Args:
        window: steps kept (older ones are forgotten: contexts grow, the machine's load changes).
        min_samples: fewer observations than this predict nothing (`predict` returns None).
    """

    def __init__(self, window: int = 256, min_samples: int = 8):
        self.window = window
        self.min_samples = min_samples
        self.samples: Deque[Tuple[np.ndarray, float]] = collections.deque(maxlen=window)
        self._coef: Optional[np.ndarray] = None

    def observe(self, x: np.ndarray, ms: float) -> None:
        """Add one step: its features and its measured wall time in ms (negative or NaN times are ignored)."""
        if not np.isfinite(ms) or ms < 0:
            return
        self.samples.append((np.asarray(x, np.float64), float(ms)))
        self._coef = None

    def coefficients(self) -> Optional[np.ndarray]:
        """Non-negative float64[NUM_FEATURES] coefficients (ms per feature unit), None below min_samples.

        Features that never varied in the window (e.g. no prefill seen yet) get 0."""
        if len(self.samples) < self.min_samples:
            return None
        if self._coef is None:
            X = np.stack([x for x, _ in self.samples])
            y = np.array([t for _, t in self.samples])
            self._coef = nonnegative_lstsq(X, y)
        return self._coef

    def predict(self, x: np.ndarray) -> Optional[float]:
        """Predicted wall time in ms of a step with features `x`, or None without enough samples."""
        coef = self.coefficients()
        return None if coef is None else float(np.dot(coef, x))


def nonnegative_lstsq(X: np.ndarray, y: np.ndarray, ridge: float = 1e-6) -> np.ndarray:
    """argmin ||X c - y|| subject to c >= 0, by refitting without the most negative coefficient until none is
    left (an active-set heuristic that is exact for the small, well-separated features used here). Columns
    that are all zero get 0."""
    n = X.shape[1]
    active = [j for j in range(n) if np.any(X[:, j] != 0)]
    coef = np.zeros(n)
    while active:
        A = X[:, active]
        sol = np.linalg.solve(A.T @ A + ridge * np.eye(len(active)), A.T @ y)
        if np.all(sol >= 0):
            coef[active] = sol
            return coef
        del active[int(np.argmin(sol))]
    return coef


@dataclasses.dataclass
class RowWork:
    """One row of a step for the cost model: a decode row (one token reading kv_tokens of KV) or an extend
    row (q_len tokens after prefix_len cached ones)."""

    decode: bool
    q_len: int
    prefix_len: int

    @property
    def kv_tokens(self) -> int:
        return self.prefix_len + self.q_len


def step_features(t_pad: int, decode_step: bool, rows: Sequence[RowWork]) -> np.ndarray:
    """`features` of a step that runs `rows` in a program of t_pad tokens."""
    ctx = sum(r.kv_tokens for r in rows if r.decode)
    pairs = sum(extend_pairs(r.q_len, r.prefix_len) for r in rows if not r.decode)
    return features(t_pad, decode_step, ctx, pairs)


class PrefillStepBudget:
    """The largest prefill chunk that adds at most `budget_ms` to the running requests' ITL.

    Args:
        budget_ms: the delay a prefill may add to a running request's next token, ms (> 0).
        buckets: the compiled shapes (a chunk is chosen so that the step fills its token bucket).
        page_size: chunks are page-aligned.
        model: the fitted `StepTimeModel` (shared with the Scheduler that observes steps).
    """

    def __init__(self, budget_ms: float, buckets: ShapeBuckets, page_size: int, model: StepTimeModel):
        if not budget_ms > 0:
            raise ValueError(f"the prefill step budget must be > 0 ms, got {budget_ms!r}")
        self.budget_ms = float(budget_ms)
        self.buckets = buckets
        self.page_size = page_size
        self.model = model
        self.last_limit: Optional[int] = None
        self.last_predicted_ms: Optional[float] = None
        self.num_limited = 0  # prefill batches formed under a limit below the chunk size (record_step; with
        # DP attention each rank's batch counts, and the ranks share this object)

    def predicted_delay_ms(self, chunk: int, prefix_len: int, running_kv: Sequence[int], mixed: bool
                           ) -> Optional[float]:
        """Predicted delay (ms) that prefilling `chunk` tokens now adds to the running requests' next token,
        beyond their decode step: the prefill step's time, or with mixing the mixed step's time less that of
        the same step without the chunk. Raises ValueError when no bucket holds the step."""
        n = len(running_kv)
        ext_rows = [RowWork(False, chunk, prefix_len)]
        if not mixed:
            return self.model.predict(step_features(self.buckets.extend_shape(chunk, 1)[0], False, ext_rows))
        dec_rows = [RowWork(True, 1, kv - 1) for kv in running_kv]
        step = self.model.predict(step_features(self.buckets.extend_shape(chunk + n, 1 + n)[0], False,
                                                ext_rows + dec_rows))
        rows_alone = self.model.predict(step_features(self.buckets.extend_shape(n, n)[0], False, dec_rows))
        return None if step is None or rows_alone is None else step - rows_alone

    def candidates(self, chunk_size: int, num_decode_rows: int) -> List[int]:
        """Chunk sizes worth trying, ascending: each token bucket minus the decode rows riding along,
        page-aligned, in [page_size, chunk_size]."""
        ps = self.page_size
        cap = chunk_size // ps * ps
        out = {min(cap, (t - num_decode_rows) // ps * ps) for t in self.buckets.token_paddings} | {cap}
        return sorted(c for c in out if c >= ps) or [ps]

    def chunk_limit(self, chunk_size: int, prefix_len: int, running_kv: Sequence[int], mixed: bool) -> int:
        """Tokens the next prefill step may extend (<= chunk_size).

        Args:
            chunk_size: --chunked-prefill-size.
            prefix_len: tokens already prefilled of the request the chunk continues (0 for new requests).
            running_kv: the KV length of each running (decoding) request, tokens.
            mixed: decode rows ride in the prefill step.
        Returns:
            chunk_size when nothing runs or the model has too few samples; else the largest candidate whose
            predicted delay is within the budget, or the smallest candidate when none is (prefill always
            progresses).
        """
        if not running_kv or self.model.coefficients() is None:
            self.last_limit, self.last_predicted_ms = None, None
            return chunk_size
        cands = self.candidates(chunk_size, len(running_kv) if mixed else 0)
        best, best_ms = cands[0], None
        for i, c in enumerate(cands):
            try:
                ms = self.predicted_delay_ms(c, prefix_len, running_kv, mixed)
            except ValueError:  # no bucket holds it (nor any larger candidate)
                break
            if i == 0:
                best_ms = ms
            elif ms > self.budget_ms:  # (predictions grow with the chunk: coefficients are >= 0)
                break
            else:
                best, best_ms = c, ms
        self.last_limit, self.last_predicted_ms = best, best_ms
        return best

    def record_step(self, limit: Optional[int], chunk_size: int) -> None:
        """Count a prefill step that was formed under `limit` (a `chunk_limit` result; None: no limit) when it
        is below `chunk_size`. Counted here rather than in `chunk_limit`: a decision whose batch admitted
        nothing (the scheduler then asks again without mixing) is not a step."""
        if limit is not None and limit < chunk_size:
            self.num_limited += 1

    def state(self) -> dict:
        """For /get_server_info: the budget, the fit and the last decision."""
        coef = self.model.coefficients()
        return {
            "budget_ms": self.budget_ms,
            "samples": len(self.model.samples),
            "coefficients": None if coef is None else [round(float(c), 4) for c in coef],
            "last_chunk_limit": self.last_limit,
            "last_predicted_ms": None if self.last_predicted_ms is None else round(self.last_predicted_ms, 2),
            "num_limited": self.num_limited,
        }


def step_cost_features(batches: Sequence, buckets):
    """The step-time model's features of one step (its ranks' `ScheduleBatch` or None each), before it runs; None
    when no rank has requests."""
    live = [b for b in batches if b is not None and b.reqs]
    if not live:
        return None
    mode, t_pad, _ = step_shape(live, buckets)
    if all(b.forward_mode == ForwardMode.DECODE for b in live):  # (each step of a stream: no per-row objects)
        return features(t_pad, mode == ForwardMode.DECODE, sum(r.kv_committed_len + 1 for b in live for r in b.reqs),
                        0.0)
    rows = [RowWork(b.is_decode_row(r), 1 if b.is_decode_row(r) else r.extend_input_len, r.kv_committed_len)
            for b in live for r in b.reqs]
    return step_features(t_pad, mode == ForwardMode.DECODE, rows)
