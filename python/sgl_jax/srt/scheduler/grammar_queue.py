"""The scheduler's grammar queue: requests whose grammar compiles in the backend's worker thread.

SGLang's design: a structured-output request does not enter the waiting queue until its grammar is ready,
so compilation never blocks the scheduler loop or a batch. A request whose grammar fails to compile is
answered with HTTP 400.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

from sgl_jax.srt.constrained.grammar_backend import GrammarBackend, grammar_spec
from sgl_jax.srt.scheduler.schedule_batch import Req


class GrammarQueue:
    """Requests waiting for their grammar.

    Args:
        backend: the grammar backend, or None when structured output is off (``--grammar-backend none``).
    """

    def __init__(self, backend: Optional[GrammarBackend]):
        self.backend = backend
        self.reqs: List[Req] = []

    def __len__(self) -> int:
        return len(self.reqs)

    def needs_grammar(self, req: Req) -> bool:
        """Whether `req` has a grammar; if so, its compilation is started and the request queued here.

        Raises:
            ValueError: the request has a grammar but structured output is off, or several grammars.
        """
        spec = grammar_spec(req.sampling_params)
        if spec is None:
            return False
        if self.backend is None:
            raise ValueError("Structured output (json_schema, regex, ebnf, response_format) is off on this "
                             "server (--grammar-backend none)")
        req.grammar_future = self.backend.submit(*spec)
        self.reqs.append(req)
        return True

    def finished(self) -> Tuple[List[str], List[Tuple[str, str]]]:
        """(rids whose grammar is ready, in arrival order; (rid, error message) of failed ones), without
        taking them out (see `take`)."""
        ready, failed = [], []
        for req in self.reqs:
            future = req.grammar_future
            if future is None or not future.done():
                continue
            try:
                future.result()
                ready.append(req.rid)
            except Exception as e:  # ValueError from llguidance, or anything the compiler raised
                failed.append((req.rid, str(e) or type(e).__name__))
        return ready, failed

    def take(self, ready: List[str], failed: List[Tuple[str, str]]) -> Tuple[List[Req], List[Tuple[Req, str]]]:
        """Take out the requests `finished` named (on a multi-host follower: those node 0 named, waiting for
        their compilation here): (ready requests with their grammar, in `ready`'s order; (request, error)).

        Raises:
            RuntimeError: a named request is not queued, or its grammar fails here but compiled on node 0.
        """
        by_rid = {req.rid: req for req in self.reqs}
        missing = [rid for rid in ready + [rid for rid, _ in failed] if rid not in by_rid]
        if missing:
            raise RuntimeError(f"grammar queue out of step: {missing} not queued")
        out_ready, out_failed = [], []
        for rid in ready:
            req = by_rid.pop(rid)
            req.grammar = req.grammar_future.result()
            req.grammar_future = None
            out_ready.append(req)
        for rid, message in failed:
            req = by_rid.pop(rid)
            req.grammar_future = None
            out_failed.append((req, message))
        self.reqs = [req for req in self.reqs if req.rid in by_rid]
        return out_ready, out_failed

    def remove(self, rid: str) -> Optional[Req]:
        """Take the request `rid` out (an abort); None if it is not here."""
        for i, req in enumerate(self.reqs):
            if req.rid == rid:
                if req.grammar_future is not None:
                    req.grammar_future.cancel()
                return self.reqs.pop(i)
        return None
