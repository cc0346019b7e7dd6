"""What one ``swarm train`` is told (the CLI's flags are built from these fields); imports no torch."""

from __future__ import annotations

from dataclasses import dataclass, field

from swarm.data.config import DataConfig
from swarm.discovery.config import DHTConfig
from swarm.routing.config import RoutingConfig

# How activations travel between stages (see PipelineConfig.activations and swarm.trainer.push).
ACTIVATIONS = ("relayed", "push")


@dataclass(frozen=True, kw_only=True)
class PipelineConfig:
    FLAG_TITLE = "advanced: pipeline"

    refresh_s: float = 1.0  # seconds between refreshes of the peer lists from the DHT
    empty_stage_wait_s: float = 120.0  # how long a request waits for a stage with no live peer
    segment_bytes: int = 1 << 20  # raw bytes per streamed chunk
    # share of forward calls recomputed at another replica of the stage at the same step and parameters and
    # compared (a peer whose result two others contradict is banned for the run; 0 = off)
    spot_check_share: float = 0.05
    # relative L2 distance up to which two replicas' results count as equal (the codec rounds them)
    spot_check_tolerance: float = 0.02
    # a reply whose input gradient per sample is more than this many times the lower quartile of the stage's
    # recent ones is refused before it counts, and its peer banned for the run (0 = no bound; off by default: a
    # diverging run's honest gradients grew 1,490x within 64 microbatches, and the bound would ban honest peers)
    max_gradient_ratio: float = 0.0
    # distinct trainers whose signed ban reports make this one avoid a peer too (the run's owner counts alone);
    # a peer reported by fewer is spot-checked on every forward call instead
    ban_report_quorum: int = 2
    ban_report_ttl_s: float = 3600.0  # seconds this trainer's ban reports live in the DHT
    # how activations travel: "relayed" (the trainer sends every stage its input and the gradients back) or "push"
    # (the trainer sends tokens to stage 0 with the route; each stage sends its output straight to the next stage's
    # peer, the gradients come straight back, and the trainer receives the loss and the outcome of every hop)
    activations: str = field(default="relayed", metadata={"choices": ACTIVATIONS})
    # push mode: peers named per stage, the first the one routing picked, the others tried in turn by the stage
    # before it when a call fails (no microbatch restarts from stage 0 while one of them answers)
    push_candidates: int = 2

    def __post_init__(self):
        if self.activations not in ACTIVATIONS:
            raise ValueError(
                f"activations must be one of {', '.join(ACTIVATIONS)}, got {self.activations!r}"
            )
        if not 1 <= self.push_candidates <= 8:
            raise ValueError(f"push_candidates must be in 1..8, got {self.push_candidates}")
        if self.ban_report_quorum < 1 or self.ban_report_ttl_s <= 0:
            raise ValueError(
                f"need ban_report_quorum >= 1 and ban_report_ttl_s > 0; got {self.ban_report_quorum}, "
                f"{self.ban_report_ttl_s}"
            )
        if (
            not 0 <= self.spot_check_share <= 1
            or not self.spot_check_tolerance > 0
            or self.max_gradient_ratio < 0
        ):
            raise ValueError(
                f"spot_check_share must be in [0, 1], spot_check_tolerance > 0 and max_gradient_ratio >= 0; got "
                f"{self.spot_check_share}, {self.spot_check_tolerance}, {self.max_gradient_ratio}"
            )
        if self.refresh_s <= 0 or self.empty_stage_wait_s < 0 or self.segment_bytes < 1024:
            raise ValueError(
                f"need refresh_s > 0, empty_stage_wait_s >= 0, segment_bytes >= 1024; got "
                f"{self.refresh_s}, {self.empty_stage_wait_s}, {self.segment_bytes}"
            )


@dataclass(frozen=True, kw_only=True)
class TrainerConfig:
    FLAG_TITLE = "trainer"

    run_id: str = "demo"  # the run to train
    host: str = "127.0.0.1"  # address this trainer's DHT node listens on
    microbatch_size: int = 8  # sequences per microbatch
    in_flight: int = 4  # microbatches in the pipeline at once
    steps: int = 100  # global batches to train (0 = until interrupted)
    eval_every_steps: int = 25  # validation every this many steps (0 = only at the end)
    eval_batches: int = 4  # validation batches (of microbatch_size sequences)
    # data sampling (and routing) seed; unset = one derived from the trainer's identity (kept in its data state),
    # so trainers started alike read different batches
    seed: int | None = None
    # start global batch b once every replica of every stage has stepped on batch b - this - 1 (-1: no limit).
    # With averaging stages, batch b then computes on the parameters of the step on batch b - this - 1 (pinned,
    # whatever step a replica has reached when a call arrives), and swarm.trainer.reference trains the same
    # schedule: 0 is lockstep (what one process does), 1 overlaps each batch's all-reduce with the next batch
    # (peers keep --kept-param-steps older steps' parameters for it). Unset: 1 when every stage's replicas
    # average (the peers' default), no limit when they don't (--no-average)
    max_batches_ahead: int | None = None
    # with --max-batches-ahead: give up waiting for a stage's step once it has not advanced for this
    # long
    stage_step_wait_s: float = 30.0
    peers_wait_s: float = 120.0  # how long to wait at start for every stage to have a peer
    log_every_s: float = 2.0  # seconds between progress lines
    # seconds between announcements of its progress in the DHT, for `swarm status` and the dashboard
    # (0 = never)
    heartbeat_s: float = 2.0
    metrics_path: str | None = None  # append one JSON line per step and per validation here
    # write TensorBoard scalars (loss, validation loss, tokens/s, retries) under DIR/RUN_ID/ (needs tensorboard)
    tensorboard_dir: str | None = None
    # serve Prometheus metrics at http://HOST:PORT/metrics (0 = any free port; unset = off)
    metrics_port: int | None = None
    data: DataConfig = field(default_factory=DataConfig)
    dht: DHTConfig = field(default_factory=DHTConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    routing: RoutingConfig = field(default_factory=RoutingConfig)

    def __post_init__(self):
        if self.microbatch_size < 1 or self.in_flight < 1 or self.eval_batches < 1:
            raise ValueError(
                f"microbatch_size ({self.microbatch_size}), in_flight ({self.in_flight}) and "
                f"eval_batches ({self.eval_batches}) must be >= 1"
            )
        if self.max_batches_ahead is not None and self.max_batches_ahead < -1:
            raise ValueError(
                f"max_batches_ahead must be >= 0, or -1 for no limit; got {self.max_batches_ahead}"
            )
        if self.heartbeat_s < 0:
            raise ValueError(
                f"heartbeat_s must be >= 0 seconds (0 = never), got {self.heartbeat_s}"
            )
        if self.stage_step_wait_s < 0:
            raise ValueError(
                f"stage_step_wait_s must be >= 0 seconds, got {self.stage_step_wait_s}"
            )
        if self.steps < 0 or self.eval_every_steps < 0:
            raise ValueError(
                f"steps ({self.steps}) and eval_every_steps ({self.eval_every_steps}) must be >= 0"
            )
