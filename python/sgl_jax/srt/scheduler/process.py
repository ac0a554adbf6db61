"""Entry points of the scheduler's processes: the scheduler process the launcher starts (and the Engine), and the
scheduler of a multi-host follower node (--node-rank > 0)."""

from __future__ import annotations

import logging
import os
import sys
import traceback

from sgl_jax.srt.io_struct import SchedulerStartupError
from sgl_jax.srt.scheduler.scheduler import Scheduler
from sgl_jax.srt.utils import configure_logging, prepare_child_process

logger = logging.getLogger(__name__)


def run_scheduler_process(server_args, port_args, pipe_writer, parent_pid: int, spawned_at: float) -> None:
    """Entry point of the scheduler process: build, report readiness over `pipe_writer`, serve forever.
    `spawned_at`: the parent's wall clock when it started this process (start-up phases count from it)."""
    configure_logging(server_args.log_level, "Scheduler")
    prepare_child_process(parent_pid)
    try:
        scheduler = Scheduler(server_args, port_args, spawned_at)
    except ValueError as e:  # a configuration error (errors.StartupError): one line says why
        logger.error("Scheduler cannot start: %s", e)
        logger.debug("%s", traceback.format_exc())
        _report_startup_failure(pipe_writer, SchedulerStartupError(traceback.format_exc(), str(e)))
    except Exception:
        tb = traceback.format_exc()
        logger.error("Scheduler process failed:\n%s", tb)
        _report_startup_failure(pipe_writer, SchedulerStartupError(tb))
    try:
        pipe_writer.send(scheduler.info())
        scheduler.event_loop()
    except Exception:
        logger.error("Scheduler process failed:\n%s", traceback.format_exc())
        sys.exit(1)


def _report_startup_failure(pipe_writer, error: SchedulerStartupError) -> None:
    """Send `error` over the start-up pipe (the launcher may be gone already) and exit 1 at once: the launcher
    stops its children as soon as it reads the error, and a stop signal landing in the interpreter's exit
    handlers (torch's, where transformers imported it) would print a traceback of its own."""
    try:
        pipe_writer.send(error)
    except Exception:
        pass
    logging.shutdown()
    os._exit(1)


def run_follower_node(server_args) -> None:
    """``launch_server`` on a host with --node-rank > 0: no HTTP, no tokenizer or detokenizer; the scheduler
    runs node 0's schedule on this host's devices (scheduler/node_link.py). Exits 0 when node 0 stops, non-zero
    when a node dies or this one fails."""
    configure_logging(server_args.log_level, f"Node{server_args.node_rank}")
    try:
        scheduler = Scheduler(server_args, None)
        logger.info("Node %d ready; following node 0", server_args.node_rank)
        scheduler.event_loop()
    except Exception:
        logger.error("Scheduler of node %d failed:\n%s", server_args.node_rank, traceback.format_exc())
        logging.shutdown()
        os._exit(1)
