"""Where a server's start-up time goes: one log line per phase as it ends, and the whole as data (issue #70).

The scheduler process times its phases (process start and imports, JAX set-up, model config and tokenizer,
weights, KV cache, warm-up's tracing and compiling, grammar warm-up, ...) and sends them with its `SchedulerInfo`;
the HTTP process adds its own (tokenizer, HTTP app) and logs one ``Ready in`` line with all of them.
/get_server_info shows both as ``startup_phases``; ``python -m sgl_jax.bench_startup`` reads them from there.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time
from typing import Dict, Iterator, Optional

logger = logging.getLogger(__name__)


def process_started_at() -> float:
    """The wall clock (``time.time()``, s) at which this process started, from /proc (10 ms resolution): a
    server's "ready in" counts the interpreter's start and its imports. Where /proc is missing: now."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime (after pid, comm)
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return time.time()
    return time.time() - (uptime - start_ticks / os.sysconf("SC_CLK_TCK"))


@dataclasses.dataclass
class StartupPhases:
    """Phase name -> wall seconds, in the order the phases ended, with an optional note each.

    Args:
        started_at: the wall clock (``time.time()``, s) the first phase counts from: `total` and `other` measure
            from it.
    """

    started_at: float = dataclasses.field(default_factory=time.time)
    seconds: Dict[str, float] = dataclasses.field(default_factory=dict)
    notes: Dict[str, str] = dataclasses.field(default_factory=dict)

    def add(self, name: str, seconds: float, note: str = "") -> None:
        """Record `seconds` (wall, s) of phase `name` (added to an earlier one of the same name) and log one line:
        ``Start-up phase <name>: <seconds> s (<note>)``."""
        self.seconds[name] = round(self.seconds.get(name, 0.0) + seconds, 3)
        if note:
            self.notes[name] = note
        logger.info("Start-up phase %s: %.1f s%s", name, seconds, f" ({note})" if note else "")

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time the body as phase `name` (`add`); a body that raises records nothing."""
        t0 = time.perf_counter()
        yield
        self.add(name, time.perf_counter() - t0)

    def since_start(self, name: str, note: str = "") -> None:
        """Record phase `name` as the time from `started_at` to now less the phases already recorded (a process's
        start and imports, timed from its parent's clock)."""
        self.add(name, max(0.0, time.time() - self.started_at - sum(self.seconds.values())), note)

    def total(self) -> float:
        """Wall seconds from `started_at` to now."""
        return time.time() - self.started_at

    def describe(self) -> str:
        """``name 1.2 s, name 3.4 s (note), ...`` in phase order (`describe_phases` of `to_json`)."""
        return describe_phases(self.to_json())

    def to_json(self, total: Optional[float] = None) -> dict:
        """{"total_s", "phases": [{"name", "seconds", "note"}, ...]} (total_s: `total` unless given)."""
        return {"total_s": round(self.total() if total is None else total, 3),
                "phases": [{"name": n, "seconds": s, "note": self.notes.get(n, "")} for n, s in self.seconds.items()]}


def describe_phases(report: dict) -> str:
    """``name 1.2 s, name 3.4 s (note), ...`` of a `StartupPhases.to_json` report, in phase order ("-": none)."""
    return ", ".join(f"{p['name']} {p['seconds']:.1f} s" + (f" ({p['note']})" if p["note"] else "")
                     for p in report.get("phases", [])) or "-"
