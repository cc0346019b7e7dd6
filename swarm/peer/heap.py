"""The C heap of a peer process: large buffers go back to the system when freed, and the rest now and then.

glibc's malloc serves a request above its mmap threshold with a mapping of its own, unmapped when freed; below the
threshold, from heap arenas it keeps. The threshold starts at 128 KiB and rises to the size of each mapped block
freed (up to 32 MiB), so once a peer has freed a few large request tensors, later ones come from the arenas, which
fragment across threads and keep their pages. A flood of large requests then left a peer holding hundreds of MiB
for good (bench/results/peer_flood.md, "RSS kept after"). :func:`bound_heap` fixes the threshold (which stops the
rise) and :func:`trim_heap_forever` hands back, every few seconds, what the arenas hold free.

Only glibc has these calls; elsewhere (musl, macOS) both do nothing. A ``MALLOC_MMAP_THRESHOLD_`` set in the
environment is the operator's choice and is left alone.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import logging
import os

logger = logging.getLogger(__name__)

M_MMAP_THRESHOLD = -3  # mallopt parameter (malloc.h)
# Tensors from 1 MiB up (a microbatch's activations at W1 sizes and above) are mapped and unmapped on their own.
MMAP_THRESHOLD_BYTES = 1 << 20
TRIM_EVERY_S = 5.0


def _glibc():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None


_libc = _glibc()


def bound_heap(threshold_bytes: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Fix malloc's mmap threshold at ``threshold_bytes`` for this process; whether it was set."""
    if _libc is None or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    return bool(_libc.mallopt(M_MMAP_THRESHOLD, ctypes.c_int(threshold_bytes)))


def trim_heap() -> bool:
    """Return the heap's free pages to the system now; whether any were."""
    return bool(_libc.malloc_trim(ctypes.c_size_t(0))) if _libc is not None else False


async def trim_heap_forever(every_s: float = TRIM_EVERY_S) -> None:
    """:func:`trim_heap` every ``every_s`` seconds, off the event loop (it walks every arena)."""
    if _libc is None:
        return
    while True:
        await asyncio.sleep(every_s)
        await asyncio.to_thread(trim_heap)
