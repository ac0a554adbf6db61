"""Process and logging helpers shared by the three processes."""

from __future__ import annotations

import ctypes
import logging
import os
import random
import signal
import socket
import sys
import threading
import time

_LOG_FORMAT = "[%(asctime)s %(process_name)s] %(levelname)s %(message)s"


class _ProcessNameFilter(logging.Filter):
    def __init__(self, name: str):
        super().__init__()
        self.process_name = name

    def filter(self, record):
        record.process_name = self.process_name
        return True


def configure_logging(level: str, process_name: str) -> None:
    """One line per event on stderr: ``[time process] LEVEL message``."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(_LOG_FORMAT, datefmt="%Y-%m-%d %H:%M:%S"))
    handler.addFilter(_ProcessNameFilter(process_name))
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    root.addHandler(handler)
    root.setLevel(level.upper())
    for noisy in ("jax", "absl", "httpx", "httpcore", "urllib3"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, root.level))


STOP_SIGNAL = signal.SIGUSR1  # how the server process stops its engine children (kill_processes)


def prepare_child_process(parent_pid: int) -> None:
    """Signal handling for an engine child process (scheduler, detokenizer).

    - exit when the parent dies (Linux PR_SET_PDEATHSIG, plus a polling fallback);
    - ignore SIGINT and SIGTERM: Ctrl-C and ``kill -TERM -<pgid>`` reach the whole process group, and the
      server process drains running requests first (entrypoints/shutdown.py), which needs its children;
      stopping them is its job (one log line says so);
    - exit cleanly (status 0, finalizers run) on `STOP_SIGNAL`, the server process's stop.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    def on_term(*_):
        logging.getLogger(__name__).info("SIGTERM ignored: the server process (pid %d) drains requests and stops "
                                         "this one", parent_pid)

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(STOP_SIGNAL, lambda *_: sys.exit(0))
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass
    if os.getppid() != parent_pid:
        os._exit(1)

    def watch():
        while True:
            if os.getppid() != parent_pid:
                os._exit(1)
            time.sleep(1.0)

    threading.Thread(target=watch, daemon=True, name="parent-watch").start()


def kill_processes(processes, timeout: float = 5.0) -> None:
    """Stop multiprocessing children (`STOP_SIGNAL`, then SIGKILL after `timeout` seconds) and reap them."""
    for p in processes:
        if p.is_alive():
            try:
                os.kill(p.pid, STOP_SIGNAL)
            except ProcessLookupError:
                pass
    deadline = time.time() + timeout
    for p in processes:
        p.join(max(0.0, deadline - time.time()))
        if p.is_alive():
            p.kill()
            p.join(1.0)


def _ephemeral_port_start() -> int:
    """The first port of the kernel's ephemeral range (Linux's net.ipv4.ip_local_port_range; 32768 elsewhere)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def find_free_port(host: str = "127.0.0.1", tries: int = 64) -> int:
    """A TCP port on `host` that nothing is bound to now, for a server that binds it later (seconds later: a
    server binds after its start-up). It is drawn at random below the kernel's ephemeral range, which the kernel
    hands to outgoing connections (HTTP clients, jax.distributed's Gloo peers): a port taken from that range, as
    binding port 0 gives, could be handed to one of those connections before the server binds it ("address
    already in use"). Falls back to an ephemeral port when `tries` draws find nothing free."""
    high = _ephemeral_port_start()
    low = max(1024, high - 12000)
    rng = random.SystemRandom()  # (not the random module's state, which a test may have seeded alike in each worker)
    for _ in range(tries if high > low else 0):
        port = rng.randrange(low, high)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
