"""A child forked from a process that runs gRPC does not collect what it inherited (swarm.forking)."""

from __future__ import annotations

import gc
import os

from swarm.forking import protect_forks


def test_a_forked_child_keeps_the_parents_objects_out_of_its_garbage_collector():
    # The spin this prevents: a forked hivemind process freeing inherited grpc.aio objects, whose finalizers
    # call into a gRPC core with no threads in the child (it looped at 100% CPU; a peer never started).
    protect_forks()
    protect_forks()  # once is enough: a second call registers nothing more
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report how many inherited objects its collector will never look at
        os.write(write, str(gc.get_freeze_count()).encode())
        os._exit(0)
    os.close(write)
    _, status = os.waitpid(pid, 0)
    frozen_in_child = int(os.read(read, 64))
    os.close(read)
    assert os.waitstatus_to_exitcode(status) == 0
    assert (
        frozen_in_child > 10_000
    )  # everything the parent held when it forked (pytest, torch, grpc, ...)
    assert gc.get_freeze_count() == 0  # the parent collects as before
