"""The KV a streaming session keeps between its turns (SGLang's streaming sessions, ``SessionSlot``).

A streaming session's turn 1 is an ordinary request: its prompt is matched (and, when chunk-prefilled,
inserted) through the prefix cache, which keeps its lock on the matched node. When a turn finishes, the
session keeps that turn's request slot and KV instead of releasing them: the turn's `Req` becomes the
session's *holder*, whose KV fields (``req_pool_idx``, ``kv_committed_len``, ``kv_allocated_len``,
``cache_protected_len``, ``last_node`` with its SWA lock, ``swa_evicted_len``) describe what the session
holds. The next turn (prompt = the history plus new tokens) is *lent* the holder's row at admission and
prefills only the tokens past ``kv_committed_len``.

Ownership (see cache_manager.py): positions [0, cache_protected_len) stay the prefix cache's, locked through
the holder's ``last_node``; ``cache_protected_len`` is turn 1's page-aligned tree prefix for the session's
whole life (a later turn never hands KV to the cache: ``Req.kv_private``), so every free starts on a page
boundary (the page-size bug SGLang fixed upstream: an unaligned protected length double-frees or leaks a
page). Positions [cache_protected_len, kv_allocated_len) belong to the session (between turns) or to the
turn that has them.

A turn that finishes normally becomes the new holder. A turn that is aborted, fails or is retracted hands the
row back with only its own new KV freed (pages from ``ceil(holder.kv_committed_len)``), so the session is as
it was before the turn. While a turn has the row, SWA release (``release_swa_out_of_window``) never frees SWA
pages of the session's last ``window`` tokens (``Req.swa_keep``; the turn's own pages past them are released
as usual), so that hand-back is exact on sliding-window models too; when a turn completes, its SWA KV out
of the window is released at once. Closing (or the timeout) releases the holder through `common.release_kv_cache`,
the one release path: its computed prefix goes to the prefix cache like any finished request's.
"""

from __future__ import annotations

from typing import Optional

from sgl_jax.srt.mem_cache.cache_manager import own_swa_pages, release_swa_out_of_window

KV_FIELDS = ("req_pool_idx", "kv_committed_len", "kv_allocated_len", "cache_protected_len", "last_node",
             "swa_evicted_len")


def _ceil(n: int, page_size: int) -> int:
    return -(-n // page_size) * page_size


def trim_kv(req, tree_cache, n: int) -> None:
    """Cut `req`'s own KV back to its first `n` positions: pages from ``ceil(n)`` on are freed.

    Raises:
        ValueError: n below ``cache_protected_len`` (those positions are the prefix cache's).
    """
    if n < req.cache_protected_len:
        raise ValueError(f"cannot trim a request's KV to {n} positions below its cached prefix "
                         f"({req.cache_protected_len})")
    if n >= req.kv_allocated_len:
        return
    row = tree_cache.req_to_token_pool.req_to_token[req.req_pool_idx]
    start = _ceil(n, tree_cache.page_size)
    if req.kv_allocated_len > start:
        tree_cache.free_slots(row[start:req.kv_allocated_len])
    req.kv_allocated_len = n
    req.kv_committed_len = min(req.kv_committed_len, n)
    req.swa_evicted_len = min(req.swa_evicted_len, n)


class SessionKV:
    """The request slot and KV one streaming session holds (see the module docstring).

    Args:
        window: the model's sliding window in tokens when the KV has a separate SWA pool, else None.
    """

    def __init__(self, window: Optional[int] = None):
        self.window = window
        self.holder = None  # the last completed turn (a Req); its KV fields are the session's KV
        self.lent_to = None  # the turn that has the session's row now

    # ------------------------------------------------------------ queries
    def has_kv(self) -> bool:
        """Whether the session holds a request slot and KV now (not lent to a running turn)."""
        return self.holder is not None and self.holder.req_pool_idx is not None

    def history_ids(self) -> list:
        """Token ids of the conversation so far (the holder's prompt + output); [] before a turn completed."""
        return [] if self.holder is None else self.holder.fill_ids

    def prefix_len(self, req) -> int:
        """Positions of turn `req` the session's KV serves: the computed ones, less at least one token of
        `req` that is always computed (for its logits)."""
        return min(self.holder.kv_committed_len, len(req.fill_ids) - 1)

    def held_tokens(self, page_size: int) -> int:
        """Full-pool tokens the session owns while no turn has them (past the cache's prefix; whole pages)."""
        if not self.has_kv():
            return 0
        h = self.holder
        return _ceil(h.kv_allocated_len, page_size) - h.cache_protected_len

    def held_swa_tokens(self, page_size: int) -> int:
        """SWA-pool tokens the session owns while no turn has them (its own pages not yet SWA-released)."""
        return own_swa_pages(self.holder, page_size) * page_size if self.has_kv() else 0

    # ------------------------------------------------------------ turns
    def lend(self, req, tree_cache) -> int:
        """Give turn `req` (whose prompt extends the history) the session's row and KV, cut back to
        `prefix_len` positions; returns that prefix length. `req` then prefills only the rest.

        Raises:
            RuntimeError: the session holds no KV, or `req` already holds a row.
        """
        if not self.has_kv() or req.req_pool_idx is not None:
            raise RuntimeError("lend: the session holds no KV or the turn already has a row")
        h = self.holder
        n = self.prefix_len(req)
        trim_kv(h, tree_cache, n)
        for f in KV_FIELDS:
            setattr(req, f, getattr(h, f))
        h.req_pool_idx, h.last_node = None, None  # the holder keeps its lengths: the state to hand back to
        req.kv_private = True
        req.kv_released = False
        if self.window:
            lo = max(0, n - self.window + 1) // tree_cache.page_size * tree_cache.page_size
            req.swa_keep = (lo, _ceil(n, tree_cache.page_size))
            req.swa_evicted_hi = req.swa_keep[1]
        self.lent_to = req
        return n

    def on_release(self, req, tree_cache, is_insert: bool) -> bool:
        """`common.release_kv_cache` of a turn of this session: returns True when the session took over
        (the KV stays held), False when the ordinary release applies (a failed turn 1).

        A turn that finished normally becomes the holder (over-allocated pages past its computed positions
        are freed). A later turn that was aborted, failed or is retracted (is_insert False) frees only its
        own new KV and hands the row back.
        """
        fr = req.finished_reason
        if is_insert and fr is not None and fr.type != "abort":
            trim_kv(req, tree_cache, req.kv_committed_len)
            req.swa_keep, req.swa_evicted_hi = None, 0
            if self.window:  # the turn's SWA KV out of the window (the protected pages included) goes now
                release_swa_out_of_window(req, tree_cache.req_to_token_pool, tree_cache.allocator, self.window)
            req.prefix_indices = req.prefix_indices[:0]  # (only the token ids and the KV fields matter now)
            if self.holder is not None and self.holder is not req:
                self.holder.session_kv = None
            self.holder, self.lent_to = req, None
            return True
        if self.lent_to is not req:
            return False
        h = self.holder
        assert req.cache_protected_len == h.cache_protected_len, "a later turn changed the cached prefix"
        trim_kv(req, tree_cache, h.kv_committed_len)
        h.req_pool_idx, h.last_node = req.req_pool_idx, req.last_node
        h.swa_evicted_len = max(h.swa_evicted_len, req.swa_evicted_len)
        h.kv_allocated_len = req.kv_allocated_len
        req.req_pool_idx, req.last_node = None, None
        req.kv_allocated_len = req.kv_committed_len = req.cache_protected_len = req.swa_evicted_len = 0
        req.kv_released = True
        req.kv_private = False
        req.swa_keep, req.swa_evicted_hi = None, 0
        self.lent_to = None
        return True

    def release(self, tree_cache) -> None:
        """Release everything the session holds (close, timeout) through `common.release_kv_cache`.

        Raises:
            RuntimeError: a turn of the session has the row (close waits for the turn to finish).
        """
        from sgl_jax.srt.mem_cache.common import release_kv_cache
        if self.lent_to is not None:
            raise RuntimeError("release: a turn of the session is running")
        h = self.holder
        self.holder = None
        if h is not None:
            h.session_kv = None
            release_kv_cache(h, tree_cache)
