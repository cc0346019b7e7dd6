"""The routing policy: which peer of a stage serves the next request.

Pure code: no I/O, no clocks, no global state. Time comes in as ``now`` (seconds on any clock the
caller uses consistently), randomness as a ``random.Random``, so the trainer and the
discrete-event simulator run the same policy and a seeded run is reproducible. A choice costs
O(``config.max_candidates``) in a large stage (a uniform sample of its peers is weighed, not every
peer), O(peers of the stage) in a small one or when the whole sample is ineligible.
"""

from __future__ import annotations

import math
import random
from collections.abc import Collection, Mapping

from swarm.routing.bans import BanBook
from swarm.routing.budget import RetryBudget
from swarm.routing.config import RoutingConfig
from swarm.routing.errors import NoPeersAvailable
from swarm.routing.stats import PeerSnapshot, PeerStats, valid_announcement

__all__ = ["Router"]


class Router:
    """Throughput-weighted random choice of a peer per stage, with bans and deadlines.

    **Choice.** Among the stage's eligible peers (announced, not banned at ``now``, not in
    ``exclude``) :meth:`choose` draws peer ``p`` with probability proportional to its expected
    rate::

        rate(p) = throughput(p) / (1 + in_flight(p))

    ``throughput(p)`` is the rate the peer serves at with an empty queue when its replies report their
    compute time (:attr:`PeerStats.service_rate`), else the EMA of ``size / elapsed_s`` over its
    successful round trips (samples/s). The round trip includes the wait in the peer's queue, which other
    trainers' calls fill: with many trainers a measured round trip mostly says how long the queue was when
    this trainer last called, and it says so against fast peers most (a 5-s wait halves the rate of a peer
    that computes the call in 5 s, and cuts one that computes it in 1 s to a sixth), so weighing by it sent
    the slow peers more than their share: in the 1,000-peer simulated swarm its slowest quarter of peers was
    99% busy, its fastest 87%, and the swarm delivered 89% of its bottleneck's capacity (91% weighed by the
    service rate; bench/results/scale_sim.md). Deadlines keep the round trip (it is what a call takes).
    Before the first one it is a prior: ``min(announced(p), best)`` when the peer
    announced a throughput, else ``best``, where ``best`` is the highest measured EMA in the stage,
    else the highest announcement, else ``config.default_throughput``. A new peer therefore competes
    with the best known peer from its first appearance, without a false claim letting it outbid
    measured ones. In addition, with probability ``config.explore_probability`` and when some
    eligible peer is unmeasured and idle, the choice is uniform among those peers, so a peer that
    under-announces is still measured soon.

    **Large stages.** With more than ``config.max_candidates`` peers (when it is > 0), the rule above
    runs on a uniform random sample of up to that many of them (drawn with replacement; ``best``
    taken within the sample): each peer is equally likely to be a candidate, so the choice stays
    close to proportional to the expected rate, at a bounded cost per request. If no sampled peer is
    eligible, every peer is considered.

    **Bans.** :meth:`on_failure` bans the peer id for
    ``min(ban_max_s, ban_base_s * 2 ** (failures - 1))`` seconds, ``failures`` counting consecutive
    failures (those reported during a running ban excepted); :meth:`on_success` resets the
    count. Bans are kept per peer id apart from discovery, so a peer that leaves and re-announces
    during its ban stays banned.

    **Lifecycle.** ``on_start`` increments ``in_flight``; exactly one of ``on_success``,
    ``on_failure`` or ``on_cancel`` decrements it. Calls about a peer that discovery has since
    dropped are accepted: they update its ban record only.
    """

    def __init__(self, config: RoutingConfig | None = None) -> None:
        self.config = config if config is not None else RoutingConfig()
        self._stages: dict[int, dict[str, PeerStats]] = {}
        self._ids: dict[int, list[str]] = {}  # the peer ids of each stage, for sampling
        self._bans = BanBook(self.config)

    # ---- discovery -----------------------------------------------------------------------

    def update_peers(self, stage: int, announced: Mapping[str, float], now: float) -> None:
        """Replace the peers of ``stage`` by ``announced`` (peer id -> announced samples/s).

        Peers that stay keep their measurements and in-flight counts (their announcement is
        refreshed); peers absent from ``announced`` are forgotten except for their ban record;
        new peers start unmeasured at ``now``. Unusable announcements (<= 0, NaN, inf) count as
        "no claim". Iteration order of ``announced`` fixes the draw order, so a seeded choice is
        reproducible for the same input.
        """
        old = self._stages.get(stage, {})
        new: dict[str, PeerStats] = {}
        for peer_id, throughput in announced.items():
            claim = valid_announcement(throughput)
            stats = old.get(peer_id)
            if stats is None:
                stats = PeerStats(announced_throughput=claim, added_at_s=now)
            else:
                stats.announced_throughput = claim
            new[peer_id] = stats
        if new:
            self._stages[stage] = new
            self._ids[stage] = list(new)
        else:
            self._stages.pop(stage, None)
            self._ids.pop(stage, None)

    def peers(self, stage: int) -> tuple[str, ...]:
        """Ids of the peers currently known for ``stage``, banned ones included."""
        return tuple(self._stages.get(stage, ()))

    # ---- choice --------------------------------------------------------------------------

    def choose(
        self,
        stage: int,
        now: float,
        rng: random.Random,
        exclude: Collection[str] = (),
    ) -> str:
        """Pick the peer for the next request to ``stage`` (see the class docstring for the rule).

        ``exclude`` lists peers the caller will not use (typically those that already failed this
        request). Raises :class:`NoPeersAvailable` naming the stage when no peer is eligible:
        none announced, all banned (``retry_at_s`` says when the first ban ends), all excluded,
        or a mix.
        """
        peers = self._stages.get(stage, {})
        limit = self.config.max_candidates
        if 0 < limit < len(peers):
            # Draws with replacement (cheaper than rng.sample); a repeated draw counts once.
            ids, random_ = self._ids[stage], rng.random
            count = len(ids)
            sampled = {ids[int(random_() * count)]: None for _ in range(limit)}
            chosen = self._pick(
                {peer_id: peers[peer_id] for peer_id in sampled}, stage, now, rng, exclude, False
            )
            if chosen is not None:
                return chosen
        return self._pick(peers, stage, now, rng, exclude, True)

    def _pick(
        self,
        peers: Mapping[str, PeerStats],
        stage: int,
        now: float,
        rng: random.Random,
        exclude: Collection[str],
        complete: bool,
    ) -> str | None:
        """The rule of :meth:`choose` over ``peers``; None when none is eligible, unless ``peers`` is
        the ``complete`` stage, which raises :class:`NoPeersAvailable` instead."""
        best = self._best_throughput(peers)
        eligible: list[str] = []
        weights: list[float] = []
        idle_unmeasured: list[str] = []
        num_banned = num_excluded = 0
        retry_at_s: float | None = None
        for peer_id, stats in peers.items():
            until = self._bans.banned_until_s(peer_id, now)
            if until is not None:
                num_banned += 1
                retry_at_s = until if retry_at_s is None else min(retry_at_s, until)
                continue
            if peer_id in exclude:
                num_excluded += 1
                continue
            eligible.append(peer_id)
            weights.append(self._throughput(stats, best) / (1 + stats.in_flight))
            if not stats.measured and stats.in_flight == 0:
                idle_unmeasured.append(peer_id)
        if not eligible:
            if not complete:
                return None
            raise NoPeersAvailable(
                stage,
                num_known=len(peers),
                num_banned=num_banned,
                num_excluded=num_excluded,
                retry_at_s=retry_at_s,
            )
        if idle_unmeasured and rng.random() < self.config.explore_probability:
            return idle_unmeasured[rng.randrange(len(idle_unmeasured))]
        return _weighted_pick(eligible, weights, rng)

    # ---- request lifecycle ---------------------------------------------------------------

    def on_start(self, stage: int, peer_id: str, now: float) -> None:
        """A request to ``peer_id`` of ``stage`` was sent at ``now``."""
        stats = self._stages.get(stage, {}).get(peer_id)
        if stats is not None:
            stats.in_flight += 1

    def on_success(
        self,
        stage: int,
        peer_id: str,
        size: float,
        elapsed_s: float,
        now: float,
        compute_s: float | None = None,
    ) -> None:
        """A request of ``size`` samples (> 0) to ``peer_id`` answered after ``elapsed_s`` seconds
        (> 0, the full round trip), of which the peer reported ``compute_s`` computing it (None or 0: not
        reported). Updates the EMAs and resets the peer's failure count; a ban still running at ``now`` is
        kept (it stems from a later failure)."""
        if not (math.isfinite(size) and size > 0):
            raise ValueError(f"size must be a finite number of samples > 0, got {size}")
        if not (math.isfinite(elapsed_s) and elapsed_s > 0 and math.isfinite(size / elapsed_s)):
            raise ValueError(
                f"elapsed_s must be finite and > 0 seconds with a finite rate, got {elapsed_s} "
                f"for {size} samples"
            )
        stats = self._finish(stage, peer_id)
        if stats is not None:
            stats.observe(
                size=size, elapsed_s=elapsed_s, alpha=self.config.ema_alpha, compute_s=compute_s
            )
        self._bans.record_success(peer_id, now)

    def on_failure(self, stage: int, peer_id: str, now: float) -> float:
        """A request to ``peer_id`` failed (transport error, timeout, bad answer) at ``now``.

        Bans the peer id with exponential back-off and returns the ban's end, seconds. Failures
        reported while the peer is already banned (other requests sent before the ban) neither
        count nor extend it: one crash with many requests in flight is one incident.
        """
        self._finish(stage, peer_id)
        return self._bans.record_failure(peer_id, now)

    def on_cancel(self, stage: int, peer_id: str, now: float) -> None:
        """A request was abandoned by the caller (not the peer's fault): no stats, no ban."""
        self._finish(stage, peer_id)

    def retry_budget(self, stage: int) -> RetryBudget:
        """A fresh budget of ``config.max_attempts`` attempts for one request to ``stage``."""
        return RetryBudget(stage, max_attempts=self.config.max_attempts)

    # ---- deadlines -----------------------------------------------------------------------

    def deadline_s(self, stage: int, peer_id: str, size: float) -> float:
        """RPC timeout, seconds, for a request of ``size`` samples to ``peer_id``.

        Measured peers: ``timeout_factor * size * (1 + in_flight) / throughput_ema + timeout_slack_s``
        (the round trip the EMA predicts for this size behind the calls already queued there, with
        head-room), clamped to
        ``[min_timeout_s, max_timeout_s]``. Unmeasured or unknown peers: ``initial_timeout_s``.
        """
        if not (math.isfinite(size) and size > 0):
            raise ValueError(f"size must be a finite number of samples > 0, got {size}")
        cfg = self.config
        stats = self._stages.get(stage, {}).get(peer_id)
        if stats is None or stats.throughput_ema is None:
            return cfg.initial_timeout_s
        # The call waits behind the caller's other calls to this peer (one compute queue per peer).
        predicted_s = size * (1 + stats.in_flight) / stats.throughput_ema
        deadline = cfg.timeout_factor * predicted_s + cfg.timeout_slack_s
        return min(cfg.max_timeout_s, max(cfg.min_timeout_s, deadline))

    # ---- inspection ----------------------------------------------------------------------

    def banned_until_s(self, peer_id: str, now: float) -> float | None:
        """End of ``peer_id``'s ban, seconds, or ``None`` when it is not banned at ``now``."""
        return self._bans.banned_until_s(peer_id, now)

    def snapshot(self, stage: int, peer_id: str, now: float) -> PeerSnapshot:
        """Snapshot of one known peer; raises ``KeyError`` naming it when the stage lacks it."""
        peers = self._stages.get(stage, {})
        stats = peers.get(peer_id)
        if stats is None:
            raise KeyError(f"peer {peer_id!r} is not among the {len(peers)} peers of stage {stage}")
        return PeerSnapshot(
            peer_id=peer_id,
            stage=stage,
            throughput=self._throughput(stats, self._best_throughput(peers)),
            measured=stats.measured,
            throughput_ema=stats.throughput_ema,
            latency_ema_s=stats.latency_ema_s,
            in_flight=stats.in_flight,
            num_successes=stats.num_successes,
            failures=self._bans.failures(peer_id),
            banned_until_s=self._bans.banned_until_s(peer_id, now),
        )

    def snapshots(self, stage: int, now: float) -> list[PeerSnapshot]:
        """Snapshots of all known peers of ``stage``, in discovery order."""
        return [self.snapshot(stage, peer_id, now) for peer_id in self._stages.get(stage, {})]

    # ---- internals -----------------------------------------------------------------------

    def _finish(self, stage: int, peer_id: str) -> PeerStats | None:
        stats = self._stages.get(stage, {}).get(peer_id)
        if stats is not None:
            # Clamped: a peer dropped and re-announced mid-request has fresh stats at 0.
            stats.in_flight = max(0, stats.in_flight - 1)
        return stats

    def _best_throughput(self, peers: Mapping[str, PeerStats]) -> float:
        measured = [_measured_rate(s) for s in peers.values() if s.throughput_ema is not None]
        if measured:
            return max(measured)
        claims = [s.announced_throughput for s in peers.values() if s.announced_throughput]
        return max(claims) if claims else self.config.default_throughput

    @staticmethod
    def _throughput(stats: PeerStats, best: float) -> float:
        if stats.throughput_ema is not None:
            return _measured_rate(stats)
        if stats.announced_throughput is not None:
            return min(stats.announced_throughput, best)
        return best


def _measured_rate(stats: PeerStats) -> float:
    """A measured peer's rate for the choice: its service rate when its replies reported their compute
    time, else its round-trip EMA. A peer that under-reports its compute gains at most its fastest round
    trip seen (the overhead floor absorbs the rest), one that over-reports is capped at the round trip."""
    service = stats.service_rate
    return service if service is not None else stats.throughput_ema


def _weighted_pick(items: list[str], weights: list[float], rng: random.Random) -> str:
    """One item drawn with probability ``weight / sum(weights)``; weights are > 0 and finite."""
    total = math.fsum(weights)
    target = rng.random() * total
    cumulative = 0.0
    for item, weight in zip(items, weights):
        cumulative += weight
        if target < cumulative:
            return item
    return items[-1]  # float round-off put target at the very top of the range
