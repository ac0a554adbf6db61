"""Test hook: make one request fail inside the engine, at a chosen stage, to prove the others go on.

Off unless the environment variable ``SGL_JAX_TEST_FAULT_INJECTION=1`` is set for the engine's processes.
Then a request whose rid starts with ``fault-<stage>`` raises `InjectedFault` at that stage:

- ``schedule``: while the scheduler considers it for admission (before it holds any KV);
- ``forward``: while its batch's step is built and run (it holds KV; the other requests of the batch too);
- ``sample``: while its sampled token is taken after the step (the step ran for the whole batch);
- ``detokenize``: while the detokenizer turns its tokens into text;
- ``draft``: while a draft model drafts for it (STANDALONE, EAGLE or EAGLE3 speculative decoding).

The engine must fail only that request (HTTP 500 with a one-line reason), free its KV and serve the
rest, which is what test/srt/test_fault_isolation.py checks. A ``draft`` fault fails no request: the draft model
stops drafting for good and every request decodes on without speculation, its output unchanged
(test_speculative_serving.py).
"""

from __future__ import annotations

import os
from typing import Iterable

FAULT_INJECTION_ENV = "SGL_JAX_TEST_FAULT_INJECTION"
STAGES = ("schedule", "forward", "sample", "detokenize", "draft")

# The scheduler loop's test hooks (scheduler/scheduler.py), each off unless its variable is set.
# raise inside the scheduler loop at this forward step (checks crash reporting end to end).
CRASH_AT_STEP_ENV = "SGL_JAX_TEST_CRASH_AT_STEP"
# sleep (hang) inside the scheduler loop's step at this forward step (checks the watchdog).
HANG_AT_STEP_ENV = "SGL_JAX_TEST_HANG_AT_STEP"
# add this many seconds to every step (a slow device: the watchdog must time steps, not requests).
STEP_DELAY_ENV = "SGL_JAX_TEST_STEP_DELAY_S"
# when "1", retract the latest half of the running requests every few decode steps
# (SGLang's SGLANG_TEST_RETRACT is accepted too).
TEST_RETRACT_ENV = "SGL_JAX_TEST_RETRACT"
# when "1", every step (its launch and the application of its result) runs under
# jax.transfer_guard("disallow"): an implicit host <-> device transfer fails the step (tests of the hot loop).
TRANSFER_GUARD_ENV = "SGL_JAX_TEST_TRANSFER_GUARD"
# when "1", check every rank's page ownership exactly after every step (mem_cache/kv_invariants.py);
# a violation counts in memory_errors. Costs a pass over the pools per step: for tests, not for serving.
CHECK_KV_INVARIANTS_ENV = "SGL_JAX_CHECK_KV_INVARIANTS"
_ENABLED = os.environ.get(FAULT_INJECTION_ENV) == "1"


class InjectedFault(RuntimeError):
    """The failure `check` raises for a request marked to fail."""


def check(stage: str, rids: Iterable[str]) -> None:
    """Raise InjectedFault if injection is on and one of `rids` is marked to fail at `stage`."""
    if not _ENABLED:
        return
    for rid in rids:
        if rid.startswith(f"fault-{stage}"):
            raise InjectedFault(f"injected {stage} fault for request {rid}")


# ---------------------------------------------------------------- planted faults (checks that must fire)
# Each is off unless its environment variable is set for the engine's processes, and fires once per rank (the
# compile once per process); test/mem_cache/test_kv_planted_faults.py and test/srt/test_planted_faults.py (one
# fault per server) show that the exact check (page ownership and prefix locks), the idle check,
# /get_server_info's memory_errors and num_compiles_after_warmup report each, and only it.
# (a finished request: released after finishing normally -- not aborted, failed or retracted -- while holding KV)
LEAK_PAGES_ENV = "SGL_JAX_TEST_LEAK_PAGES"  # N: at the first finished request, N free pages are taken and dropped
DOUBLE_FREE_ENV = "SGL_JAX_TEST_DOUBLE_FREE"  # 1: at the first finished request, a free page is freed again
DOUBLE_LOCK_ENV = "SGL_JAX_TEST_DOUBLE_LOCK"  # 1: the first prefix-cache node an admission locks is locked twice
LEAK_STATE_ENV = "SGL_JAX_TEST_LEAK_STATE"  # 1: at the first finished request, a per-request state slot is dropped
LEAK_ROWS_ENV = "SGL_JAX_TEST_LEAK_ROWS"  # 1: at the first finished request, a per-request row page is dropped
COMPILE_ENV = "SGL_JAX_TEST_COMPILE_WHILE_SERVING"  # 1: the first step after warm-up compiles a new program


class PlantedFaults:
    """The planted faults one rank's KV memory (or the model runner) carries out, read from the environment.

    leak_pages: pages to leak at the first finished request (owned by nobody afterwards); double_free: put a
    free page on the free list a second time at the first finished request (owned twice); double_lock: lock the
    first matched cached prefix twice (it stays locked when its request ends); compile_while_serving: compile a
    program the warm-up never saw, at the first step after it; leak_state: drop a slot of the first per-request
    state pool at the first finished request (owned by nobody afterwards); leak_rows: drop a page of the first
    per-request row pool the same way.
    """

    def __init__(self, leak_pages: int = 0, double_free: bool = False, double_lock: bool = False,
                 compile_while_serving: bool = False, leak_state: bool = False, leak_rows: bool = False):
        self.leak_pages = leak_pages
        self.double_free = double_free
        self.double_lock = double_lock
        self.compile_while_serving = compile_while_serving
        self.leak_state = leak_state
        self.leak_rows = leak_rows
        self._fired = set()

    @classmethod
    def from_env(cls) -> "PlantedFaults":
        """The faults the environment asks for (none in a server that is not under test)."""
        env = os.environ
        return cls(leak_pages=int(env.get(LEAK_PAGES_ENV, "0") or 0), double_free=env.get(DOUBLE_FREE_ENV) == "1",
                   double_lock=env.get(DOUBLE_LOCK_ENV) == "1", compile_while_serving=env.get(COMPILE_ENV) == "1",
                   leak_state=env.get(LEAK_STATE_ENV) == "1", leak_rows=env.get(LEAK_ROWS_ENV) == "1")

    def fire(self, name: str) -> bool:
        """True the first time the fault `name` ("leak_pages", "double_free", "double_lock",
        "compile_while_serving", "leak_state", "leak_rows") is asked for and is on; False afterwards or when it is
        off."""
        if not getattr(self, name) or name in self._fired:
            return False
        self._fired.add(name)
        return True
