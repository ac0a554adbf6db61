"""Sessions (SGLang's /open_session, /close_session and ``session_params``): the scheduler side.

A session groups the turns of one conversation. Each turn's prompt is built here from an earlier turn's
tokens plus the request's new ids (a leading BOS of the new ids stripped), so the client sends only what is
new.

- **Classic sessions** keep a tree of turns (`SessionReqNode`). A turn names its parent with
  ``session_params.rid``: its prompt is the parent's prompt + output (prompt only with
  ``drop_previous_output``), cut to ``offset`` tokens when given, plus the new ids. ``replace`` aborts the
  parent if it still runs and drops (aborting) the parent's other branches; without ``replace`` the parent
  must have finished. No ``rid``: a new root (with ``replace``: every earlier turn is dropped first). The
  radix cache supplies the reuse of the history's KV.
- **Streaming sessions** (``--enable-streaming-session``) are append-only, one turn at a time: turn n's
  prompt is turn n-1's prompt + output plus the new ids, and the session keeps its request slot and KV
  between turns (mem_cache/session_kv.py), so turn n prefills only its new tokens. ``offset``, ``replace``
  and ``drop_previous_output`` are refused (400) without touching the session; ``rid``, when given, must
  name the last completed turn.

A request the session refuses (unknown rid, a parent still running, a streaming turn while another runs,
or any later check of the combined prompt) answers 400 and leaves the session as it was. A session times
out after ``timeout`` seconds without a new turn (and with none running); closing one whose turn runs waits
for the turn. A session lives on one data-parallel rank; all its turns go there.

This module is pure bookkeeping (no ZMQ, no JAX); the Scheduler calls it.
"""

from __future__ import annotations

import dataclasses
import logging
import uuid
from typing import Callable, Dict, List, Optional

from sgl_jax.srt.io_struct import OpenSessionReqInput, SessionParams
from sgl_jax.srt.mem_cache.session_kv import SessionKV
from sgl_jax.srt.sampling.sampling_params import ContextLengthExceeded, clip_max_new_tokens

logger = logging.getLogger(__name__)


class SessionError(Exception):
    """A request or call the session refuses; ``status_code`` is the HTTP status (400 unless said)."""

    def __init__(self, message: str, status_code: int = 400):
        super().__init__(message)
        self.message = message
        self.status_code = status_code


@dataclasses.dataclass
class SessionReqNode:
    """One turn of a classic session: its Req (prompt and output), its parent turn and its child turns."""

    req: object
    parent: Optional["SessionReqNode"] = None
    children: List["SessionReqNode"] = dataclasses.field(default_factory=list)


class Session:
    """One open session (see the module docstring).

    Args:
        session_id: its id; rank: the DP rank holding it; streaming: a streaming session.
        timeout: seconds of inactivity before it is closed (None: never); now: the scheduler clock (s).
        kv: a streaming session's KV holder (its rank's `KVMemory.new_session_kv`); None for a classic session.
    """

    def __init__(self, session_id: str, rank: int, streaming: bool, timeout: Optional[float], now: float,
                 capacity_of_str_len: int = 0, kv: Optional[SessionKV] = None):
        self.session_id = session_id
        self.rank = rank
        self.streaming = streaming
        self.timeout = timeout
        self.capacity_of_str_len = capacity_of_str_len
        self.last_active = now
        self.close_on_finish = False
        self.lora_name: Optional[str] = None  # the LoRA adapter of its turns (a streaming session's KV is its)
        self.req_nodes: Dict[str, SessionReqNode] = {}  # classic: every turn by rid
        if streaming and kv is None:
            raise ValueError("a streaming session needs its KV holder (KVMemory.new_session_kv)")
        self.kv: Optional[SessionKV] = kv if streaming else None
        self.turn = None  # streaming: the latest turn created (running until it finishes)

    def holds_kv(self) -> bool:
        """A streaming session holding its request slot and KV now (between turns)."""
        return self.kv is not None and self.kv.has_kv()

    def busy(self) -> bool:
        """A turn of the session is queued or running."""
        if self.streaming:
            return self.turn is not None and not self.turn.finished()
        return any(not n.req.finished() for n in self.req_nodes.values())

    def timed_out(self, now: float) -> bool:
        return self.timeout is not None and now - self.last_active > self.timeout and not self.busy()

    # ------------------------------------------------------------ building a turn
    def build_input(self, params: SessionParams, new_ids: List[int], bos_token_id: Optional[int]):
        """(prompt ids, parent node or None) of a new turn; nothing changes yet.

        Raises:
            SessionError: 400 -- the turn cannot be built (see the module docstring).
        """
        if self.close_on_finish:
            raise SessionError(f"Session {self.session_id!r} is closing")
        if self.streaming:
            return self._streaming_input(params, new_ids, bos_token_id), None
        parent = None
        if params.rid is not None:
            parent = self.req_nodes.get(params.rid)
            if parent is None:
                raise SessionError(f"Session {self.session_id!r} has no turn with rid {params.rid!r}")
            if not params.replace and not parent.req.finished():
                raise SessionError(f"Turn {params.rid!r} of session {self.session_id!r} has not finished; wait "
                                   "for it or continue it with replace: true")
        if parent is None:
            return list(new_ids), None
        p = parent.req
        history = list(p.origin_input_ids) + ([] if params.drop_previous_output else list(p.output_ids))
        if params.offset:
            if not -len(history) <= params.offset <= len(history):
                raise SessionError(f"offset {params.offset} is outside the parent turn's {len(history)} tokens "
                                   f"[-{len(history)}, {len(history)}]")
            history = history[:params.offset]
        return history + _strip_bos(new_ids, bos_token_id), parent

    def _streaming_input(self, params: SessionParams, new_ids: List[int], bos_token_id: Optional[int]):
        if self.busy():
            raise SessionError(f"Streaming session {self.session_id!r} already has a turn running "
                               f"({self.turn.rid!r}); send the next turn when it finishes")
        for name in ("offset", "replace", "drop_previous_output"):
            if getattr(params, name):
                raise SessionError(f"Streaming sessions are append-only: '{name}' is not supported")
        holder = self.kv.holder
        if params.rid is not None and (holder is None or params.rid != holder.rid):
            last = "none has" if holder is None else f"the last is {holder.rid!r}"
            raise SessionError(f"Streaming sessions are append-only: rid {params.rid!r} is not the session's "
                               f"last completed turn ({last})")
        history = self.kv.history_ids()
        return list(history) + (_strip_bos(new_ids, bos_token_id) if history else list(new_ids))

    def register(self, req, parent: Optional[SessionReqNode], params: SessionParams,
                 abort: Callable[[str, str], None], now: float) -> None:
        """Record a turn that passed every check (it is queued next): classic ``replace`` aborts and drops
        what it replaces now."""
        self.last_active = now
        if self.streaming:
            self.turn = req
            req.session_kv = self.kv
            return
        if params.replace:
            if parent is None:
                for node in [n for n in self.req_nodes.values() if n.parent is None]:
                    self._drop(node, abort)
            else:
                if not parent.req.finished():
                    abort(parent.req.rid, "Aborted: replaced by a new turn of its session")
                for child in list(parent.children):
                    self._drop(child, abort)
        for n in self.req_nodes.values():
            if n.req.finished():
                _slim(n.req)
        node = SessionReqNode(req, parent)
        if parent is not None:
            parent.children.append(node)
        self.req_nodes[req.rid] = node

    def _drop(self, node: SessionReqNode, abort: Callable[[str, str], None]) -> None:
        for child in list(node.children):
            self._drop(child, abort)
        if not node.req.finished():
            abort(node.req.rid, "Aborted: its session branch was replaced")
        if node.parent is not None and node in node.parent.children:
            node.parent.children.remove(node)
        self.req_nodes.pop(node.req.rid, None)


def _slim(req) -> None:
    """Drop what a finished turn no longer needs (a later turn reads only its token ids)."""
    req.prefix_indices = req.prefix_indices[:0]
    req.grammar = None
    req.input_token_logprobs = req.input_top_logprobs = req.input_token_ids_logprobs = None
    req.output_token_logprobs, req.output_top_logprobs, req.output_token_ids_logprobs = [], [], []


def _strip_bos(ids: List[int], bos_token_id: Optional[int]) -> List[int]:
    """The new ids of a turn that continues a history, without a leading BOS (SGLang's rule)."""
    if bos_token_id is not None and ids and ids[0] == bos_token_id:
        return list(ids[1:])
    return list(ids)


class SessionController:
    """The scheduler's open sessions.

    Args:
        num_ranks: DP ranks (a new session goes to the one with the fewest sessions, lowest first).
        max_streaming_per_rank: streaming sessions one rank may hold (each keeps a request slot).
        new_session_kv: per rank, what builds a streaming session's KV holder (`KVMemory.new_session_kv`).
        enable_streaming: --enable-streaming-session.
    """

    REAP_INTERVAL_S = 1.0

    def __init__(self, num_ranks: int, max_streaming_per_rank: int, new_session_kv: List[Callable[[], SessionKV]],
                 enable_streaming: bool):
        self.num_ranks = num_ranks
        self.max_streaming_per_rank = max_streaming_per_rank
        self.new_session_kv = new_session_kv
        self.enable_streaming = enable_streaming
        self.sessions: Dict[str, Session] = {}
        self.num_timed_out = 0
        self._last_reap = 0.0

    def open(self, req: OpenSessionReqInput, now: float) -> Session:
        """Open a session.

        Raises:
            SessionError: 400 -- a duplicate id, streaming when --enable-streaming-session is off, a bad
                timeout, or every rank already holds its most streaming sessions.
        """
        sid = req.session_id if req.session_id is not None else uuid.uuid4().hex
        if sid in self.sessions:
            raise SessionError(f"Session {sid!r} is already open")
        if req.streaming and not self.enable_streaming:
            raise SessionError("Streaming sessions are disabled; relaunch with --enable-streaming-session")
        if req.timeout is not None and not req.timeout > 0:
            raise SessionError(f"timeout must be > 0 seconds, got {req.timeout}")
        counts = [0] * self.num_ranks
        for s in self.sessions.values():
            counts[s.rank] += 1
        rank = min(range(self.num_ranks), key=lambda r: (counts[r], r))
        if req.streaming:
            streaming = [0] * self.num_ranks
            for s in self.sessions.values():
                streaming[s.rank] += s.streaming
            rank = min(range(self.num_ranks), key=lambda r: (streaming[r], counts[r], r))
            if streaming[rank] >= self.max_streaming_per_rank:
                raise SessionError(f"Too many streaming sessions: each holds a request slot, and at most "
                                   f"{self.max_streaming_per_rank} per rank leave one for other requests "
                                   "(raise --max-running-requests or close sessions)")
        session = Session(sid, rank, bool(req.streaming), req.timeout, now, req.capacity_of_str_len,
                          self.new_session_kv[rank]() if req.streaming else None)
        self.sessions[sid] = session
        logger.info("Session %s opened (%s%s)", sid, "streaming" if session.streaming else "classic",
                    f", timeout {req.timeout:g} s" if req.timeout is not None else "")
        return session

    def get(self, session_id: str) -> Session:
        """The open session `session_id`. Raises SessionError (400) when there is none."""
        session = self.sessions.get(session_id)
        if session is None:
            raise SessionError(f"Session {session_id!r} does not exist (never opened, closed or timed out)")
        return session

    def request_close(self, session_id: str, release: Callable[[Session], None]) -> None:
        """Close a session now, or when its running turn finishes (new turns are refused meanwhile).

        Raises:
            SessionError: 404 -- no such session.
        """
        session = self.sessions.get(session_id)
        if session is None:
            raise SessionError(f"Session {session_id!r} does not exist (never opened, closed or timed out)", 404)
        session.close_on_finish = True
        if not session.busy():
            self._close(session, release, "closed")

    def _close(self, session: Session, release: Callable[[Session], None], why: str) -> None:
        del self.sessions[session.session_id]
        release(session)
        logger.info("Session %s %s", session.session_id, why)

    def reap(self, now: float, release: Callable[[Session], None]) -> int:
        """Close sessions whose close waited for a turn that has finished, and idle ones past their timeout
        (at most once per REAP_INTERVAL_S). Returns how many were closed."""
        if now - self._last_reap < self.REAP_INTERVAL_S:
            return 0
        self._last_reap = now
        n = 0
        for session in list(self.sessions.values()):
            if session.busy():  # a running turn counts as activity: the timeout runs from its end
                session.last_active = now
            elif session.close_on_finish:
                self._close(session, release, "closed (its last turn finished)")
                n += 1
            elif session.timed_out(now):
                self.num_timed_out += 1
                self._close(session, release, f"timed out after {session.timeout:g} s idle")
                n += 1
        return n

    def on_rank(self, rank: int) -> List[Session]:
        return [s for s in self.sessions.values() if s.rank == rank]


def check_turn(msg, session: Session, input_ids, context_len: int, allow_auto_truncate: bool) -> None:
    """Checks of a session turn (`msg`, a TokenizedGenerateReqInput) that need its whole prompt `input_ids` (the
    TokenizerManager saw only the new ids); the scheduler runs them before queueing the turn.

    Raises:
        SessionError: 400 -- another LoRA adapter than the one a streaming session's KV was computed under, input
            logprobs from before a streaming turn's new tokens (that KV is reused, not recomputed), a
            logprob_start_len past the prompt, or an explicit max_new_tokens that exceeds the context with the
            history (SGLang's rule; clipped with --allow-auto-truncate).
    """
    n = len(input_ids)
    if session.streaming and session.kv.has_kv() and msg.lora_path != session.lora_name:
        raise SessionError(f"lora_path {msg.lora_path!r} differs from the streaming session's adapter "
                           f"({session.lora_name!r}), under which its KV was computed")
    if msg.return_logprob and msg.logprob_start_len >= n:
        raise SessionError(f"logprob_start_len ({msg.logprob_start_len}) must be less than the turn's input "
                           f"length ({n}, with the session's history)")
    history = len(session.kv.history_ids()) if session.streaming else 0
    if history and msg.return_logprob and 0 <= msg.logprob_start_len < history:
        raise SessionError(f"A streaming session's turn reuses its history's KV: input logprobs start at "
                           f"logprob_start_len >= {history} (the history's length)")
    if allow_auto_truncate:  # (the scheduler clips max_new_tokens when it queues the turn)
        return
    try:
        clip_max_new_tokens(n, msg.sampling_params.max_new_tokens, context_len, False,
                            "of input (with the session's history)")
    except ContextLengthExceeded as e:
        raise SessionError(str(e)) from None
