"""Start the scheduler and detokenizer processes and wait until the scheduler is ready.

Both are started with the "spawn" method (JAX is not fork-safe). Each child dies with its parent
(PR_SET_PDEATHSIG); `ChildWatcher` tells the parent when a child dies first.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import multiprocessing.connection
import os
import threading
import time
from typing import Any, Callable, List, Optional, Tuple

from sgl_jax.srt.configs.model_config import load_tokenizer, resolve_model, tokenizer_path_for
from sgl_jax.srt.model_loader.gguf_file import check_gguf_tokenizer_dir
from sgl_jax.srt.errors import StartupError
from sgl_jax.srt.io_struct import SchedulerInfo, SchedulerStartupError
from sgl_jax.srt.port_args import PortArgs
from sgl_jax.srt.server_args import ServerArgs
from sgl_jax.srt.startup_phases import StartupPhases, describe_phases
from sgl_jax.srt.utils import kill_processes

logger = logging.getLogger(__name__)


def _scheduler_main(*args) -> None:  # (server_args, port_args, pipe, parent pid, spawned_at)
    # imported here so that the HTTP process never imports JAX
    from sgl_jax.srt.scheduler.process import run_scheduler_process

    run_scheduler_process(*args)


def _detokenizer_main(*args) -> None:
    from sgl_jax.srt.tokenizer.detokenizer_manager import run_detokenizer_process

    run_detokenizer_process(*args)


def launch_subprocesses(server_args: ServerArgs, while_starting: Optional[Callable[[], Any]] = None
                        ) -> Tuple[PortArgs, SchedulerInfo, List[mp.Process], Any]:
    """Start scheduler + detokenizer; return (port_args, scheduler_info, processes, prepared) once the scheduler is
    ready. The caller stops them with `stop_subprocesses`.

    `while_starting` (optional) runs in this thread once the children have started, while the scheduler loads and
    compiles; ``prepared`` is its result (None without it): the HTTP process loads its tokenizer there.

    Raises:
        RuntimeError: a child failed during start-up (the message carries its traceback).
        FileNotFoundError, ValueError: the model or tokenizer cannot be resolved (`model_config.resolve_model`,
            `model_config.tokenizer_path_for`); nothing was started.
        Whatever `while_starting` raises (the children are stopped first).
    """
    # Once, before the children, which then find it all cached: a hub model's download (huggingface_hub's cache),
    # a GGUF's HF directory (built from its metadata), a hub --tokenizer-path's files.
    resolve_model(server_args)
    tokenizer_dir = tokenizer_path_for(server_args)
    if os.path.isdir(tokenizer_dir):  # a GGUF whose tokenizer cannot be rebuilt: refuse before any child starts
        check_gguf_tokenizer_dir(tokenizer_dir)
    port_args = PortArgs.init_new()
    ctx = mp.get_context("spawn")
    reader, writer = ctx.Pipe(duplex=False)
    parent = os.getpid()
    # spawned_at: the scheduler's start-up phases count from here (its interpreter start and imports included)
    scheduler = ctx.Process(target=_scheduler_main, args=(server_args, port_args, writer, parent, time.time()),
                            name="sgl_jax::scheduler")
    detokenizer = ctx.Process(target=_detokenizer_main, args=(server_args, port_args, parent),
                              name="sgl_jax::detokenizer")
    procs = [scheduler, detokenizer]
    scheduler.start()
    detokenizer.start()
    writer.close()
    logger.info("Started scheduler (pid %d) and detokenizer (pid %d)", scheduler.pid, detokenizer.pid)
    try:
        prepared = None if while_starting is None else while_starting()
        info = _wait_ready(reader, procs)
    except BaseException:
        stop_subprocesses(procs, port_args)
        raise
    logger.info("Scheduler ready: %d KV tokens, %d running requests, context %d tokens (per DP rank)",
                info.max_total_tokens, info.max_running_requests, info.context_len)
    return port_args, info, procs, prepared


def launch_with_tokenizer(server_args: ServerArgs, phases: StartupPhases) -> Tuple[PortArgs, SchedulerInfo,
                                                                                 List[mp.Process], Any]:
    """`launch_subprocesses`, loading the tokenizer for the TokenizerManager (`load_tokenizer`) while the scheduler
    starts: (port_args, scheduler_info, processes, tokenizer). Records the phases ``tokenizer`` and ``waiting for
    the scheduler`` in `phases`. Raises as `launch_subprocesses` and `load_tokenizer`."""
    def load():
        with phases.phase("tokenizer"):
            return load_tokenizer(server_args)

    launched = launch_subprocesses(server_args, load)
    phases.since_start("waiting for the scheduler")
    return launched


def log_ready(info: SchedulerInfo, server: StartupPhases) -> None:
    """Put the HTTP process's start-up phases (`server`, counted from its start) beside the scheduler's in
    ``info.startup_phases`` (in place: ``{"scheduler", "server", "ready_s"}``, /get_server_info's) and log one
    line: ``Ready in <s> s: scheduler process: <phases>; server process: <phases>``. The server's time not in a
    phase yet is its phase ``other``, so that its phases sum to its total."""
    server.since_start("other")
    info.startup_phases.update(server=server.to_json(), ready_s=round(server.total(), 3))
    logger.info("Ready in %.1f s: scheduler process: %s; server process: %s", server.total(),
                describe_phases(info.startup_phases["scheduler"]), server.describe())


def stop_subprocesses(procs: List[mp.Process], port_args: Optional[PortArgs], timeout: float = 5.0) -> None:
    """Stop the engine processes (`utils.kill_processes`: the stop signal, SIGKILL after `timeout` seconds)
    and remove their socket directory (`PortArgs.cleanup`). Idempotent."""
    kill_processes(procs, timeout)
    if port_args is not None:
        port_args.cleanup()


def _wait_ready(reader, procs: List[mp.Process]) -> SchedulerInfo:
    """The scheduler's `SchedulerInfo` from the start-up pipe `reader`.

    Raises:
        errors.StartupError: the scheduler sent a `SchedulerStartupError` (one line for a configuration error) or
            closed the pipe.
        RuntimeError: a child exited first.
    """
    while True:
        if reader.poll(0.5):
            try:
                msg = reader.recv()
            except EOFError:
                msg = SchedulerStartupError("scheduler exited during start-up")
            if isinstance(msg, SchedulerInfo):
                return msg
            if msg.reason:
                raise StartupError(f"Scheduler failed to start: {msg.reason}")
            raise StartupError(f"Scheduler failed to start:\n{msg.traceback}")
        for p in procs:
            if not p.is_alive():
                raise RuntimeError(f"{p.name} exited during start-up with code {p.exitcode}")


class ChildWatcher:
    """Calls ``on_death(name, exitcode)`` (from a thread) when any child exits before `stop()`."""

    def __init__(self, procs: List[mp.Process], on_death: Callable[[str, int], None]):
        self.procs = procs
        self.on_death = on_death
        self._stopped = False
        threading.Thread(target=self._run, daemon=True, name="child-watcher").start()

    def _run(self) -> None:
        sentinels = {p.sentinel: p for p in self.procs}
        ready = multiprocessing.connection.wait(list(sentinels))
        if self._stopped:
            return
        p = sentinels[ready[0]]
        p.join(1.0)
        time.sleep(0.05)
        if not self._stopped:
            self.on_death(p.name, p.exitcode)

    def stop(self) -> None:
        self._stopped = True
