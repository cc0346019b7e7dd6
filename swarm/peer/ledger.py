"""The two-phase apply of one replica: gradients computed and held for their caller's commit, applied once.

A gradient call (the last stage's forward with loss, any backward) computes the microbatch's parameter
gradients and holds them; only the caller's commit, sent once it has read the reply, applies them. The
ledger keeps what makes that exactly once:

- held gradients, each for ``commit_hold_s`` from the moment its reply is ready. A caller whose stream broke
  after the reply commits through the Commit RPC within that time; after it, the gradients are dropped and a
  commit is refused (:class:`GradientsDropped`), so a caller that heard nothing by then knows they cannot
  count here any more and computes them again elsewhere;
- the ids applied (a repeated commit is answered "already applied", never counted twice), and recent replies
  (a retried call gets the same reply instead of a second computation);
- why a dropped gradient was dropped, for the error its late commit gets.

No eviction: once the held gradients fill ``held_gradient_bytes``, new gradient work is refused before it is
computed, so a held gradient is never lost to make room. Not thread-safe: the peer's compute thread owns it.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass

import torch

from swarm.errors import AlreadyApplied, GradientsDropped, PeerOverloaded
from swarm.peer.config import CacheConfig

logger = logging.getLogger(__name__)

UNKNOWN = object()  # no reply is known for a microbatch (a reply itself may be None)


@dataclass
class Held:
    """A computed gradient waiting for its caller's commit."""

    grads: list
    reply: object
    num_samples: int
    expires_at: float  # time.monotonic() after which a commit is refused and the gradient dropped
    nbytes: int  # memory it holds: the parameter gradients and the reply's tensor


class CommitLedger:
    def __init__(self, config: CacheConfig):
        self.max_bytes = config.held_gradient_bytes
        self.held_bytes = 0  # bytes of the gradients held now
        self.commit_hold_s = config.commit_hold_s
        self.reply_cache_size = config.reply_cache_size
        self.applied_ids_size = config.applied_ids_size
        self.dropped_ids_size = config.dropped_ids_size
        # microbatch id -> gradients computed but not yet committed, oldest first (they expire in that order)
        self._held: OrderedDict[str, Held] = OrderedDict()
        self._replies: OrderedDict[str, object] = OrderedDict()
        self._applied: OrderedDict[str, None] = OrderedDict()
        # microbatch id -> why its held gradients were dropped uncommitted
        self._dropped: OrderedDict[str, str] = OrderedDict()
        self.dropped_count = 0  # held gradients dropped uncommitted since the start

    def __len__(self) -> int:
        """Gradients held for a commit (expired ones until the next call drops them)."""
        return len(self._held)

    def waiting(self) -> int:
        """Held gradients whose hold has not run out: commits that may still come. Read from another thread too
        (the drain): a snapshot, it changes nothing."""
        now = time.monotonic()
        return sum(held.expires_at > now for held in list(self._held.values()))

    def known_reply(self, microbatch_id: str):
        """The reply of a microbatch computed before (a retry of a call whose reply was lost), else
        :data:`UNKNOWN`. Raises AlreadyApplied if it was applied and its reply is no longer kept."""
        self._expire()
        if microbatch_id in self._held:
            return self._held[microbatch_id].reply
        if microbatch_id in self._replies:
            return self._replies[microbatch_id]
        if microbatch_id in self._applied:
            raise AlreadyApplied(
                f"microbatch {microbatch_id} was already applied by this peer and its reply "
                f"is no longer cached; it counts once"
            )
        return UNKNOWN

    def check_room(self, microbatch_id: str, nbytes: int) -> None:
        """Refuse new gradient work of ``nbytes`` while the computed gradients waiting for their commit would
        then pass ``held_gradient_bytes`` (one is always admitted, so a stage larger than the budget still
        works, one microbatch at a time). Evicting one instead would lose it silently: its caller counts a
        microbatch whose commit then finds nothing. Called after :meth:`known_reply` (which drops expired
        holds first), so a retry of a call whose reply is held still gets it."""
        if self._held and self.held_bytes + nbytes > self.max_bytes:
            raise PeerOverloaded(
                f"microbatch {microbatch_id} refused: {len(self._held)} computed gradients "
                f"({self.held_bytes / 2**20:.1f} MiB) already wait for their callers' commits and another "
                f"{nbytes / 2**20:.1f} MiB would pass --held-gradient-bytes={self.max_bytes}; retry at "
                f"another peer of the stage"
            )

    def hold(self, microbatch_id: str, grads: list, reply, num_samples: int) -> None:
        """Hold a computed gradient. Call it before the reply is sent: a caller that counts
        ``commit_hold_s`` from the reply's arrival then never stops waiting before the hold ends here."""
        expires_at = time.monotonic() + self.commit_hold_s
        nbytes = _nbytes(grads) + _nbytes(reply if isinstance(reply, tuple) else [reply])
        self._held[microbatch_id] = Held(grads, reply, num_samples, expires_at, nbytes)
        self.held_bytes += nbytes

    def take(self, microbatch_id: str) -> Held | None:
        """The held gradient to apply now, recorded as applied; None if it was applied before. Raises
        GradientsDropped if none is held and none was applied (nothing counted: compute it again)."""
        self._expire()
        held = self._held.pop(microbatch_id, None)
        if held is not None:
            self.held_bytes -= held.nbytes
        else:
            if microbatch_id in self._applied:
                return None
            reason = self._dropped.get(
                microbatch_id, "none were computed here, or they were dropped long ago"
            )
            raise GradientsDropped(
                f"microbatch {microbatch_id}: no gradients held for it here, nothing counted ({reason}); "
                f"compute them again"
            )
        _bounded_put(self._replies, microbatch_id, held.reply, self.reply_cache_size)
        _bounded_put(self._applied, microbatch_id, None, self.applied_ids_size)
        return held

    def drop(self, microbatch_id: str, reason: str) -> None:
        """Drop a held gradient uncommitted (a later commit gets GradientsDropped naming ``reason``)."""
        held = self._held.pop(microbatch_id, None)
        if held is None:
            return
        self.held_bytes -= held.nbytes
        self.dropped_count += 1
        _bounded_put(self._dropped, microbatch_id, reason, self.dropped_ids_size)
        logger.debug("dropped the held gradients of microbatch %s: %s", microbatch_id, reason)

    def drop_all(self, reason: str) -> int:
        """Drop every held gradient uncommitted (:meth:`drop`); how many."""
        ids = list(self._held)
        for microbatch_id in ids:
            self.drop(microbatch_id, reason)
        return len(ids)

    def _expire(self) -> None:
        now = time.monotonic()
        while self._held:
            microbatch_id, held = next(iter(self._held.items()))
            if held.expires_at > now:
                break
            self.drop(
                microbatch_id,
                f"no commit came within the {self.commit_hold_s:g}s hold after its reply",
            )


def _nbytes(values) -> int:
    """Bytes of the tensors among ``values`` (None and numbers count nothing)."""
    return sum(v.numel() * v.element_size() for v in values if isinstance(v, torch.Tensor))


def _bounded_put(table: OrderedDict, key: str, value, size: int) -> None:
    table[key] = value
    while len(table) > size:
        table.popitem(last=False)
