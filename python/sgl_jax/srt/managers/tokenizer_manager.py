"""TokenizerManager: the asyncio front of the engine (runs in the HTTP or Engine process).

It tokenizes and validates requests, sends them to the scheduler, and turns the detokenizer's
BatchStrOut stream into SGLang-shaped response dicts: ``{"text", "output_ids", "meta_info"}``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from typing import Any, AsyncIterator, Dict, List, Optional, Union

import zmq
import zmq.asyncio

from sgl_jax.srt.configs.model_config import load_tokenizer, resolve_model_path, tokenizer_path_for
from sgl_jax.srt.managers.io_struct import (
    AbortReq,
    BatchStrOut,
    FlushCacheReq,
    FlushCacheReqOutput,
    GetInternalStateReq,
    GetInternalStateReqOutput,
    StrOut,
    TokenizedGenerateReqInput,
)
from sgl_jax.srt.managers.errors import RequestError  # noqa: F401  (re-exported)
from sgl_jax.srt.managers.score_client import ScoreClient
from sgl_jax.srt.managers.scoring import ScoreReqInput
from sgl_jax.srt.sampling.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class GenerateReqInput:
    """One native /generate request (a single prompt; see `split_batch` for batches).

    Fields and meanings follow SGLang's GenerateReqInput. `text` or `input_ids` gives the prompt.
    """

    text: Optional[str] = None
    input_ids: Optional[List[int]] = None
    sampling_params: Optional[dict] = None
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    token_ids_logprob: Optional[List[int]] = None
    return_text_in_logprobs: bool = False
    stream: bool = False
    rid: Optional[str] = None


_PER_ITEM = ("sampling_params", "return_logprob", "logprob_start_len", "top_logprobs_num", "token_ids_logprob",
             "rid")


def split_batch(body: Dict[str, Any]) -> Union[GenerateReqInput, List[GenerateReqInput]]:
    """A /generate body -> one GenerateReqInput, or a list for a batch (``text`` or ``input_ids`` a list of prompts).

    Per-request fields may be a single value (shared) or a list with one entry per prompt.
    Raises RequestError on a malformed body.
    """
    names = {f.name for f in dataclasses.fields(GenerateReqInput)}
    unknown = sorted(set(body) - names)
    if unknown:
        raise RequestError(f"Unknown fields: {unknown}")
    text, ids = body.get("text"), body.get("input_ids")
    if (text is None) == (ids is None):
        raise RequestError("Exactly one of 'text' and 'input_ids' must be given")
    is_batch = isinstance(text, list) or (isinstance(ids, list) and ids and isinstance(ids[0], list))
    if not is_batch:
        return _single(body)
    prompts = text if text is not None else ids
    if not prompts:
        raise RequestError("Empty batch")
    out = []
    for i, p in enumerate(prompts):
        item = {k: v for k, v in body.items() if k not in ("text", "input_ids")}
        item["text" if text is not None else "input_ids"] = p
        for k in _PER_ITEM:
            v = body.get(k)
            if isinstance(v, list) and not (k == "token_ids_logprob" and v and not isinstance(v[0], list)):
                if len(v) != len(prompts):
                    raise RequestError(f"'{k}' has {len(v)} entries for {len(prompts)} prompts")
                item[k] = v[i]
        if "rid" in item and isinstance(body.get("rid"), str):
            item["rid"] = f"{body['rid']}-{i}"
        out.append(_single(item))
    return out


def _single(body: Dict[str, Any]) -> GenerateReqInput:
    obj = GenerateReqInput(**body)
    if obj.text is not None and not isinstance(obj.text, str):
        raise RequestError("'text' must be a string or a list of strings")
    if obj.input_ids is not None and not (isinstance(obj.input_ids, list) and all(
            isinstance(t, int) and not isinstance(t, bool) for t in obj.input_ids)):
        raise RequestError("'input_ids' must be a list of integers or a list of such lists")
    if obj.sampling_params is not None and not isinstance(obj.sampling_params, dict):
        raise RequestError("'sampling_params' must be an object")
    for name, tp in (("return_logprob", bool), ("stream", bool), ("return_text_in_logprobs", bool)):
        if not isinstance(getattr(obj, name), tp):
            raise RequestError(f"'{name}' must be a boolean")
    for name in ("logprob_start_len", "top_logprobs_num"):
        v = getattr(obj, name)
        if not isinstance(v, int) or isinstance(v, bool):
            raise RequestError(f"'{name}' must be an integer")
    if obj.token_ids_logprob is not None and not (isinstance(obj.token_ids_logprob, list) and all(
            isinstance(t, int) and not isinstance(t, bool) for t in obj.token_ids_logprob)):
        raise RequestError("'token_ids_logprob' must be a list of integers")
    return obj


@dataclasses.dataclass
class PreparedReq:
    """A tokenized, validated request ready to send."""

    obj: GenerateReqInput
    input_ids: List[int]
    sampling_params: SamplingParams


@dataclasses.dataclass
class ReqState:
    """Accumulated output of one in-flight request."""

    obj: GenerateReqInput
    event: asyncio.Event
    pending: List[StrOut] = dataclasses.field(default_factory=list)
    text: str = ""
    output_ids: List[int] = dataclasses.field(default_factory=list)
    finished_reason: Optional[dict] = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    logprobs: Dict[str, list] = dataclasses.field(default_factory=dict)
    created: float = dataclasses.field(default_factory=time.time)
    error: Optional[RequestError] = None


_LOGPROB_KEYS = ("input_token_logprobs", "input_top_logprobs", "input_token_ids_logprobs",
                 "output_token_logprobs", "output_top_logprobs", "output_token_ids_logprobs")


class TokenizerManager:
    """Front of the engine. Create inside (or before) the event loop that will use it; call `start()` there.

    Args:
        server_args: `ServerArgs`.
        port_args: `PortArgs`.
        scheduler_info: the scheduler's readiness message (limits such as max_req_input_len, context_len).
    """

    def __init__(self, server_args, port_args, scheduler_info: dict):
        self.server_args = server_args
        self.model_path = resolve_model_path(server_args.model_path).model_path
        self.tokenizer_path = tokenizer_path_for(server_args)
        self.tokenizer = load_tokenizer(server_args)
        self.served_model_name = server_args.served_model_name or self.model_path
        self.info = scheduler_info
        self.context_len = scheduler_info["context_len"]
        self.vocab_size = scheduler_info["vocab_size"]
        ctx = zmq.asyncio.Context(2)
        self.recv_from_detokenizer = ctx.socket(zmq.PULL)
        self.recv_from_detokenizer.bind(port_args.tokenizer_ipc_name)
        self.send_to_scheduler = ctx.socket(zmq.PUSH)
        self.send_to_scheduler.connect(port_args.scheduler_input_ipc_name)
        self.rid_to_state: Dict[str, ReqState] = {}
        self._control: Dict[type, asyncio.Queue] = {}
        self._control_locks: Dict[type, asyncio.Lock] = {}
        self._loop_task: Optional[asyncio.Task] = None
        self.loop: Optional[asyncio.AbstractEventLoop] = None  # the loop serving this manager, once started
        self.dead_reason: Optional[str] = None
        self.score_client = ScoreClient(self)

    # ------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Start the receive loop on the running event loop (idempotent)."""
        if self._loop_task is None:
            self.loop = asyncio.get_running_loop()
            self._loop_task = self.loop.create_task(self._handle_loop())

    async def close(self) -> None:
        """Stop the receive loop and close the sockets."""
        if self._loop_task is not None:
            self._loop_task.cancel()
            try:
                await self._loop_task
            except asyncio.CancelledError:
                pass
            self._loop_task = None
        self.recv_from_detokenizer.close(linger=0)
        self.send_to_scheduler.close(linger=0)

    def mark_dead(self, reason: str) -> None:
        """A child process died: fail every pending request (called from the event loop thread)."""
        self.dead_reason = reason
        for state in self.rid_to_state.values():
            state.error = RequestError(f"Server unavailable: {reason}", 503)
            state.event.set()
        self.score_client.fail_all(RequestError(f"Server unavailable: {reason}", 503))

    def _check_alive(self) -> None:
        if self.dead_reason is not None:
            raise RequestError(f"Server unavailable: {self.dead_reason}", 503)

    async def _handle_loop(self) -> None:
        while True:
            msg = await self.recv_from_detokenizer.recv_pyobj()
            if isinstance(msg, BatchStrOut):
                for out in msg.outs:
                    state = self.rid_to_state.get(out.rid)
                    if state is not None:
                        state.pending.append(out)
                        state.event.set()
            elif self.score_client.on_message(msg):
                pass
            else:
                self._control_queue(type(msg)).put_nowait(msg)

    def _control_queue(self, tp: type) -> asyncio.Queue:
        return self._control.setdefault(tp, asyncio.Queue())

    async def _control_call(self, req, reply_type: type, timeout: float = 30.0):
        self._check_alive()
        lock = self._control_locks.setdefault(reply_type, asyncio.Lock())
        async with lock:
            self.send_to_scheduler.send_pyobj(req)
            try:
                return await asyncio.wait_for(self._control_queue(reply_type).get(), timeout)
            except asyncio.TimeoutError:
                raise RequestError("The scheduler did not answer in time", 503) from None

    async def flush_cache(self) -> FlushCacheReqOutput:
        return await self._control_call(FlushCacheReq(), FlushCacheReqOutput)

    async def get_internal_state(self) -> dict:
        out: GetInternalStateReqOutput = await self._control_call(GetInternalStateReq(), GetInternalStateReqOutput)
        return out.internal_state

    def abort_request(self, rid: str, message: str = "Aborted by the client") -> None:
        if rid in self.rid_to_state:
            self.send_to_scheduler.send_pyobj(AbortReq(rid, message))

    # ------------------------------------------------------------ scoring
    async def score_request(self, obj: ScoreReqInput) -> dict:
        """Run a /v1/score request: {"scores": [[float per label] per item], "prompt_tokens", "algorithm"}.

        Raises RequestError (400 invalid, 413 cannot fit, 503 server down). See managers/score_client.py.
        """
        self.start()
        return await self.score_client.score(obj)

    # ------------------------------------------------------------ generation
    def tokenize(self, obj: GenerateReqInput) -> List[int]:
        if obj.input_ids is not None:
            ids = list(obj.input_ids)
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise RequestError(f"input_ids contain ids outside the vocabulary [0, {self.vocab_size}): {bad[:5]}")
            return ids
        return self.tokenizer.encode(obj.text)

    def validate(self, obj: GenerateReqInput, input_ids: List[int]) -> SamplingParams:
        """Check a request against the model and server limits; return its normalized SamplingParams.

        Raises:
            RequestError: 400 for invalid values or a prompt longer than the context, 413 when the prompt
                cannot fit the largest prefill bucket or the KV cache.
        """
        n = len(input_ids)
        if n == 0:
            raise RequestError("The prompt is empty")
        if n >= self.context_len:
            raise RequestError(f"The input ({n} tokens) is longer than the model's context length "
                               f"({self.context_len} tokens).")
        if n > self.info["max_req_input_len"]:
            raise RequestError(f"The input ({n} tokens) exceeds the largest prefill this server compiled "
                               f"({self.info['max_req_input_len']} tokens); raise --precompile-token-paddings",
                               413)
        if n + 1 > self.info["max_total_tokens"]:
            raise RequestError(f"The input ({n} tokens) does not fit the KV cache "
                               f"({self.info['max_total_tokens']} tokens)", 413)
        try:
            sp = SamplingParams.from_dict(obj.sampling_params)
            sp.verify(self.vocab_size)
        except (TypeError, ValueError) as e:
            raise RequestError(str(e)) from None
        sp.normalize()
        if obj.top_logprobs_num < 0 or obj.top_logprobs_num > self.vocab_size:
            raise RequestError(f"top_logprobs_num must be in [0, {self.vocab_size}]")
        for t in obj.token_ids_logprob or []:
            if not 0 <= t < self.vocab_size:
                raise RequestError(f"token_ids_logprob entry {t} is outside the vocabulary")
        if obj.logprob_start_len >= n:
            raise RequestError(f"logprob_start_len ({obj.logprob_start_len}) must be less than the input "
                               f"length ({n})")
        return sp

    def prepare(self, obj: GenerateReqInput) -> "PreparedReq":
        """Tokenize and validate now, so errors surface before any response is started.

        Raises:
            RequestError: invalid request (400/413), or the server is down (503).
        """
        self._check_alive()
        input_ids = self.tokenize(obj)
        return PreparedReq(obj, input_ids, self.validate(obj, input_ids))

    async def generate_request(self, req: Union[GenerateReqInput, "PreparedReq"]) -> AsyncIterator[dict]:
        """Run one request; yields response dicts (every update when streaming, else only the final one).

        On cancellation (client gone) the request is aborted in the scheduler.
        Raises:
            RequestError: invalid request, or the server is down.
        """
        if not isinstance(req, PreparedReq):
            req = self.prepare(req)
        self._check_alive()
        self.start()
        obj, input_ids, sp = req.obj, req.input_ids, req.sampling_params
        rid = obj.rid or uuid.uuid4().hex
        if rid in self.rid_to_state:
            raise RequestError(f"Duplicate request id {rid!r}")
        state = ReqState(obj=obj, event=asyncio.Event())
        self.rid_to_state[rid] = state
        self.send_to_scheduler.send_pyobj(TokenizedGenerateReqInput(
            rid=rid, input_ids=input_ids, sampling_params=sp, return_logprob=obj.return_logprob,
            logprob_start_len=obj.logprob_start_len, top_logprobs_num=obj.top_logprobs_num,
            token_ids_logprob=obj.token_ids_logprob, stream=obj.stream,
        ))
        if self.server_args.log_requests:
            logger.info("Request %s: %d input tokens, %s", rid, len(input_ids), sp)
        finished = False
        try:
            while True:
                await state.event.wait()
                state.event.clear()
                if state.error is not None:
                    raise state.error
                outs, state.pending = state.pending, []
                delta_text, delta_ids = "", []
                for out in outs:
                    delta_text += out.text
                    delta_ids += out.new_token_ids
                    self._absorb(state, out)
                finished = state.finished_reason is not None
                fr = state.finished_reason
                if finished and fr.get("type") == "abort" and fr.get("status_code") and not state.output_ids:
                    raise RequestError(fr.get("message") or "Request aborted", int(fr["status_code"]))
                if obj.stream or finished:
                    yield self._response(rid, state, delta_text, delta_ids)
                if finished:
                    return
        finally:
            if not finished and rid in self.rid_to_state and self.dead_reason is None:
                self.abort_request(rid)
            self.rid_to_state.pop(rid, None)

    def _absorb(self, state: ReqState, out: StrOut) -> None:
        state.text += out.text
        state.output_ids += out.new_token_ids
        state.prompt_tokens = out.prompt_tokens
        state.completion_tokens = out.completion_tokens
        state.cached_tokens = out.cached_tokens
        if out.finished_reason is not None:
            state.finished_reason = out.finished_reason
        if out.logprobs is not None:
            lp = out.logprobs
            for key in _LOGPROB_KEYS:
                val = getattr(lp, key)
                if val is None:
                    continue
                state.logprobs.setdefault(key, [])
                state.logprobs[key] += val

    def _with_text(self, entries, with_text: bool):
        """(logprob, id) -> SGLang's (logprob, id, text_or_None), recursively for top-k lists."""
        if entries is None:
            return None
        out = []
        for e in entries:
            if e is None:
                out.append(None)
            elif isinstance(e, list):
                out.append(self._with_text(e, with_text))
            else:
                lp, tid = e
                out.append((lp, tid, self.tokenizer.decode([tid]) if with_text else None))
        return out

    def _response(self, rid: str, state: ReqState, delta_text: str, delta_ids: List[int]) -> dict:
        obj = state.obj
        incremental = self.server_args.incremental_streaming_output and obj.stream
        meta = {
            "id": rid,
            "finish_reason": state.finished_reason,
            "prompt_tokens": state.prompt_tokens,
            "completion_tokens": state.completion_tokens,
            "cached_tokens": state.cached_tokens,
            "e2e_latency": time.time() - state.created,
        }
        if obj.return_logprob:
            for key in _LOGPROB_KEYS:
                if key.endswith("ids_logprobs") and not obj.token_ids_logprob:
                    continue
                if key.endswith("top_logprobs") and obj.top_logprobs_num <= 0:
                    continue
                meta[key] = self._with_text(state.logprobs.get(key, []), obj.return_text_in_logprobs)
        return {
            "text": delta_text if incremental else state.text,
            "output_ids": delta_ids if incremental else list(state.output_ids),
            "meta_info": meta,
        }

    async def generate(self, req: Union[GenerateReqInput, "PreparedReq"]) -> dict:
        """Run one request to completion and return its final response dict."""
        result = None
        async for out in self.generate_request(req):
            result = out
        return result
