"""Which data-parallel rank serves a new request (``--load-balance-method``, SGLang's names).

- ``round_robin``: ranks in turn.
- ``shortest_queue``: the rank with the fewest unfinished requests (waiting + running).
- ``cache_aware``: the rank whose prefix cache holds the longest prefix of the request's tokens, ties to the
  shorter queue: requests sharing a prefix land where it is cached (a radix hit on one rank is not a hit on
  another). A match under CACHE_AWARE_MIN_MATCH of the request's tokens counts as none (two unrelated prompts
  that share their first words should not pile onto one rank); sglang-router's cache-aware policy has the
  same kind of threshold.

Ties left after that go to the ranks in turn (starting at ``turn % dp``), so an idle server spreads even
sequential requests instead of sending them all to rank 0.

Pure functions of the ranks' loads and match lengths; the scheduler gathers those.
"""

from __future__ import annotations

from typing import Optional, Sequence

LOAD_BALANCE_METHODS = ("round_robin", "shortest_queue", "cache_aware")
CACHE_AWARE_MIN_MATCH = 0.3  # fraction of the request's tokens a cached prefix must cover to attract it


def choose_rank(method: str, num_reqs: Sequence[int], match_lens: Optional[Sequence[int]] = None,
                turn: int = 0, num_tokens: int = 0) -> int:
    """The rank for a new request.

    Args:
        method: one of LOAD_BALANCE_METHODS.
        num_reqs: per rank, unfinished requests assigned to it.
        match_lens: per rank, cached prefix tokens of the request (needed for ``cache_aware``).
        turn: requests assigned so far (``round_robin`` picks ``turn % dp``; ties start there).
        num_tokens: the request's tokens (``cache_aware``'s threshold).
    Raises:
        ValueError: unknown method, or ``cache_aware`` without match lengths.
    """
    dp = len(num_reqs)
    if method == "round_robin":
        return turn % dp
    in_turn = lambda r: (r - turn) % dp  # noqa: E731
    if method == "shortest_queue":
        return min(range(dp), key=lambda r: (num_reqs[r], in_turn(r)))
    if method == "cache_aware":
        if match_lens is None or len(match_lens) != dp:
            raise ValueError("cache_aware load balancing needs one prefix match length per rank")
        floor = CACHE_AWARE_MIN_MATCH * num_tokens
        useful = [m if m > 0 and m >= floor else 0 for m in match_lens]
        return min(range(dp), key=lambda r: (-useful[r], num_reqs[r], in_turn(r)))
    raise ValueError(f"--load-balance-method must be one of {', '.join(LOAD_BALANCE_METHODS)}, got {method!r}")

