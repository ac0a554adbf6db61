"""TokenizerManager: the asyncio front of the engine (runs in the HTTP or Engine process).

It tokenizes and validates requests, sends them to the scheduler, and turns the detokenizer's
BatchStrOut stream into SGLang-shaped response dicts: ``{"text", "output_ids", "meta_info"}``.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import logging
import re
import time
import uuid
from typing import AsyncIterator, Dict, List, Optional, Union

import zmq
import zmq.asyncio

from sgl_jax.srt.configs.model_config import load_tokenizer, served_model_name, tokenizer_path_for
from sgl_jax.srt.io_struct import (
    ANSWERS,
    AbortReq,
    BatchStrOut,
    ControlOutput,
    FlushCacheReq,
    FlushCacheReqOutput,
    GetInternalStateReq,
    GetInternalStateReqOutput,
    LoRAUpdateOutput,
    CloseSessionReqInput,
    CloseSessionReqOutput,
    OpenSessionReqInput,
    OpenSessionReqOutput,
    SchedulerInfo,
    SessionParams,
    StrOut,
    TokenizedGenerateReqInput,
)
from sgl_jax.srt.errors import RequestError  # noqa: F401  (re-exported)
from sgl_jax.srt.preflight import KVLimits, check_fits
from sgl_jax.srt.tokenizer.retrieval_client import RetrievalClient
from sgl_jax.srt.tokenizer.score_client import ScoreClient
from sgl_jax.srt.tokenizer.score_request import ScoreReqInput
from sgl_jax.srt.metrics.collector import MetricsCollector, RequestTimes
from sgl_jax.srt.sampling.sampling_params import ContextLengthExceeded, SamplingParams, clip_max_new_tokens

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class GenerateReqInput:
    """One native /generate request (a single prompt), as the TokenizerManager takes it.

    Fields and meanings follow SGLang's GenerateReqInput. `text` or `input_ids` gives the prompt. Built from
    a validated ``entrypoints.native_protocol.GenerateRequest`` (or the OpenAI endpoints' requests): types
    and single-field ranges are already checked; `TokenizerManager.validate` checks the rest.
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
    session_params: Optional[dict] = None  # SGLang's SessionParams fields (scheduler/sessions.py)
    return_routed_experts: bool = False
    lora_path: Optional[str] = None  # a loaded LoRA adapter's name (None: the base model)


_KEEPING_PRE_TOKENIZERS = {"Sequence", "ByteLevel", "Metaspace", "Digits", "Punctuation", "Split", "UnicodeScripts"}


def max_chars_per_token(tokenizer) -> Optional[int]:
    """The most input characters one token can stand for, or None when that cannot be bounded.

    Bounded for tokenizers that keep every input character: no normalizer (which could shrink the text)
    and only pre-tokenizers that split without dropping (byte-level, metaspace, digits, ...; not whitespace
    splitters). Then a vocabulary token of L characters in the tokenizer's alphabet (one per byte for
    byte-level BPE) covers at most L input characters, and an added token its content's length. Used to
    refuse a text that cannot fit the context without tokenizing it (a 10 MB prompt costs seconds of
    tokenizer time otherwise).
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or backend.normalizer is not None:
        return None
    pre = repr(backend.pre_tokenizer) if backend.pre_tokenizer is not None else ""
    if "Removed" in pre or not set(re.findall(r"(\w+)\(", pre)) <= _KEEPING_PRE_TOKENIZERS:
        return None
    vocab = backend.get_vocab(with_added_tokens=True)
    if not vocab or droppable_chars(tokenizer) is None:
        return None
    return max(len(t) for t in vocab)


def _byte_level_chars() -> List[str]:
    """The character byte-level BPE writes for each byte 0..255 (GPT-2's reversible byte-to-unicode map:
    printable Latin-1 bytes stand for themselves, the others take code points from 256 on, in byte order)."""
    keep = set(range(ord("!"), ord("~") + 1)) | set(range(0xA1, 0xAD)) | set(range(0xAE, 0x100))
    chars, extra = [], 0
    for b in range(256):
        if b in keep:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return chars


def droppable_chars(tokenizer) -> Optional[str]:
    """Input characters a tokenizer may turn into no token at all, or None when that cannot be told.

    A byte-level BPE vocabulary may lack some bytes' characters (SmolLM2's has no token for the ASCII controls
    0x04, 0x06, 0x13, 0x14, 0x16, 0x1d) and, without an unknown token, drops them silently. Those ASCII
    characters are returned (a multi-byte UTF-8 character keeps at least one token, from its continuation
    bytes, unless one of 0x80-0xbf is missing too: then None; SmolLM2 lacks only the lead bytes 0xf1, 0xf2). Tokenizers of other kinds: "" when the model falls back
    to bytes or an unknown token, else None.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    model = backend.model
    if getattr(model, "byte_fallback", False) or getattr(model, "unk_token", None) or \
            getattr(model, "unk_id", None) is not None:
        return ""
    if "ByteLevel" not in repr(backend.pre_tokenizer):
        return None
    vocab = backend.get_vocab(with_added_tokens=False)
    missing = [b for b, c in enumerate(_byte_level_chars()) if c not in vocab]
    if any(0x80 <= b < 0xC0 for b in missing):  # a continuation byte: some multi-byte character could vanish
        return None
    return "".join(chr(b) for b in missing if b < 0x80)


def min_token_count(text: str, chars_per_token: int, droppable: str) -> int:
    """A lower bound on the tokens `text` encodes to: its characters that cannot vanish, divided by the most
    characters one token covers (`max_chars_per_token`; `droppable` from `droppable_chars`)."""
    kept = len(text) - sum(text.count(c) for c in droppable)
    return -(-kept // chars_per_token)


@dataclasses.dataclass
class PreparedReq:
    """A tokenized, validated request ready to send."""

    obj: GenerateReqInput
    input_ids: List[int]
    sampling_params: SamplingParams
    received_time: float = dataclasses.field(default_factory=time.perf_counter)  # arrival, before tokenizing


def spec_meta_info(spec: dict, completion_tokens: int) -> dict:
    """SGLang's speculative-decoding entries of ``meta_info`` from a request's counts
    (scheduler/speculative/speculation.SpecCounts): ``spec_verify_ct`` (verify steps), ``spec_accept_length``
    (completion tokens per verify step, SGLang's average accept length; 0 before the first), ``spec_accept_rate``
    (accepted / drafted tokens; 0 before the first draft), ``spec_accept_token_num`` and ``spec_draft_token_num``."""
    ct, drafted, accepted = spec["verify_ct"], spec["draft_tokens"], spec["accepted_tokens"]
    return {"spec_verify_ct": ct, "spec_accept_length": completion_tokens / ct if ct else 0.0,
            "spec_accept_rate": accepted / drafted if drafted else 0.0, "spec_accept_token_num": accepted,
            "spec_draft_token_num": drafted}


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
    routed_experts: Optional[str] = None  # base64 int32 [output tokens, layers, top-k], from the final output
    spec: Optional[dict] = None  # speculative decoding's counts (the latest output's)
    created: float = dataclasses.field(default_factory=time.time)
    error: Optional[RequestError] = None
    # set when the client went away or the request failed before its end: the rid stays reserved until
    # the scheduler's final message for it arrives, so nothing of this request reaches a new one
    orphaned_at: Optional[float] = None
    released: bool = False  # the scheduler's final message for it has arrived
    times: Optional[RequestTimes] = None  # for the latency metrics (--enable-metrics)


ORPHAN_TTL_S = 120.0  # an aborted request's rid is freed at the latest this long after its abort
RESERVATION_TTL_S = 5.0  # room reserved for an admitted request's sequences is held at most this long
CONTROL_TIMEOUT_S = 3600.0  # a weight update may wait for running requests and read a large checkpoint


_LOGPROB_KEYS = ("input_token_logprobs", "input_top_logprobs", "input_token_ids_logprobs",
                 "output_token_logprobs", "output_top_logprobs", "output_token_ids_logprobs")


class TokenizerManager:
    """Front of the engine. Create inside (or before) the event loop that will use it; call `start()` there.

    Args:
        server_args: `ServerArgs`.
        port_args: `PortArgs`.
        scheduler_info: what the scheduler reported when ready (`SchedulerInfo`: limits such as
            max_req_input_len, context_len).
        tokenizer: the tokenizer `load_tokenizer` gives for `server_args`, already loaded (the launcher loads it
            while the scheduler starts); None: loaded here.
    """

    def __init__(self, server_args, port_args, scheduler_info: SchedulerInfo, tokenizer=None):
        self.server_args = server_args
        self.tokenizer_path = tokenizer_path_for(server_args)
        # (the launcher loads it while the scheduler starts: entrypoints/launch.launch_with_tokenizer)
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(server_args)
        self.served_model_name = served_model_name(server_args)
        # tokenization and chat templates run here, off the event loop (one thread: HF fast tokenizers are
        # not safe to reconfigure from several threads at once)
        self._tokenizer_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="sgl-jax-tokenize")
        self.max_chars_per_token = max_chars_per_token(self.tokenizer)
        self.droppable_chars = droppable_chars(self.tokenizer) or ""
        self.info = scheduler_info
        self.context_len = scheduler_info.context_len
        self.vocab_size = scheduler_info.vocab_size
        self.kv_limits = KVLimits.from_info(scheduler_info)
        # --enable-lora: the loaded adapters (name -> path), kept in step with the scheduler's answers to loads and
        # unloads; None: no LoRA
        self.lora_adapters: Optional[Dict[str, str]] = (None if scheduler_info.lora_adapters is None
                                                        else dict(scheduler_info.lora_adapters))
        self.weight_version: str = server_args.weight_version  # the served weights' label (weight updates)
        self.memory_released = False  # KV or weights off the devices (release_memory_occupation): 503
        ctx = zmq.asyncio.Context(2)
        # no linger, as close() does: a manager dropped without close() (a test's) must not block the
        # interpreter's exit in Context.term() on messages for a scheduler that is gone
        ctx.linger = 0
        self.recv_from_detokenizer = ctx.socket(zmq.PULL)
        self.recv_from_detokenizer.bind(port_args.tokenizer_ipc_name)
        self.send_to_scheduler = ctx.socket(zmq.PUSH)
        self.send_to_scheduler.connect(port_args.scheduler_input_ipc_name)
        self.rid_to_state: Dict[str, ReqState] = {}
        self._control_waiters: Dict[str, asyncio.Future] = {}  # control request id -> its answer (`control`)
        self._loop_task: Optional[asyncio.Task] = None
        self.loop: Optional[asyncio.AbstractEventLoop] = None  # the loop serving this manager, once started
        self.dead_reason: Optional[str] = None
        self.draining: Optional[str] = None  # why new requests are refused (SIGTERM: graceful shutdown)
        self.num_rejected_reqs = 0  # requests refused with 503 because the queue was full (--max-queued-requests)
        self._reservations: collections.deque = collections.deque()  # check_admission(reserve=True) times
        self.score_client = ScoreClient(self)
        # /v1/rerank and /v1/embeddings: the model's kind (reranker, embedding model, encoder, classifier)
        self.retrieval = RetrievalClient(self)
        self.metrics: Optional[MetricsCollector] = (MetricsCollector(self.served_model_name)
                                                    if server_args.enable_metrics else None)

    # ------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Start the receive loop on the running event loop (idempotent)."""
        if self._loop_task is None:
            self.loop = asyncio.get_running_loop()
            self._loop_task = self.loop.create_task(self._handle_loop())

    async def close(self) -> None:
        """Stop the receive loop, then `close_sockets`."""
        if self._loop_task is not None:
            self._loop_task.cancel()
            try:
                await self._loop_task
            except asyncio.CancelledError:
                pass
            self._loop_task = None
        self.close_sockets()

    def close_sockets(self) -> None:
        """Close the sockets (no linger) and the tokenizer pool; all a manager whose loop never started needs (a
        test's). A manager dropped with its sockets open can have its ZMQ context collected first, in one
        garbage cycle with them, and ``Context.term()`` then blocks for good on the open sockets."""
        self.recv_from_detokenizer.close(linger=0)
        self.send_to_scheduler.close(linger=0)
        self._tokenizer_pool.shutdown(wait=False, cancel_futures=True)

    def mark_dead(self, reason: str) -> None:
        """A child process died: fail every pending request (called from the event loop thread)."""
        self.dead_reason = reason
        for state in self.rid_to_state.values():
            state.error = RequestError(f"Server unavailable: {reason}", 503)
            state.event.set()
        self.score_client.fail_all(RequestError(f"Server unavailable: {reason}", 503))
        for waiter in self._control_waiters.values():
            if not waiter.done():
                waiter.set_exception(RequestError(f"Server unavailable: {reason}", 503))

    def _check_alive(self) -> None:
        if self.dead_reason is not None:
            raise RequestError(f"Server unavailable: {self.dead_reason}", 503)

    def num_in_flight(self) -> int:
        """Requests sent to the scheduler and not yet finished there (aborted ones too, until the scheduler
        has let them go; a /v1/score request counts once)."""
        return len(self.rid_to_state) + self.score_client.num_live()

    def queue_capacity(self) -> Optional[int]:
        """The most requests in flight before new ones are refused: what the scheduler runs at once
        (max_running_requests x dp_size) plus --max-queued-requests; None without that flag."""
        limit = self.server_args.max_queued_requests
        if limit is None:
            return None
        return self.info.max_running_requests * self.info.dp_size + limit

    def check_admission(self, num_seqs: int = 1, reserve: bool = False) -> None:
        """Backpressure: may a request of `num_seqs` sequences (its whole n / best_of / batch fan-out) be sent now?

        A request is queued when it is in flight beyond what the scheduler runs at once: with
        --max-queued-requests N, a new request is refused when in flight + `num_seqs` would exceed
        max_running_requests x dp_size + N (SGLang's flag counts its waiting queue; this bound is checked
        before anything is sent, for the whole fan-out at once, so no request is ever half admitted).
        With `reserve`, room for the `num_seqs` sequences is held until each is sent (``generate_request``
        with ``admitted=True``) or for RESERVATION_TTL_S at most, so concurrent requests cannot overshoot.

        Raises:
            RequestError: 503 with Retry-After while the server shuts down (SIGTERM) or the queue is full;
                413 when the fan-out alone is larger than the queue can ever hold.
        """
        self._check_alive()
        if self.draining is not None:
            raise RequestError(f"The server is shutting down ({self.draining}); not accepting new requests", 503,
                               retry_after_s=5)
        if self.memory_released:
            raise RequestError("The server's device memory is released (/release_memory_occupation); retry once "
                               "/resume_memory_occupation has restored it", 503, retry_after_s=5)
        cap = self.queue_capacity()
        if cap is None:
            return
        if num_seqs > cap:
            raise RequestError(f"The request has {num_seqs} sequences; this server holds at most {cap} requests "
                               f"running or queued (--max-queued-requests {self.server_args.max_queued_requests})",
                               413)
        now = time.monotonic()
        while self._reservations and now - self._reservations[0] > RESERVATION_TTL_S:
            self._reservations.popleft()
        live = self.num_in_flight() + len(self._reservations)
        if live + num_seqs > cap:
            self.num_rejected_reqs += 1
            if self.metrics is not None:
                self.metrics.num_rejected_requests.inc()
            raise RequestError(f"The request queue is full ({live} requests in flight, at most {cap}: "
                               f"--max-queued-requests {self.server_args.max_queued_requests}); retry later", 503,
                               retry_after_s=1)
        if reserve:
            self._reservations.extend([now] * num_seqs)

    async def _handle_loop(self) -> None:
        while True:
            msg = await self.recv_from_detokenizer.recv_pyobj()
            if isinstance(msg, BatchStrOut):
                for out in msg.outs:
                    state = self.rid_to_state.get(out.rid)
                    if state is None:
                        continue
                    if state.orphaned_at is not None:
                        if out.finished_reason is not None:  # the scheduler is done with it: free the rid
                            del self.rid_to_state[out.rid]
                        continue
                    if out.finished_reason is not None:
                        state.released = True
                    if out.error is not None:  # this request failed in the detokenizer
                        state.error = RequestError(out.error, 500)
                    else:
                        state.pending.append(out)
                        if self.metrics is not None and state.times is not None:
                            self._observe_metrics(state.times, out)
                    state.event.set()
            elif self.score_client.on_message(msg):
                pass
            elif isinstance(msg, ANSWERS):
                waiter = self._control_waiters.get(msg.request_id)
                if waiter is not None and not waiter.done():
                    waiter.set_result(msg)
            else:
                logger.error("Unknown message from the scheduler: %s", type(msg).__name__)

    def _observe_metrics(self, times: RequestTimes, out: StrOut) -> None:
        fr = out.finished_reason
        self.metrics.observe_output(times, out.completion_tokens, fr is not None, out.prompt_tokens,
                                    out.cached_tokens, aborted=fr is not None and fr.get("type") == "abort")

    def check_lora(self, name: Optional[str]) -> None:
        """Raises RequestError (400, param lora_path) unless adapter `name` is loaded (None: the base model)."""
        if name is None:
            return
        if self.lora_adapters is None:
            raise RequestError(f"lora_path {name!r}: this server serves no LoRA adapters (start it with "
                               "--enable-lora)", param="lora_path")
        if name not in self.lora_adapters:
            raise RequestError(f"LoRA adapter {name!r} is not loaded; loaded adapters: {sorted(self.lora_adapters)}",
                               param="lora_path")

    async def update_lora(self, obj) -> LoRAUpdateOutput:
        """/load_lora_adapter (a `LoadLoRAAdapterReqInput`) or /unload_lora_adapter (`UnloadLoRAAdapterReqInput`):
        the scheduler's answer, whose adapter list this manager then validates requests against. A load may
        download the adapter: it is given up to 10 minutes."""
        out: LoRAUpdateOutput = await self.control(obj, timeout=600.0)
        if out.loaded_adapters is not None and self.lora_adapters is not None:
            self.lora_adapters = dict(out.loaded_adapters)
        return out

    async def control(self, obj, timeout: float = CONTROL_TIMEOUT_S):
        """The one channel for a request the scheduler answers (sessions, LoRA, cache flush, internal state, and
        the weights, memory, pause and profile requests of io_struct.CONTROL_REPLIES): `obj` gets a fresh
        request_id, and the answer with that id (one of io_struct.ANSWERS) is returned. An answer to a call that
        timed out or was cancelled is dropped, so it never answers a later call. A `ControlOutput`'s weight
        version and memory state this manager then reports and acts on (503 while memory is released). An update
        may wait for running requests and read a large checkpoint: `timeout` is CONTROL_TIMEOUT_S unless given.

        Raises:
            RequestError: 503 -- no answer within `timeout` seconds, or a child process died.
        """
        self.start()
        self._check_alive()
        obj.request_id = uuid.uuid4().hex
        waiter = self._control_waiters[obj.request_id] = self.loop.create_future()
        try:
            self.send_to_scheduler.send_pyobj(obj)
            out = await asyncio.wait_for(waiter, timeout)
        except asyncio.TimeoutError:
            raise RequestError("The scheduler did not answer in time", 503) from None
        finally:
            self._control_waiters.pop(obj.request_id, None)
        if not isinstance(out, ControlOutput):
            return out
        if out.success and "weight_version" in out.data:
            self.weight_version = out.data["weight_version"]
        if out.success and "kv_cache_released" in out.data:
            self.memory_released = bool(out.data["kv_cache_released"] or out.data["weights_released"])
        return out

    async def flush_cache(self) -> FlushCacheReqOutput:
        return await self.control(FlushCacheReq(), timeout=30.0)

    async def get_internal_state(self) -> dict:
        out: GetInternalStateReqOutput = await self.control(GetInternalStateReq(), timeout=30.0)
        return out.internal_state

    async def open_session(self, obj: OpenSessionReqInput) -> str:
        """Open a session (SGLang's /open_session); returns its id.

        Raises:
            RequestError: 400 -- a session with that id is open, streaming without
                --enable-streaming-session, or no room for another streaming session.
        """
        if obj.session_id is None:  # chosen here, so every node of a multi-host server opens the same id
            obj = dataclasses.replace(obj, session_id=uuid.uuid4().hex)
        out: OpenSessionReqOutput = await self.control(obj, timeout=30.0)
        if not out.success:
            raise RequestError(out.message or "Failed to open the session")
        return out.session_id

    async def close_session(self, session_id: str) -> None:
        """Close a session: its KV is released now, or when its running turn finishes.

        Raises:
            RequestError: 404 -- no open session has that id.
        """
        out: CloseSessionReqOutput = await self.control(CloseSessionReqInput(session_id), timeout=30.0)
        if not out.success:
            raise RequestError(out.message, 404)

    def abort_request(self, rid: str, message: str = "Aborted by the client") -> bool:
        """Abort the running generation request `rid`; False (nothing sent) when there is none."""
        state = self.rid_to_state.get(rid)
        if state is None or state.orphaned_at is not None:
            return False
        self.send_to_scheduler.send_pyobj(AbortReq(rid, message))
        return True

    def abort_all(self, message: str = "Aborted by the client") -> int:
        """Abort every running generation request; returns how many."""
        return sum(self.abort_request(rid, message) for rid in list(self.rid_to_state))

    def reserve_rid(self, rid: str) -> None:
        """Check that `rid` is free: no live request and no aborted one the scheduler has not finished.

        Raises:
            RequestError: 400 naming the rid.
        """
        self._expire_orphans()
        state = self.rid_to_state.get(rid)
        if state is not None and state.orphaned_at is not None:
            raise RequestError(f"Request id {rid!r} belongs to an aborted request that is still being "
                               "released; use a new rid")
        if state is not None or self.score_client.is_live(rid):
            raise RequestError(f"Duplicate request id {rid!r}: a request with this rid is running")

    def _expire_orphans(self) -> None:
        now = time.time()
        for rid in [r for r, st in self.rid_to_state.items()
                    if st.orphaned_at is not None and now - st.orphaned_at > ORPHAN_TTL_S]:
            del self.rid_to_state[rid]

    # ------------------------------------------------------------ scoring
    async def score_request(self, obj: ScoreReqInput) -> dict:
        """Run a /v1/score request: {"scores": [[float per label] per item], "prompt_tokens", "algorithm"}.

        Raises RequestError (400 invalid, 413 cannot fit, 503 server down). See tokenizer/score_client.py.
        """
        self.start()
        return await self.score_client.score(obj)

    def check_generates(self, what: str = "generation") -> None:
        """Raise RequestError (400 naming ``model``) on an embedding server (--is-embedding), which answers
        /v1/embeddings only: every generation path (and scoring, `what`) asks this first."""
        if self.retrieval.is_embedding:
            raise RequestError(f"{self.served_model_name} is served as an embedding model (--is-embedding): it "
                               f"answers /v1/embeddings, not {what} requests", param="model")

    # ------------------------------------------------------------ generation
    async def run_blocking(self, fn, *args):
        """Run `fn(*args)` on the tokenizer thread, so the event loop (and /health) stays responsive while
        a long prompt is tokenized or a chat template rendered."""
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_pool, fn, *args)

    def tokenize(self, obj: GenerateReqInput) -> List[int]:
        """The prompt's token ids (``input_ids`` checked against the vocabulary, or `encode_text`)."""
        if obj.input_ids is not None:
            ids = list(obj.input_ids)
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise RequestError(f"input_ids contain ids outside the vocabulary [0, {self.vocab_size}): {bad[:5]}")
            return ids
        return self.encode_text(obj.text)

    def encode_text(self, text: str, add_special_tokens: bool = True) -> List[int]:
        """Token ids of a prompt text, cut at context length + 1 tokens (only that many ids cross into
        Python; a longer input is refused either way). A text that cannot fit whatever its tokenization
        (`max_chars_per_token`) is refused without tokenizing it.

        Raises:
            RequestError: 400, the text is longer than the context; 413, it cannot fit the KV pool (memory
                preflight, `preflight.check_fits`) -- both without tokenizing when its length alone tells.
        """
        cap = self.max_chars_per_token
        if cap and len(text) > min(self.context_len, self.kv_limits.kv_pool_tokens) * cap \
                and not self.server_args.allow_auto_truncate:
            n = min_token_count(text, cap, self.droppable_chars)
            if n >= self.context_len:
                raise RequestError(f"The input ({len(text)} characters, at least {n} tokens) is longer than the "
                                   f"model's context length ({self.context_len} tokens).")
            check_fits(self.kv_limits, n, what=f"The input of {len(text)} characters", at_least=True)
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens, truncation=True,
                                     max_length=self.context_len + 1)

    def validate(self, obj: GenerateReqInput, input_ids: List[int]) -> SamplingParams:
        """Check a request against the model and server limits; return its normalized SamplingParams.

        Raises:
            RequestError: 400 for invalid values, a prompt longer than the context, or a prompt plus
                max_new_tokens beyond the context (SGLang's rule); 413 when the prompt cannot fit the
                largest prefill bucket or the KV cache.
        """
        n = len(input_ids)
        if n == 0:
            raise RequestError("The prompt is empty")
        truncate = self.server_args.allow_auto_truncate
        if n >= self.context_len and truncate:  # SGLang's --allow-auto-truncate: keep the start
            logger.warning("Input of %s%d tokens truncated to the context length (%d tokens) - 1",
                           "at least " if obj.input_ids is None else "", n, self.context_len)
            del input_ids[self.context_len - 1:]
            n = len(input_ids)
        if n >= self.context_len:
            more = "at least " if n > self.context_len and obj.input_ids is None else ""
            raise RequestError(f"The input ({more}{n} tokens) is longer than the model's context length "
                               f"({self.context_len} tokens).")
        try:
            sp = SamplingParams.from_dict(obj.sampling_params)
            sp.verify(self.vocab_size)
        except (TypeError, ValueError) as e:
            raise RequestError(str(e)) from None
        sp.normalize(self.vocab_size)
        check_fits(self.kv_limits, n, min_output=max(1, sp.min_new_tokens))  # 413 (memory preflight)
        if (obj.sampling_params or {}).get("max_new_tokens") is not None:  # (a default is clipped by the scheduler)
            try:
                sp.max_new_tokens = clip_max_new_tokens(n, sp.max_new_tokens, self.context_len, truncate)
            except ContextLengthExceeded as e:
                raise RequestError(str(e)) from None
        if obj.return_routed_experts and not self.info.return_routed_experts:
            raise RequestError("return_routed_experts needs a mixture-of-experts model served with "
                               "--enable-return-routed-experts", param="return_routed_experts")
        self.check_lora(obj.lora_path)
        cap = self.server_args.max_top_logprobs_num
        if obj.top_logprobs_num > cap:
            raise RequestError(f"top_logprobs_num ({obj.top_logprobs_num}) exceeds the limit of {cap} "
                               "(--max-top-logprobs-num)")
        for t in obj.token_ids_logprob or []:
            if not 0 <= t < self.vocab_size:
                raise RequestError(f"token_ids_logprob entry {t} is outside the vocabulary [0, {self.vocab_size})")
        if obj.logprob_start_len >= n and obj.session_params is None:  # (a session's turn: the scheduler checks
            raise RequestError(f"logprob_start_len ({obj.logprob_start_len}) must be less than the input "
                               f"length ({n})")  # its whole prompt, history included)
        return sp

    def prepare(self, obj: GenerateReqInput) -> "PreparedReq":
        """Tokenize and validate now (on the calling thread), so errors surface before any response starts.

        Raises:
            RequestError: invalid request (400/413), or the server is down (503).
        """
        received = time.perf_counter()
        self._check_alive()
        self.check_generates()
        input_ids = self.tokenize(obj)
        return PreparedReq(obj, input_ids, self.validate(obj, input_ids), received)

    async def prepare_async(self, obj: GenerateReqInput) -> "PreparedReq":
        """`prepare` on the tokenizer thread (off the event loop)."""
        received = time.perf_counter()
        self._check_alive()
        req = await self.run_blocking(self.prepare, obj)
        req.received_time = received
        return req

    async def prepare_fanout(self, objs: List[GenerateReqInput]) -> List["PreparedReq"]:
        """Admit a request's whole fan-out (its prompts x n sequences) and prepare each sequence:
        `check_admission` for all of them before tokenizing, `prepare_async` each, then `check_admission` again,
        reserving their room until they are sent. Run them with ``generate_request(p, admitted=True)``.

        Raises:
            RequestError: from `check_admission` (503, 413) and `prepare` (400, 413).
        """
        self.check_admission(len(objs))
        prepared = [await self.prepare_async(o) for o in objs]
        self.check_admission(len(prepared), reserve=True)
        return prepared

    async def generate_request(self, req: Union[GenerateReqInput, "PreparedReq"],
                               admitted: bool = False) -> AsyncIterator[dict]:
        """Run one request; yields response dicts (every update when streaming, else only the final one).

        Args:
            admitted: the caller has passed `check_admission` for this request's whole fan-out (else it is
                checked here, for this sequence alone).
        On cancellation (client gone) the request is aborted in the scheduler, with one INFO log line.
        Raises:
            RequestError: invalid request or duplicate rid (400), 413 (preflight, or a fan-out larger than the
                queue), a failure of this request inside the engine (500, with the reason), or 503 (the server
                is down, shutting down, or its queue is full: `check_admission`).
        """
        if not isinstance(req, PreparedReq):
            req = await self.prepare_async(req)
        if not admitted:
            self.check_admission(1)
        else:
            self._check_alive()
            if self._reservations:
                self._reservations.popleft()  # (its room is now taken by the request itself)
        self.start()
        obj, input_ids, sp = req.obj, req.input_ids, req.sampling_params
        rid = obj.rid or uuid.uuid4().hex
        self.reserve_rid(rid)
        state = ReqState(obj=obj, event=asyncio.Event(),
                         times=RequestTimes(req.received_time) if self.metrics is not None else None)
        self.rid_to_state[rid] = state
        self.send_to_scheduler.send_pyobj(TokenizedGenerateReqInput(
            rid=rid, input_ids=input_ids, sampling_params=sp, return_logprob=obj.return_logprob,
            logprob_start_len=obj.logprob_start_len, top_logprobs_num=obj.top_logprobs_num,
            token_ids_logprob=obj.token_ids_logprob, stream=obj.stream,
            session_params=SessionParams(**obj.session_params) if obj.session_params is not None else None,
            return_routed_experts=obj.return_routed_experts, lora_path=obj.lora_path,
        ))
        if self.server_args.log_requests:
            logger.info("Request %s: %d input tokens, %s", rid, len(input_ids), sp)
        finished = False
        client_gone = True  # until the generator ends normally or with an error
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
                if finished and fr.get("type") == "abort" and fr.get("status_code") and (
                        not state.output_ids or int(fr["status_code"]) >= 500):
                    raise RequestError(fr.get("message") or "Request aborted", int(fr["status_code"]))
                if obj.stream or finished:
                    yield self._response(rid, state, delta_text, delta_ids)
                if finished:
                    return
        except RequestError:
            client_gone = False
            raise
        finally:
            self._end_request(rid, state, finished, client_gone)

    def _end_request(self, rid: str, state: ReqState, finished: bool, client_gone: bool) -> None:
        if self.rid_to_state.get(rid) is not state:
            return
        if finished or state.released or self.dead_reason is not None:
            del self.rid_to_state[rid]
            return
        # ended early: the client went away (or the engine failed it); abort it in the scheduler and keep
        # the rid reserved until the scheduler's final message for it arrives
        if client_gone:
            logger.info("Client disconnected: aborting request %s", rid)
        self.send_to_scheduler.send_pyobj(AbortReq(rid, "Aborted: the client disconnected"
                                                   if client_gone else "Aborted after an error"))
        state.orphaned_at = time.time()

    def _absorb(self, state: ReqState, out: StrOut) -> None:
        state.text += out.text
        state.output_ids += out.new_token_ids
        state.prompt_tokens = out.prompt_tokens
        state.completion_tokens = out.completion_tokens
        state.cached_tokens = out.cached_tokens
        if out.finished_reason is not None:
            state.finished_reason = out.finished_reason
        if out.routed_experts is not None:
            state.routed_experts = out.routed_experts
        if out.spec is not None:
            state.spec = out.spec
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
            "weight_version": self.weight_version,
        }
        if obj.return_logprob:
            for key in _LOGPROB_KEYS:
                if key.endswith("ids_logprobs") and not obj.token_ids_logprob:
                    continue
                if key.endswith("top_logprobs") and obj.top_logprobs_num <= 0:
                    continue
                meta[key] = self._with_text(state.logprobs.get(key, []), obj.return_text_in_logprobs)
        if state.routed_experts is not None:
            meta["routed_experts"] = state.routed_experts
        if state.spec is not None:
            meta.update(spec_meta_info(state.spec, state.completion_tokens))
        return {
            "text": delta_text if incremental else state.text,
            "output_ids": delta_ids if incremental else list(state.output_ids),
            "meta_info": meta,
        }

    async def generate(self, req: Union[GenerateReqInput, "PreparedReq"], admitted: bool = False) -> dict:
        """Run one request to completion and return its final response dict (`generate_request`)."""
        result = None
        async for out in self.generate_request(req, admitted):
            result = out
        return result
