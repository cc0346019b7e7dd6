"""Prometheus metrics of one trainer (``swarm train --metrics-port``): its losses, speed and retries.

Read from the trainer when Prometheus scrapes: the last step's training loss and tokens/s, the last
validation loss, and the pipeline's counts of retried calls, unconfirmed commits and recomputed gradients.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from swarm.metrics import MetricsEndpoint


class TrainerMetrics(MetricsEndpoint):
    """Metrics of ``trainer`` (a swarm.trainer.trainer.Trainer, not imported: it imports this module)."""

    def __init__(self, trainer: Any):
        super().__init__()
        self.registry.register(_TrainerCollector(trainer))


class _TrainerCollector:
    def __init__(self, trainer: Any):
        self.trainer = trainer

    def describe(self) -> list:
        return []

    def collect(self) -> Iterator:
        trainer = self.trainer
        latest, pipeline = trainer.latest, trainer.pipeline
        labels = {"trainer_id": trainer.trainer_id, "run_id": trainer.config.run_id}

        def family(kind, name: str, doc: str, value: float):
            metric = kind(name, doc, labels=list(labels))
            metric.add_metric(list(labels.values()), value)
            return metric

        yield family(
            GaugeMetricFamily, "swarm_trainer_step", "Global batches trained", latest["step"]
        )
        for key, name, doc in (
            ("loss", "swarm_trainer_loss", "Mean training loss of the last global batch"),
            ("val_loss", "swarm_trainer_validation_loss", "Validation loss of the last validation"),
            ("tokens_per_s", "swarm_trainer_tokens_per_second", "Tokens/s since training started"),
        ):
            if math.isfinite(latest.get(key, math.nan)):
                yield family(GaugeMetricFamily, name, doc, latest[key])
        for value, name, doc in (
            (latest["microbatches"], "swarm_trainer_microbatches", "Microbatches completed"),
            (latest["samples"], "swarm_trainer_samples", "Samples in the microbatches completed"),
            (
                pipeline.failed_calls,
                "swarm_trainer_retried_calls",
                "Calls that failed, retried elsewhere",
            ),
            (
                pipeline.unconfirmed_commits,
                "swarm_trainer_unconfirmed_commits",
                "Commits whose outcome stayed unknown (the peer unreachable past its hold)",
            ),
            (
                pipeline.recomputed_gradients,
                "swarm_trainer_recomputed_gradients",
                "Stage gradients computed again because a peer did not count them",
            ),
            (
                pipeline.refused_gradients,
                "swarm_trainer_refused_gradients",
                "Gradients a stage refused as far larger than its recent ones",
            ),
            (
                pipeline.lost_gradients,
                "swarm_trainer_lost_gradients",
                "Microbatches that did not count at a stage that refused their gradient, nor at the ones before",
            ),
            (
                len(pipeline.banned_for_run),
                "swarm_trainer_peers_banned_for_bad_replies",
                "Peers banned for the rest of the run for a reply that failed the checks",
            ),
        ):
            yield family(CounterMetricFamily, name, doc, value)
        spot = CounterMetricFamily(
            "swarm_trainer_spot_checks",
            "Forward calls recomputed at another replica and compared, by result",
            labels=[*labels, "result"],
        )
        counts = pipeline.spot_checks.counts
        for result, value in (
            ("agreed", counts.agreed),
            ("mismatched", counts.mismatched),
            ("inconclusive", counts.inconclusive),
        ):
            spot.add_metric([*labels.values(), result], value)
        yield spot
