"""Test hook: make one request fail inside the engine, at a chosen stage, to prove the others go on.

Off unless the environment variable ``SGL_JAX_TEST_FAULT_INJECTION=1`` is set for the engine's processes.
Then a request whose rid starts with ``fault-<stage>`` raises `InjectedFault` at that stage:

- ``schedule``: while the scheduler considers it for admission (before it holds any KV);
- ``forward``: while its batch's step is built and run (it holds KV; the other requests of the batch too);
- ``sample``: while its sampled token is taken after the step (the step ran for the whole batch);
- ``detokenize``: while the detokenizer turns its tokens into text.

The engine must fail only that request (HTTP 500 with a one-line reason), free its KV and serve the
rest, which is what test/srt/test_fault_isolation.py checks.
"""

from __future__ import annotations

import os
from typing import Iterable

FAULT_INJECTION_ENV = "SGL_JAX_TEST_FAULT_INJECTION"
STAGES = ("schedule", "forward", "sample", "detokenize")
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
