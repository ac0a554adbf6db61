"""After a step: append sampled tokens, collect logprobs, decide who finished, and build BatchTokenIDOut.

Logprob conventions follow SGLang: ``input_token_logprobs`` start at ``logprob_start_len`` and the very
first prompt token has logprob None; entry i of a request's output logprobs is the log-probability of
output token i under the model's (temperature 1) next-token distribution.
"""

from __future__ import annotations

import base64
import dataclasses

from typing import Callable, List, Optional

import jax
import numpy as np

from sgl_jax.srt.errors import RequestError
from sgl_jax.srt.io_struct import DecodeConfig, LogprobDelta, TokenOut
from sgl_jax.srt.scheduler.schedule_batch import FinishReason, Req, ScheduleBatch
from sgl_jax.srt.forward_batch import ForwardMode
from sgl_jax.srt.model_executor.step_output import StepOutput


def top_logprobs(row: np.ndarray, k: int) -> list:
    """[(logprob, token_id)] of the k most likely tokens of a float32[V] logprob row, best first."""
    if k <= 0:
        return []
    if k == 1:  # one argmax pass instead of a partition (a 262,144-token vocabulary: ~50x less host time)
        i = int(np.argmax(row))
        return [(float(row[i]), i)]
    idx = np.argpartition(-row, k - 1)[:k]
    idx = idx[np.argsort(-row[idx], kind="stable")]
    return [(float(row[i]), int(i)) for i in idx]


def token_ids_logprobs(row: np.ndarray, ids: List[int]) -> list:
    return [(float(row[i]), int(i)) for i in ids]


def append_input_logprobs(req: Req, hidden: np.ndarray, first_row: int, start: int, end: int,
                          full_logprobs: Callable[[np.ndarray], np.ndarray], chunk: int = 128) -> None:
    """Add the input logprobs an extend of positions [start, end) makes available (chunk by chunk).

    Args:
        hidden: [T_pad, hidden] final hidden states of the step; row ``first_row + p - start`` is prompt
            position p, whose distribution predicts token p + 1.
        full_logprobs: hidden rows [N, hidden] -> float32[N, V]; called on at most `chunk` rows at a time.
    """
    ids = req.origin_input_ids
    lp_start = min(max(req.logprob_start_len, 0), len(ids) - 1)
    if req.input_token_logprobs is None:
        req.input_token_logprobs, req.input_top_logprobs, req.input_token_ids_logprobs = [], [], []
        if lp_start == 0:
            req.input_token_logprobs.append((None, ids[0]))
            req.input_top_logprobs.append(None)
            req.input_token_ids_logprobs.append(None)
    positions = list(range(max(start + 1, lp_start, 1), min(end + 1, len(ids))))
    for c in range(0, len(positions), chunk):
        pos = positions[c:c + chunk]
        rows = full_logprobs(hidden[[first_row + p - 1 - start for p in pos]])
        for row, p in zip(rows, pos):
            req.input_token_logprobs.append((float(row[ids[p]]), ids[p]))
            req.input_top_logprobs.append(top_logprobs(row, req.top_logprobs_num) if req.top_logprobs_num else None)
            req.input_token_ids_logprobs.append(
                token_ids_logprobs(row, req.token_ids_logprob) if req.token_ids_logprob else None)


def commit_launched_row(batch: ScheduleBatch, i: int) -> int:
    """Count row i of a launched step (`ScheduleBatch.launched`) as done: its request has one token fewer in flight
    when the row sampled, and its KV written up to the row's end. Returns the request's committed KV length (tokens)
    before the step."""
    req = batch.reqs[i]
    req.num_inflight -= batch.row_samples[i]
    start = req.kv_committed_len
    req.kv_committed_len = batch.row_ends[i]
    return start


def process_batch_result(
    batch: ScheduleBatch,
    out: StepOutput,
    memory,
    full_logprobs: Callable[[np.ndarray], np.ndarray],
    decode_tail: Callable[[Req, List[int]], str],
    on_error: Optional[Callable[[Req, Exception], None]] = None,
    check: Optional[Callable[[Req], None]] = None,
) -> None:
    """Apply one step's results to the batch's requests (tokens, logprobs, finish reasons).

    `batch` is the step's own copy (`ScheduleBatch.launched`): each row's KV counts as written up to its
    ``row_ends`` entry, and a sampling row's token leaves ``num_inflight`` for ``output_ids`` (rows of requests that
    finished before the result arrived are dropped first: `ScheduleBatch.drop_finished_rows`).
    A request whose prompt is only partly prefilled (a chunk) samples nothing; its computed prefix is
    handed to the prefix cache (`KVMemory.cache_unfinished`) and it stays out of the running batch.
    The decode rows of a mixed batch (`ScheduleBatch.mix_with_running`) are processed as in a decode step.

    Args:
        memory: the rank's `KVMemory`.
        full_logprobs: hidden rows [N, hidden] -> float32[N, V] logprobs (for input-token logprobs).
        decode_tail: (req, token ids) -> text, for stop strings.
        on_error: called with (req, exception) when one request's processing raises; the others go on
            (None: the exception propagates). Each request's KV positions count as written either way.
        check: called with each request before its sampled token is taken (the fault-injection hook).
    """
    is_extend = batch.forward_mode == ForwardMode.EXTEND
    need_rows = any(r.return_logprob and (r.top_logprobs_num > 0 or r.token_ids_logprob) for r in batch.reqs)
    rows = out.logprob_rows() if need_rows else None
    hidden = [None]
    for i, req in enumerate(batch.reqs):
        start = commit_launched_row(batch, i)
        try:
            if out.multi_token_ids is not None:
                _process_steps(req, batch.row_index[i], batch.row_samples[i], out, decode_tail, check)
                continue
            _process_one(req, batch.row_index[i], start, is_extend and not batch.is_decode_row(req), out, rows,
                         hidden, out.token_offset + batch.row_token_starts[i], memory, full_logprobs, decode_tail,
                         check)
        except Exception as exc:
            if on_error is None:
                raise
            on_error(req, exc)


def _process_one(req: Req, i: int, start: int, is_extend: bool, out: StepOutput, rows, hidden: list,
                 first_token: int, memory, full_logprobs, decode_tail, check) -> None:
    """One row: `i` its index among the rank's sequences of the step, `first_token` its first row of the step's
    hidden states."""
    if is_extend and req.wants_input_logprobs():
        if hidden[0] is None:
            hidden[0] = jax.device_get(out.hidden)
        append_input_logprobs(req, hidden[0], first_token, start, req.kv_committed_len, full_logprobs)
    req.is_chunked = req.kv_committed_len < req.seqlen
    if req.to_abort is not None:
        req.finished_reason = req.to_abort
        return
    if req.is_chunked:
        memory.cache_unfinished(req)
        return
    if req.sampling_params.max_new_tokens == 0:
        req.check_finished(lambda ids, r=req: decode_tail(r, ids))
        return
    if check is not None:
        check(req)
    append_token(req, int(out.next_token_ids[i]), i, out, rows, decode_tail)


def _process_steps(req: Req, i: int, n: int, out: StepOutput, decode_tail, check) -> None:
    """A multi-step decode's row `i`: its `n` tokens in order, up to the one that finishes the request (the rest,
    sampled past a stop the device does not check -- a stop string --, are dropped, and the KV of their positions
    is not counted as written: `release_kv_cache` frees it)."""
    if req.to_abort is not None:
        req.finished_reason = req.to_abort
        return
    if check is not None:
        check(req)
    for j in range(n):
        append_token(req, int(out.multi_token_ids[i, j]), i, out, None, decode_tail,
                     float(out.multi_token_logprobs[i, j]))
        if req.finished():
            break
    req.kv_committed_len = min(req.kv_committed_len, req.seqlen - 1)


def append_token(req: Req, token: int, i: int, out: StepOutput, rows, decode_tail,
                 logprob: Optional[float] = None) -> None:
    """Append one sampled token to `req`'s output: its logprobs (row `i` of the rank's sampling rows; `logprob`
    when given), its routed experts, the grammar's step, then the finish checks (`Req.check_finished`; a finished
    grammar stops it too). rows: the step's logprob rows (`StepOutput.logprob_rows`) when some request wants top or
    token-id logprobs.

    Raises:
        RequestError: the request's grammar rejects the token (400, naming the grammar's field). Its own mask
            allowed that token: llguidance 1.9 does so where the grammar forces bytes that the tokenizer has no
            token for (a regex of U+A0F17 with SmolLM2's vocabulary, which lacks the byte 0xF2, offers the token of
            byte 0xA0), so the grammar cannot be generated with this model's vocabulary."""
    req.output_ids.append(token)
    if req.return_routed_experts and out.routed_experts is not None:
        req.routed_experts.append(out.routed_experts[i])
    if req.return_logprob:
        lp = float(out.next_token_logprobs[i]) if logprob is None else logprob
        req.output_token_logprobs.append((lp, token))
        if req.top_logprobs_num > 0:
            req.output_top_logprobs.append(top_logprobs(rows[out.seq_offset + i], req.top_logprobs_num))
        if req.token_ids_logprob:
            req.output_token_ids_logprobs.append(token_ids_logprobs(rows[out.seq_offset + i], req.token_ids_logprob))
    if req.grammar is not None and not req.grammar.accept_token(token):
        error = " ".join(str(req.grammar.error()).split())[:200]
        raise RequestError(f"{req.grammar.kind}: the grammar cannot be generated with this model's vocabulary "
                           f"(its token {token} was refused: {error})", 400, param=req.grammar.kind)
    req.check_finished(lambda ids, r=req: decode_tail(r, ids))
    if req.grammar is not None and req.finished_reason is None and req.grammar.is_terminated():
        # the grammar allows nothing more (llguidance stops right after the last character, before any EOS;
        # matched=None so the detokenizer keeps that token, unlike a matched stop token)
        req.finished_reason = FinishReason("stop", matched=None)


def token_out(req: Req, stream_interval: int, with_logprobs: bool = True) -> Optional[TokenOut]:
    """The message for the detokenizer about `req`, or None when nothing needs sending yet.

    Streaming requests are sent every ``stream_interval`` new tokens; others only when they finish.
    """
    n_new = len(req.output_ids) - req.sent_len
    finished = req.finished()
    if not finished and not (req.stream and n_new >= stream_interval):
        return None
    delta = None
    if req.return_logprob and with_logprobs:
        s = req.sent_len
        delta = LogprobDelta(
            output_token_logprobs=req.output_token_logprobs[s:],
            output_top_logprobs=req.output_top_logprobs[s:],
            output_token_ids_logprobs=req.output_token_ids_logprobs[s:],
        )
        if not req.input_logprobs_sent:
            delta.input_token_logprobs = req.input_token_logprobs
            delta.input_top_logprobs = req.input_top_logprobs if req.top_logprobs_num > 0 else None
            delta.input_token_ids_logprobs = req.input_token_ids_logprobs if req.token_ids_logprob else None
            req.input_logprobs_sent = True
    sp = req.sampling_params
    msg = TokenOut(
        rid=req.rid,
        new_token_ids=req.output_ids[req.sent_len:],
        finished_reason=req.finished_reason.to_json() if finished else None,
        prompt_tokens=len(req.origin_input_ids),
        completion_tokens=len(req.output_ids),
        cached_tokens=req.cached_tokens,
        decode=DecodeConfig(sp.skip_special_tokens, sp.spaces_between_special_tokens, list(sp.stop or []),
                            sp.no_stop_trim),
        logprobs=delta,
        routed_experts=encode_routed_experts(req.routed_experts) if finished and req.return_routed_experts else None,
        spec=None if req.spec is None else dataclasses.asdict(req.spec),
    )
    req.sent_len = len(req.output_ids)
    return msg


def encode_routed_experts(rows) -> str:
    """SGLang's ``meta_info.routed_experts``: base64 of the int32 array [output tokens, layers, top-k] (C order;
    -1 on dense layers), from a request's per-token rows."""
    arr = np.asarray(rows, np.int32) if len(rows) else np.zeros((0,), np.int32)
    return base64.b64encode(np.ascontiguousarray(arr).tobytes()).decode("ascii")
