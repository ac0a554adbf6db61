"""Host memory for a model load without transparent huge pages.

NumPy asks Linux for transparent huge pages (``madvise(MADV_HUGEPAGE)``) on every large array it allocates. Where
the kernel's ``/sys/kernel/mm/transparent_hugepage/defrag`` is ``madvise`` (a common default, and this project's
CI machines'), each such fault makes the kernel compact memory until it finds a free 2 MiB page, synchronously.
Loading a checkpoint makes and frees one large array after another (dequantized GGUF tensors, quantized copies,
scales), so the load stalls on compaction. On a 2-core machine (the medians of three runs,
reports/load-hugepages-cpu-2026-12-04/): Gemma-3-270M loaded in 15.3 s with them and 3.4 s without, 26.3 s and
6.0 s under --quantization int8; SmolLM2-135M in 3.9 s and 2.6 s, 5.7 s and 2.2 s under int8. A loaded model lives in
device buffers (XLA's own allocations), so the pages the load used matter only while it runs.

The switch is NumPy's own: ``NUMPY_MADVISE_HUGEPAGE`` sets it at import, ``_set_madvise_hugepage`` at run time
(numpy/_core/multiarray.py; numpy.core in NumPy 1.x), which returns the previous setting.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator, Optional


def _switch() -> Optional[Callable[[bool], bool]]:
    """NumPy's run-time hugepage switch, or None on a NumPy without it."""
    try:
        from numpy._core import multiarray
    except ImportError:  # NumPy 1.x
        from numpy.core import multiarray
    return getattr(multiarray, "_set_madvise_hugepage", None)


@contextlib.contextmanager
def numpy_hugepages(enabled: bool) -> Iterator[None]:
    """Within the block, NumPy's large arrays are (`enabled`) or are not advised to the kernel as huge-page
    candidates; the previous setting is restored after it. Does nothing on a NumPy without the switch."""
    switch = _switch()
    if switch is None:
        yield
        return
    previous = switch(enabled)
    try:
        yield
    finally:
        switch(previous)
