"""The peer process's C heap (swarm.peer.heap): on glibc, a fixed mmap threshold and trims that hand freed
memory back. Measured under a flood in bench/peer_flood.py; here, that the calls take effect."""

from __future__ import annotations

import subprocess
import sys

import pytest

from swarm.peer import heap

pytestmark = pytest.mark.unit

needs_glibc = pytest.mark.skipif(heap._libc is None, reason="not glibc: the heap calls do nothing")

# A child process frees 64 MiB in 16 KiB blocks (below any mmap threshold: they come from the heap's arenas) and
# prints its RSS before and after a trim.
CHILD = """
import ctypes, sys
from swarm.peer import heap
def rss_kib():
    return int(next(l for l in open("/proc/self/status") if l.startswith("VmRSS")).split()[1])
libc = heap._libc
libc.malloc.restype = ctypes.c_void_p
blocks = [libc.malloc(16 << 10) for _ in range(4096)]
for b in blocks:
    ctypes.memset(b, 1, 16 << 10)
keep = libc.malloc(64)  # a live block above the freed ones: the heap's top cannot simply shrink
ctypes.memset(keep, 1, 64)
for b in blocks:
    libc.free(ctypes.c_void_p(b))
before = rss_kib()
trimmed = heap.trim_heap()
print(before, rss_kib(), trimmed)
"""


@needs_glibc
def test_trim_hands_back_memory_the_heap_holds_free():
    out = subprocess.run(
        [sys.executable, "-c", CHILD], capture_output=True, text=True, check=True, timeout=60
    )
    before, after, trimmed = out.stdout.split()
    assert trimmed == "True"
    assert int(before) - int(after) > 32 << 10, out.stdout  # most of the 64 MiB went back


@needs_glibc
@pytest.mark.parametrize("variable", ["MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_"])
def test_a_threshold_is_left_to_an_operator_who_set_it(monkeypatch, variable):
    monkeypatch.setenv(variable, "262144")
    assert heap.bound_heap() is False
    monkeypatch.delenv(variable)
    assert heap.bound_heap() is True


# A child process with the peer's heap settings allocates and frees a microbatch-sized tensor (4 MiB, W1's largest
# activation) 50 times and prints the page faults that took (after a first round): with blocks this size mapped on
# their own, each use faults in all of its 1,024 pages again.
FAULTS = """
import resource, torch
from swarm.peer import heap
assert heap.bound_heap()
def faults():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(50):
        torch.empty(1 << 20).fill_(1.0)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
faults()  # the first round also faults in torch's own one-off state
print(faults())
"""


@needs_glibc
def test_a_microbatch_sized_tensor_reuses_freed_memory_instead_of_faulting_in_new_pages():
    out = subprocess.run([sys.executable, "-c", FAULTS], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    # at most one tensor's pages, not 50 x 1,024 (at a 1 MiB threshold: 51,250)
    assert int(out.stdout) < 1024, out.stdout
