"""The KV bookkeeping a request carries: the fields the mem_cache hand-off (cache_manager.py, common.py,
session_kv.py, kv_memory.py) reads and writes on a `Req`, set up here so that the scheduler's Req needs to know
none of them, sliding-window ones included.

Ownership of a request's ReqToTokenPool row (``req_pool_idx``; None when it holds none): positions
[0, cache_protected_len) belong to the prefix cache (locked through ``last_node``), positions
[cache_protected_len, kv_allocated_len) to the request; ``kv_committed_len`` positions have their K/V written.
``prefix_indices``: the matched prefix's KV slots, written to the row when the request gets one.
Hybrid SWA memory: positions [cache_protected_len, swa_evicted_len) of the request's own KV have had their SWA
pages freed (out of every future query's window; their full KV stays). Streaming sessions (session_kv.py):
``session_kv`` is the session whose KV the turn extends (None: none); ``kv_private``: positions past
cache_protected_len stay the session's (never handed to the prefix cache); ``swa_keep`` (lo, hi): page-aligned
positions whose SWA KV SWA release spares while the turn runs (the session's window at the turn's start);
``swa_evicted_hi``: positions [hi, swa_evicted_hi) already freed. ``kv_released``: set by release_kv_cache, so a
second release is a no-op. ``rows_needed``: rows of each per-request row pool (by name, mem_cache/req_state.py:
a vision tower's embedding rows) the request takes with its row at its extend; {} for none.
"""

from __future__ import annotations

import numpy as np


def init_req_kv(req) -> None:
    """Give a new request its KV bookkeeping: no row, no KV, no session."""
    req.req_pool_idx = None
    req.last_node = None
    req.kv_released = False
    req.session_kv = None
    req.kv_private = False
    req.swa_keep = None
    req.swa_evicted_hi = 0
    req.rows_needed = {}
    forget_kv(req)


def forget_kv(req) -> None:
    """Forget the lengths and the matched prefix of a request whose KV is released (a retract: it will be
    admitted again from scratch)."""
    req.kv_allocated_len = req.kv_committed_len = req.cache_protected_len = req.swa_evicted_len = 0
    req.last_node = None
    req.prefix_indices = np.zeros(0, np.int32)


def kv_fields(req) -> dict:
    """The request's KV lengths, for the internal state of a session (checks and debugging)."""
    return {f: getattr(req, f) for f in ("kv_committed_len", "kv_allocated_len", "cache_protected_len",
                                         "swa_evicted_len")}
