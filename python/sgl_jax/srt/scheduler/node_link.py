"""Multi-host scheduling: node 0 broadcasts every scheduler input; the other nodes run the same schedule.

With ``--nnodes N`` the mesh spans N hosts and every host's scheduler process must run the same compiled
steps in the same order (JAX's multi-controller model: each process feeds its own devices). Node 0 runs
HTTP, the TokenizerManager and the detokenizer; before each loop iteration its scheduler sends a
`SchedulerTick` (the messages received, which grammars finished compiling, and the clock) to every other
node, which applies it exactly as node 0 does. Everything else the scheduler decides is a function of that
sequence, so all nodes build identical batches. Only node 0 sends outputs.

Liveness (ZMQ over TCP, next to jax.distributed's coordinator at ``--dist-init-addr HOST:PORT``):
- PORT+1: ticks, node 0 PUB -> followers SUB (a tick at least every second while idle);
- PORT+2: followers' heartbeats -> node 0 (PUSH -> PULL), one a second;
- PORT+3: node 0's heartbeats -> followers (PUB -> SUB), one a second.
A node that hears nothing from a peer for PEER_TIMEOUT_S exits non-zero (a device collective with a dead
peer would otherwise hang for ever), so when any node dies every node is gone within about that time.
Node 0 stopping normally sends a shutdown tick and the followers exit 0.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from typing import Dict, List, Tuple

import zmq

logger = logging.getLogger(__name__)

HEARTBEAT_S = 1.0
PEER_TIMEOUT_S = 20.0


@dataclasses.dataclass
class SchedulerTick:
    """One scheduler loop iteration's inputs as node 0 saw them.

    msgs: messages from the TokenizerManager, in arrival order.
    grammar_ready / grammar_failed: rids whose grammar compiled / failed (with the error) since the last tick,
        in the order node 0 admits them.
    now: node 0's clock (time.time(), seconds) for the iteration's timeouts.
    shutdown: node 0 is stopping; followers exit 0.
    """

    msgs: list
    grammar_ready: List[str]
    grammar_failed: List[Tuple[str, str]]
    now: float
    shutdown: bool = False


def link_addresses(dist_init_addr: str) -> Tuple[str, str, str]:
    """(ticks, follower heartbeats, node 0 heartbeats) TCP addresses next to ``HOST:PORT``."""
    host, _, port = dist_init_addr.rpartition(":")
    return tuple(f"tcp://{host}:{int(port) + k}" for k in (1, 2, 3))


def _die(message: str) -> None:
    logger.error("%s; exiting", message)
    logging.shutdown()
    os._exit(1)


class DiscardSocket:
    """Where a multi-host follower's outputs go (node 0 sends them): a socket stand-in that sends nothing."""

    def send_pyobj(self, obj) -> None:
        return None


class NodeLink:
    """The tick channel and heartbeats of one node (see the module docstring).

    Args:
        nnodes, node_rank, dist_init_addr: the ServerArgs flags.
        peer_timeout_s: silence after which a peer counts as dead.
    """

    def __init__(self, nnodes: int, node_rank: int, dist_init_addr: str, peer_timeout_s: float = PEER_TIMEOUT_S):
        self.nnodes = nnodes
        self.node_rank = node_rank
        self.is_leader = node_rank == 0
        self.peer_timeout_s = peer_timeout_s
        ticks, follower_hb, leader_hb = link_addresses(dist_init_addr)
        self.ctx = zmq.Context(1)
        self._last_seen: Dict[int, float] = {}
        self._stop = threading.Event()
        if self.is_leader:
            self.ticks = self.ctx.socket(zmq.PUB)
            self.ticks.setsockopt(zmq.LINGER, 2000)
            self.ticks.bind(ticks)
            threading.Thread(target=self._leader_heartbeats, args=(follower_hb, leader_hb), daemon=True,
                             name="node-heartbeats").start()
        else:
            self.ticks = self.ctx.socket(zmq.SUB)
            self.ticks.setsockopt(zmq.SUBSCRIBE, b"")
            self.ticks.connect(ticks)
            threading.Thread(target=self._follower_heartbeats, args=(follower_hb, leader_hb), daemon=True,
                             name="node-heartbeats").start()
        logger.info("Node %d of %d: %s", node_rank, nnodes, "broadcasting scheduler inputs" if self.is_leader
                    else "following node 0's scheduler inputs")

    # ---- heartbeats (each thread owns its sockets)
    def _leader_heartbeats(self, follower_hb: str, leader_hb: str) -> None:
        pull = self.ctx.socket(zmq.PULL)
        pull.bind(follower_hb)
        pub = self.ctx.socket(zmq.PUB)
        pub.bind(leader_hb)
        while not self._stop.is_set():
            pub.send_pyobj(0)
            deadline = time.monotonic() + HEARTBEAT_S
            while pull.poll(max(0, int((deadline - time.monotonic()) * 1000))):
                self._last_seen[pull.recv_pyobj()] = time.monotonic()
            now = time.monotonic()
            for rank, seen in list(self._last_seen.items()):  # (a node not yet started: jax.distributed waits)
                if now - seen > self.peer_timeout_s:
                    _die(f"node {rank} sent no heartbeat for {now - seen:.0f} s (--nnodes {self.nnodes})")

    def _follower_heartbeats(self, follower_hb: str, leader_hb: str) -> None:
        push = self.ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.SNDHWM, 4)
        push.setsockopt(zmq.LINGER, 0)
        push.connect(follower_hb)
        sub = self.ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(leader_hb)
        last = None  # until node 0's first heartbeat (a node 0 not yet started: jax.distributed waits)
        while not self._stop.is_set():
            try:
                push.send_pyobj(self.node_rank, zmq.NOBLOCK)
            except zmq.Again:
                pass
            deadline = time.monotonic() + HEARTBEAT_S
            while sub.poll(max(0, int((deadline - time.monotonic()) * 1000))):
                sub.recv_pyobj()
                last = time.monotonic()
            if last is not None and time.monotonic() - last > self.peer_timeout_s:
                _die(f"node 0 sent no heartbeat for {time.monotonic() - last:.0f} s")

    # ---- ticks
    def broadcast(self, tick: SchedulerTick) -> None:
        """Node 0: send this iteration's inputs to every follower."""
        self.ticks.send_pyobj(tick)

    def receive(self) -> SchedulerTick:
        """A follower: the next iteration's inputs (exits non-zero when node 0 is silent too long)."""
        if not self.ticks.poll(int(self.peer_timeout_s * 1000)):
            _die(f"no scheduler input from node 0 for {self.peer_timeout_s:.0f} s")
        return self.ticks.recv_pyobj()

    def close(self, send_shutdown: bool = True) -> None:
        """Stop heartbeating; node 0 also tells the followers to exit 0."""
        if self.is_leader and send_shutdown:
            self.broadcast(SchedulerTick([], [], [], time.time(), shutdown=True))
        self._stop.set()

