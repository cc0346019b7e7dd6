"""Prometheus metrics of one peer (``swarm peer --metrics-port``): what it serves and how its calls go.

Each peer has its own registry (several peers may share a process in tests), exposed over HTTP at
``/metrics`` by prometheus_client's server thread. Call counts and latencies are recorded as calls end (see
swarm.transport.server); everything else is read from the peer when Prometheus scrapes, so the numbers are
those of that moment and cost nothing between scrapes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from swarm.metrics import MetricsEndpoint
from swarm.states import PeerState

logger = logging.getLogger(__name__)

# Seconds: from a local call of milliseconds to a large transfer over a slow link.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class PeerMetrics(MetricsEndpoint):
    """Metrics of ``peer`` (a swarm.peer.lifecycle.Peer, not imported: it imports this module);
    ``late_commits()``: the service's count of commits answered through the Commit RPC; ``queue``: the service's
    :class:`~swarm.peer.queue.WorkQueue` (load shedding), when it has one."""

    def __init__(self, peer: Any, *, late_commits: Callable[[], int], queue: Any = None):
        super().__init__()
        self.calls = Counter(
            "swarm_peer_calls",
            "Calls handled, by RPC method and outcome (ok, or the error's class)",
            ["method", "outcome"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "swarm_peer_call_seconds",
            "Time from a call's start to its end, by RPC method (transfers and commit included)",
            ["method"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.registry.register(_PeerCollector(peer, late_commits, queue))

    def observe_call(self, method: str, seconds: float, outcome: str) -> None:
        self.calls.labels(method, outcome).inc()
        self.latency.labels(method).observe(seconds)


class _PeerCollector:
    """Reads the peer's numbers when scraped."""

    def __init__(self, peer: Any, late_commits: Callable[[], int], queue: Any = None):
        self.peer = peer
        self.late_commits = late_commits
        self.queue = queue

    def describe(self) -> list:
        return []  # no fixed set: what is collected depends on whether the peer serves a stage yet

    def collect(self) -> Iterator:
        peer = self.peer
        labels = {"peer_id": peer.peer_id, "run_id": peer.run_id}

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(name, doc, labels=list(labels))
            family.add_metric(list(labels.values()), value)
            return family

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(name, doc, labels=list(labels))
            family.add_metric(list(labels.values()), value)
            return family

        state = GaugeMetricFamily(
            "swarm_peer_state", "1 for the state the peer is in", labels=[*labels, "state"]
        )
        for name in PeerState:
            state.add_metric([*labels.values(), name.value], float(peer.state == name))
        yield state
        yield gauge("swarm_peer_in_flight", "Calls being handled", peer.admission.in_flight)
        if self.queue is not None:
            shed = CounterMetricFamily(
                "swarm_peer_shed_calls",
                "Calls whose work was not started because the caller's deadline could not be met (load "
                "shedding), by reason: expired, unmeetable, queue_full",
                labels=[*labels, "reason"],
            )
            for reason, count in self.queue.shed.items():
                shed.add_metric([*labels.values(), reason.value], count)
            yield shed
            yield gauge(
                "swarm_peer_queued_seconds",
                "Predicted seconds of compute admitted and not finished (what a new call waits behind)",
                self.queue.queued_s,
            )
        if peer.caller_check is not None:  # set with the server
            refused = CounterMetricFamily(
                "swarm_peer_calls_refused",
                "Calls refused before their handler: Unauthenticated (no valid caller token), NotAdmitted (a "
                "caller list leaves the caller out)",
                labels=[*labels, "why"],
            )
            for why in ("Unauthenticated", "NotAdmitted"):
                refused.add_metric([*labels.values(), why], peer.caller_check.refused[why])
            yield refused
        ex = peer.executor
        if ex is None:
            return
        yield gauge("swarm_peer_stage", "Stage this peer serves", ex.stage_index)
        yield gauge("swarm_peer_step", "Optimizer steps of this replica", ex.step)
        yield gauge(
            "swarm_peer_throughput_samples_per_second",
            "Measured samples/s of forward + backward (what the peer announces)",
            ex.throughput,
        )
        yield gauge(
            "swarm_peer_samples_accumulated",
            "Samples accumulated toward the next optimizer step",
            ex.samples_accumulated,
        )
        yield gauge(
            "swarm_peer_held_gradients",
            "Computed gradients waiting for their commit",
            ex.held_gradients,
        )
        yield gauge(
            "swarm_peer_cached_microbatches",
            "Microbatches whose inputs or graph are kept for their backward",
            ex.cached_microbatches,
        )
        yield counter(
            "swarm_peer_microbatches_applied",
            "Microbatch gradients applied",
            ex.microbatches_applied,
        )
        yield counter(
            "swarm_peer_samples_applied", "Samples in the gradients applied", ex.samples_applied
        )
        yield counter(
            "swarm_peer_samples_left_out",
            "Samples applied here that reached no optimizer step of the stage (a missed all-reduce)",
            ex.samples_left_out,
        )
        yield counter(
            "swarm_peer_busy_seconds",
            "Seconds the compute thread spent serving (busy share: its rate over wall time)",
            ex.busy_s,
        )
        yield counter(
            "swarm_peer_gradients_dropped",
            "Computed gradients dropped uncommitted (their callers computed them again)",
            ex.gradients_dropped,
        )
        yield counter(
            "swarm_peer_backwards_from_graph",
            "Backwards that used the graph their forward kept here",
            ex.backwards_from_graph,
        )
        yield counter(
            "swarm_peer_backwards_recomputed",
            "Backwards that computed the forward again (no graph kept: the cache budget, or no forward here)",
            ex.backwards_recomputed,
        )
        yield counter(
            "swarm_peer_missed_param_steps",
            "Calls pinned to an optimizer step whose parameters this replica no longer or not yet held",
            ex.missed_param_steps,
        )
        yield counter(
            "swarm_peer_late_commits",
            "Commits that came through the Commit RPC (the one in the call was not confirmed)",
            self.late_commits(),
        )
