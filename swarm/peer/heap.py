"""The C heap of a peer process: freed memory is reused while the peer computes and handed back every few seconds.

glibc's malloc serves a request above its mmap threshold with a mapping of its own, unmapped when freed, and every
page of the next such mapping is faulted in and zeroed again; below the threshold, from heap arenas it keeps, which
it shrinks whenever more than its trim threshold lies free at an arena's top. Left to itself glibc moves both
thresholds as blocks are freed; a flood of large requests then left a peer holding hundreds of MiB for good
(bench/results/peer_flood.md, "RSS kept after"). :func:`bound_heap` fixes both: a microbatch's tensors (up to
32 MiB, glibc's most) come from the arenas and stay there between microbatches, and :func:`trim_heap_forever`
hands back, every few seconds, whatever the arenas hold free, so what a flood left goes back too.

Why not a low mmap threshold: at 1 MiB (before), every activation of W1 and above was mapped and unmapped per
use, and the compute thread spent a fifth of its time in page faults (93,000 a second; 0.15 of a core in the
kernel per peer; the swarm 1.3x slower on W1, bench/results/swarm_throughput.md).

Only glibc has these calls; elsewhere (musl, macOS) both do nothing. A ``MALLOC_MMAP_THRESHOLD_`` or
``MALLOC_TRIM_THRESHOLD_`` set in the environment is the operator's choice and is left alone.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import os

M_TRIM_THRESHOLD = -1  # mallopt parameters (malloc.h)
M_MMAP_THRESHOLD = -3
# Blocks below 32 MiB (glibc's largest threshold; a W2 microbatch's biggest activation is 16 MiB) come from the
# arenas; larger ones are mapped on their own.
MMAP_THRESHOLD_BYTES = 32 << 20
# free() shrinks an arena only past this much free at its top; the periodic trim hands back the rest.
TRIM_THRESHOLD_BYTES = 64 << 20
TRIM_EVERY_S = 5.0


def _glibc():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None


_libc = _glibc()


def bound_heap(
    threshold_bytes: int = MMAP_THRESHOLD_BYTES, trim_bytes: int = TRIM_THRESHOLD_BYTES
) -> bool:
    """Fix malloc's mmap threshold at ``threshold_bytes`` and its trim threshold at ``trim_bytes`` for this
    process, each unless the environment sets it; whether both were set here."""
    if _libc is None:
        return False
    done = [
        bool(_libc.mallopt(parameter, ctypes.c_int(value)))
        for variable, parameter, value in (
            ("MALLOC_MMAP_THRESHOLD_", M_MMAP_THRESHOLD, threshold_bytes),
            ("MALLOC_TRIM_THRESHOLD_", M_TRIM_THRESHOLD, trim_bytes),
        )
        if variable not in os.environ
    ]
    return len(done) == 2 and all(done)


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
