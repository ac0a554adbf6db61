"""The server-wide internal state (/get_server_info's) merged from the data-parallel ranks' entries."""

from __future__ import annotations

from typing import Dict, List, Sequence

# per-rank entries of the internal state that the server-wide state sums (besides the KV accounting's)
SUMMED_STATE_KEYS = ("num_running_reqs", "num_waiting_reqs", "req_slots_free", "memory_errors", "num_retracted_reqs",
                     "num_assigned_reqs", "num_score_handles", "num_expired_score_handles", "num_score_groups",
                     "num_sessions", "num_streaming_sessions", "req_slots_session_held", "num_mixed_steps",
                     "num_bucket_cuts", "spec_verify_steps", "spec_drafted_rows", "spec_draft_tokens",
                     "spec_accepted_tokens", "spec_kv_moves", "spec_unpaid_steps")


def merge_rank_states(per_rank: List[Dict], accounting_keys: Sequence[str]) -> Dict:
    """One state from every rank's (`per_rank`: rank 0 first, each with the shared entries): rank 0's entries, the
    counts of SUMMED_STATE_KEYS and `accounting_keys` (the KV accounting's, all token counts) summed over the
    ranks, the smallest ``new_token_ratio``, every rank's ``sessions``, and ``dp_ranks``: the per-rank entries.
    Raises KeyError when a rank lacks ``new_token_ratio`` or ``sessions``."""
    state = {k: v for k, v in per_rank[0].items() if k != "dp_rank"}
    for key in SUMMED_STATE_KEYS + tuple(accounting_keys):
        if key in state:  # (the speculative-decoding counts exist only with --speculative-algorithm)
            state[key] = sum(p[key] for p in per_rank)
    state["new_token_ratio"] = min(p["new_token_ratio"] for p in per_rank)
    state["sessions"] = [s for p in per_rank for s in p["sessions"]]
    state["dp_ranks"] = per_rank
    return state
