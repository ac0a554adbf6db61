"""The host-memory tier of one DP rank's prefix cache (--enable-hierarchical-cache): its size from the flags and
the memory there is, and its pool (model_executor/host_kv.HostKVPool), handed to the rank's HiRadixCache through
`mem_cache.hi_radix_cache.HostTier`."""

from __future__ import annotations

import logging
from typing import Optional

from sgl_jax.srt.mem_cache.hi_radix_cache import HostTier
from sgl_jax.srt.model_executor.host_kv import MB, HostKVPool, available_host_bytes, host_pool_tokens

logger = logging.getLogger(__name__)


def new_host_tier(server_args, runner, rank: int) -> Optional[HostTier]:
    """Rank `rank`'s host tier, None without --enable-hierarchical-cache.

    The pool's tokens are --hicache-size GB or --hicache-ratio x the rank's device pool (`host_pool_tokens`),
    checked against the host memory available now (all ranks' pools together; numpy takes it as slots are
    first written).

    Raises:
        ValueError: the pool holds less than a page or does not fit in the host memory (names the flag).
    """
    if not server_args.enable_hierarchical_cache:
        return None
    per_token = runner.host_kv_bytes_per_token
    tokens = host_pool_tokens(server_args, runner.kv_spec.pool_tokens[0], per_token, runner.page_size,
                              available_host_bytes() if rank == 0 else None)
    pool = HostKVPool(runner, rank, tokens)
    logger.info("Hierarchical cache, rank %d: host KV pool of %d tokens (%.1f MB), %s", rank, tokens,
                pool.nbytes / MB, server_args.hicache_write_policy)
    return HostTier(tokens, pool, server_args.hicache_write_policy)
