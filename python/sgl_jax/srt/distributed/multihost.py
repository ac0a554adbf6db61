"""Multi-host start-up: one JAX process per host, all hosts' devices in one mesh (``jax.distributed``).

The scheduler inputs that keep the hosts in step travel separately (scheduler/node_link.py).
"""

from __future__ import annotations

import logging
from typing import Optional

import jax

logger = logging.getLogger(__name__)


def init_distributed(nnodes: int, node_rank: int, dist_init_addr: Optional[str]) -> None:
    """``jax.distributed.initialize`` with node 0's ``dist_init_addr`` (HOST:PORT) as coordinator, for a mesh
    over `nnodes` hosts; a no-op for one. Must run before any device is touched. CPU devices' cross-process
    collectives run over gloo. Raises what ``jax.distributed.initialize`` raises (e.g. a peer never came)."""
    if nnodes <= 1:
        return
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    logger.info("jax.distributed: node %d of %d, coordinator %s", node_rank, nnodes, dist_init_addr)
    jax.distributed.initialize(coordinator_address=dist_init_addr, num_processes=nnodes, process_id=node_rank)
    logger.info("jax.distributed ready: %d devices in all, %d on this node", jax.device_count(),
                jax.local_device_count())
