"""Forking a process that runs gRPC: the child must not collect what it inherited.

hivemind starts its DHT and averagers as forked processes. A peer forks them while its own gRPC (grpc.aio)
server and channels run in the parent: a new averager on a move, or any peer started in a process that
already serves (tests). The child inherits the parent's grpc.aio objects as plain memory; when its garbage
collector later frees them, their finalizers call into a gRPC core that has no threads in the child, and the
child spins at 100% CPU instead of serving (seen as a DHT node that never answers, a peer that never starts,
a stage whose averaging never completes).

:func:`protect_forks` freezes the garbage collector just before every fork (``gc.freeze``: what exists then
is never collected) and unfreezes it in the parent right after. The child keeps the inherited objects
uncollected, which costs it some memory and nothing else.
"""

from __future__ import annotations

import gc
import os
import threading

_registered = False
_lock = threading.Lock()


def protect_forks() -> None:
    """Register the freeze/unfreeze fork hooks for this process (once; later calls do nothing)."""
    global _registered
    with _lock:
        if _registered:
            return
        os.register_at_fork(before=gc.freeze, after_in_parent=gc.unfreeze)
        _registered = True
