"""The ZMQ IPC endpoints between the server's three processes (TokenizerManager, Scheduler, DetokenizerManager),
in a private directory per run, and the clean-up of directories that runs killed without clean-up left behind."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import tempfile
from typing import Optional


@dataclasses.dataclass
class PortArgs:
    """ZMQ IPC endpoints between the three processes, in a private directory of this run.

    tokenizer_ipc_name: scheduler and detokenizer -> TokenizerManager (PUSH -> PULL).
    scheduler_input_ipc_name: TokenizerManager -> Scheduler.
    detokenizer_ipc_name: Scheduler -> DetokenizerManager.
    ipc_dir: the directory holding the three socket files (mode 0700: the sockets carry pickled objects, so
        no other user may connect); `cleanup` removes it, on every exit path of the server and the Engine.
    """

    tokenizer_ipc_name: str
    scheduler_input_ipc_name: str
    detokenizer_ipc_name: str
    ipc_dir: Optional[str] = None

    @staticmethod
    def init_new() -> "PortArgs":
        """New endpoints in a new private directory under the temp directory (``tempfile.mkdtemp``: 0700,
        named after this process's pid; directories left by a process that is gone -- SIGKILL allows no
        clean-up -- are removed first)."""
        remove_stale_ipc_dirs()
        ipc_dir = tempfile.mkdtemp(prefix=f"sgl_jax_ipc_{os.getpid()}_")
        return PortArgs(
            tokenizer_ipc_name=f"ipc://{ipc_dir}/tokenizer",
            scheduler_input_ipc_name=f"ipc://{ipc_dir}/scheduler",
            detokenizer_ipc_name=f"ipc://{ipc_dir}/detokenizer",
            ipc_dir=ipc_dir,
        )

    def cleanup(self) -> None:
        """Remove the socket directory (idempotent; the processes may still hold the sockets open)."""
        if self.ipc_dir is not None:
            shutil.rmtree(self.ipc_dir, ignore_errors=True)


def remove_stale_ipc_dirs() -> None:
    """Remove this user's ``sgl_jax_ipc_<pid>_*`` directories whose process no longer exists (and the socket
    files ``sgl_jax_<pid>_<hex>_{tokenizer,scheduler,detokenizer}`` that versions before them left in the temp
    directory itself)."""
    root = tempfile.gettempdir()
    try:
        names = os.listdir(root)
    except OSError:
        return
    for name in names:
        parts = name.split("_")
        if name.startswith("sgl_jax_ipc_") and len(parts) >= 5 and parts[3].isdigit():
            pid = int(parts[3])
        elif len(parts) == 5 and name.startswith("sgl_jax_") and parts[2].isdigit() and \
                parts[4] in ("tokenizer", "scheduler", "detokenizer"):
            pid = int(parts[2])
        else:
            continue
        path = os.path.join(root, name)
        try:
            if os.lstat(path).st_uid != os.getuid():
                continue
            os.kill(pid, 0)
        except ProcessLookupError:
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                with contextlib.suppress(OSError):
                    os.unlink(path)
        except OSError:  # (PermissionError: a live process of another user)
            continue
