"""What one ``swarm peer`` is told: the run and stage to serve, where to listen, drain timing, fault
injection, checkpoints, averaging and rebalancing. The CLI's flags are built from these fields."""

from __future__ import annotations

from dataclasses import dataclass, field

from swarm.averaging.config import AveragingConfig
from swarm.balance import RebalanceConfig
from swarm.discovery.config import DHTConfig
from swarm.model.devicespec import check_device_spec, check_dtype_name
from swarm.peer.members import check_allow_callers
from swarm.transport.relayconfig import RelayConfig


@dataclass(frozen=True, kw_only=True)
class CacheConfig:
    FLAG_TITLE = "advanced: caches and commits"

    # bytes of autograd graphs kept so backward needs no recompute (the tensors they save; beyond it only
    # the inputs are kept and backward recomputes). Unset: on a GPU, half of what the device has free beyond the
    # stage's other needs (a stage of GPT-2 small saves ~2-4 GiB per microbatch of 8 x 1024 tokens, so a fixed
    # 256 MiB kept none and every backward computed its forward again); elsewhere 256 MiB (swarm.peer.memory)
    graph_cache_bytes: int | None = None
    # bytes of stage inputs kept for backward (oldest evicted first)
    input_cache_bytes: int = 256 << 20
    # older optimizer steps whose parameters a replica keeps, a copy each (swarm.peer.versions): a graph kept
    # across that many steps stays valid, and a trainer that streams the next global batch while the stage
    # averages pins its calls to the step before; 0 = the current step's only (a step drops the graphs)
    kept_param_steps: int = 1
    # backward replies kept so a retried backward returns the same answer
    reply_cache_size: int = 256
    applied_ids_size: int = 100_000  # microbatch ids remembered as applied (never counted twice)
    # bytes of computed gradients waiting for their callers' commits (a copy of the stage's parameter
    # gradients each); new gradient work is refused (RESOURCE_EXHAUSTED) past it, one is always admitted
    held_gradient_bytes: int = 1 << 30
    # Seconds a computed gradient waits for its caller's commit, from the moment its reply is ready; a commit
    # after that is refused (GradientsDropped) and the caller computes it again. Callers that lost the call
    # (a broken stream) commit through the Commit RPC within this time; one that hears nothing by then knows
    # the gradient can no longer count here. Longer than a reply's transfer plus the commit's round trip.
    commit_hold_s: float = 10.0
    # dropped microbatch ids remembered with the reason, for the error a late commit gets
    dropped_ids_size: int = 4096
    # A microbatch whose parameter gradient per sample is more than this many times the lower quartile of the
    # stage's recent ones is refused, not held (one caller's corrupted or hostile gradient cannot swamp the global
    # batch); 0 = no bound. Off by default: a diverging run's honest gradients grew 1,490x within 64 microbatches
    # (tests/test_faults.py), and a refused gradient cannot be told from an attack without a second opinion.
    max_gradient_ratio: float = 0.0

    def __post_init__(self):
        if (
            min(
                0 if self.graph_cache_bytes is None else self.graph_cache_bytes,
                self.reply_cache_size,
                self.input_cache_bytes,
                self.kept_param_steps,
            )
            < 0
        ):
            raise ValueError(
                f"cache sizes must be >= 0, got graph_cache_bytes={self.graph_cache_bytes}, "
                f"input_cache_bytes={self.input_cache_bytes}, reply_cache_size={self.reply_cache_size}, "
                f"kept_param_steps={self.kept_param_steps}"
            )
        if not self.commit_hold_s > 0:
            raise ValueError(
                f"commit_hold_s must be > 0 (seconds a gradient waits for its commit), got {self.commit_hold_s}"
            )
        if not self.max_gradient_ratio >= 0:
            raise ValueError(
                f"max_gradient_ratio must be >= 0 (0 = no bound), got {self.max_gradient_ratio}"
            )
        if self.held_gradient_bytes < 0 or self.applied_ids_size < 1:
            raise ValueError(
                f"held_gradient_bytes ({self.held_gradient_bytes}) must be >= 0 and applied_ids_size "
                f"({self.applied_ids_size}) >= 1: with none, a peer would forget every applied microbatch"
            )


@dataclass(frozen=True, kw_only=True)
class LimitsConfig:
    """What one peer lets callers take, so no caller (faulty or hostile) can exhaust it. Everything past a
    limit is refused with a gRPC status and a sentence; see docs/security.md, "Bounded resources"."""

    FLAG_TITLE = "advanced: limits"

    # bytes of request tensors all calls together may hold, reserved from each tensor's header before any
    # of it is allocated (and the parameters a GetState copies); past it: RESOURCE_EXHAUSTED
    request_memory_bytes: int = 1 << 30
    # bytes gRPC buffers per open call before the peer reads them (its receive window, fixed: no growth by
    # bandwidth probing); every open call reserves it from --request-memory-bytes, and a flood's streams hold
    # one each (bench/results/peer_flood.md). 1 MiB fills a 100 Mbit/s link at 80 ms of round trip per call; a
    # trainer keeps several calls in flight to a peer, whose windows add up
    stream_window_bytes: int = 1 << 20
    # calls gRPC keeps open at once, refused or not (each can hold a receive window before any handler runs, so
    # a flood holds at most this many windows); past it gRPC itself answers RESOURCE_EXHAUSTED
    max_open_calls: int = 128
    # calls one caller (IP address) may have open at once; more are refused with RESOURCE_EXHAUSTED
    max_streams_per_caller: int = 64
    # calls queued for or running on the compute thread; more are refused with RESOURCE_EXHAUSTED
    max_queued_calls: int = 32
    # seconds of compute (predicted from the measured per-sample times) that may wait ahead of a new call; a
    # call arriving behind more is refused at once (RESOURCE_EXHAUSTED, DeadlineUnmet); 0 = unbounded. The
    # default is the longest deadline a trainer gives (RoutingConfig.max_timeout_s): a tighter bound refuses
    # work its caller would wait for, and the refused microbatches bounce instead of keeping slow peers
    # busy (30 s held a simulated swarm at 84% of its bottleneck, bench/results/scale_sim.md)
    max_queue_wait_s: float = 120.0
    # load shedding: refuse work whose caller's deadline has passed, or that the queue ahead would finish
    # after it (DeadlineUnmet: the caller retries elsewhere at once, no ban); --no-shed-late-work computes it
    shed_late_work: bool = True
    # seconds a call's request may go without a frame before the call is cut (DEADLINE_EXCEEDED)
    read_idle_s: float = 30.0
    # seconds a call has to send its whole request, and a GetState to be read (a trickle is cut)
    read_total_s: float = 600.0
    # seconds this peer tries to connect back to a starting peer that asks whether it is reachable (DialBack);
    # a starting peer waits as long for the answer, plus a margin
    dial_back_timeout_s: float = 5.0

    def __post_init__(self):
        if (
            self.stream_window_bytes < 1 << 16
            or self.stream_window_bytes >= self.request_memory_bytes
        ):
            raise ValueError(
                f"stream_window_bytes ({self.stream_window_bytes}) must be at least 65536 and below "
                f"request_memory_bytes ({self.request_memory_bytes}): every open call reserves its window from it"
            )
        if min(self.request_memory_bytes, self.max_streams_per_caller, self.max_queued_calls) < 1:
            raise ValueError(
                f"request_memory_bytes ({self.request_memory_bytes}), max_streams_per_caller "
                f"({self.max_streams_per_caller}) and max_queued_calls ({self.max_queued_calls}) must be >= 1"
            )
        if self.max_open_calls < self.max_streams_per_caller:
            raise ValueError(
                f"max_open_calls ({self.max_open_calls}) must be at least max_streams_per_caller "
                f"({self.max_streams_per_caller}): one caller could not open what it is allowed"
            )
        if not self.max_queue_wait_s >= 0:
            raise ValueError(
                f"max_queue_wait_s must be >= 0 seconds (0 = unbounded), got {self.max_queue_wait_s}"
            )
        if not 0 < self.read_idle_s <= self.read_total_s:
            raise ValueError(
                f"need 0 < read_idle_s <= read_total_s, got {self.read_idle_s} and {self.read_total_s}"
            )
        if not 0 < self.dial_back_timeout_s <= 60:
            raise ValueError(
                f"dial_back_timeout_s must be in (0, 60], got {self.dial_back_timeout_s}"
            )


_FAULTS = "advanced: fault injection (for tests and benchmarks; all off by default)"


@dataclass(frozen=True, kw_only=True)
class PeerConfig:
    FLAG_TITLE = "peer"
    FLAG_GROUPS = {
        name: _FAULTS
        for name in (
            "slowdown",
            "fail_probability",
            "hang_after_calls",
            "lose_commit_probability",
            "lie_output_scale",
            "lie_gradient_scale",
        )
    } | {
        name: "advanced: limits"
        for name in ("max_microbatch_size", "calibration_batch", "drain_notice_s")
    }

    run_id: str = "demo"  # the run to join
    # stage index to serve (default: the stage where this peer adds the most throughput)
    stage: int | None = None
    # address the gRPC server and the DHT listen on (0.0.0.0 for all interfaces)
    host: str = "127.0.0.1"
    port: int = 0  # gRPC port (0 = any free port)
    announce_host: str | None = None  # address others should dial, if not --host
    threads: int = 1  # torch intra-op threads for this peer's compute
    # where the stage computes: auto (a GPU when torch sees one, else the CPU), cpu, cuda, cuda:N or mps
    device: str = "auto"
    # compute dtype: fp32, or bf16/fp16 under autocast (weights and optimizer state stay fp32; the wire
    # carries the run's codec whatever it is; fp16 is loss-scaled and needs a GPU)
    dtype: str = "fp32"
    # bytes the stage may take on its device (default: what the device has free, or the RAM available on the
    # CPU): the peer refuses to start when its memory estimate is larger
    memory_limit_bytes: int | None = None
    heartbeat_s: float = 1.0  # seconds between DHT announcements
    ttl_s: float = 5.0  # announcement lifetime: a silent peer disappears from routing after this
    drain_timeout_s: float = 30.0  # on SIGTERM, exit within this many seconds
    # after SIGTERM, keep accepting forwards this long while trainers learn of it
    drain_notice_s: float = 3.0
    # while draining, give up on cached microbatches' backward after this long without any call
    drain_idle_s: float = 5.0
    max_microbatch_size: int = 256  # most samples accepted in one request
    calibration_batch: int = 8  # samples used to time the stage at startup
    slowdown: float = 1.0  # fault injection: emulate a device this many times slower (1 = off)
    # fault injection: answer this share of calls with an error (0 = off)
    fail_probability: float = 0.0
    # fault injection: stop answering (hang) after this many calls (0 = off)
    hang_after_calls: int = 0
    # fault injection: lose this share of the commits sent in calls: before applying them, after (the
    # confirmation lost), or as if they came after the hold (the gradients dropped); 0 = off
    lose_commit_probability: float = 0.0
    # fault injection: a liar, multiplying its forward outputs by this (1 = honest; see swarm.peer.lies)
    lie_output_scale: float = 1.0
    # fault injection: a liar, multiplying the input gradients it returns by this (1 = honest)
    lie_gradient_scale: float = 1.0
    # serve Prometheus metrics at http://HOST:PORT/metrics (0 = any free port; unset = off)
    metrics_port: int | None = None
    # seconds between the log lines that sum up what the peer did (0 = none)
    log_every_s: float = 30.0
    # serve gRPC without TLS and announce no certificate (experiments on one machine: anyone on the path can
    # read and change the traffic); callers are still authenticated
    plaintext: bool = False
    # admit only these callers (peer ids or fingerprints, comma-separated, or "@FILE" with one a line); default:
    # any caller with a valid identity. Others get PERMISSION_DENIED
    allow_callers: str | None = None
    # at start, ask a peer already in the run to dial this one back at its endpoint, and announce whether it is
    # directly reachable or must be relayed (swarm.peer.reachability); off: announced direct, unchecked
    reachability_check: bool = True
    # relaying for peers behind NAT, and through a relay when this one is (swarm.transport.relay)
    relay: RelayConfig = field(default_factory=RelayConfig)
    dht: DHTConfig = field(default_factory=DHTConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    # save this peer's stage state here (periodically and on drain); resume from it
    checkpoint_dir: str | None = None
    checkpoint_every_steps: int = 10  # optimizer steps between checkpoints (with --checkpoint-dir)
    # a Hugging Face checkpoint directory (config.json + safetensors): a new run starts from its weights; a peer
    # of a run started from one loads them from here (their sha256 must match the run's)
    pretrained: str | None = None
    averaging: AveragingConfig = field(default_factory=AveragingConfig)
    rebalance: bool = True  # move to the bottleneck stage when the swarm is unbalanced
    balance: RebalanceConfig = field(default_factory=RebalanceConfig)

    def __post_init__(self):
        check_allow_callers(self.allow_callers)
        check_device_spec(self.device)
        check_dtype_name(self.dtype)
        if self.memory_limit_bytes is not None and self.memory_limit_bytes < 1:
            raise ValueError(f"memory_limit_bytes must be >= 1, got {self.memory_limit_bytes}")
        if self.stage is not None and self.stage < 0:
            raise ValueError(f"stage must be >= 0, got {self.stage}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if not 0 < self.heartbeat_s < self.ttl_s:
            raise ValueError(
                f"need 0 < heartbeat_s < ttl_s, got heartbeat_s={self.heartbeat_s}, ttl_s={self.ttl_s}"
            )
        if self.slowdown < 1:
            raise ValueError(f"slowdown is a factor >= 1 (1 = normal speed), got {self.slowdown}")
        if not 0 <= self.fail_probability <= 1 or self.hang_after_calls < 0:
            raise ValueError(
                f"fail_probability must be in [0, 1] and hang_after_calls >= 0, got "
                f"{self.fail_probability} and {self.hang_after_calls}"
            )
        if not 0 <= self.lose_commit_probability <= 1:
            raise ValueError(
                f"lose_commit_probability must be in [0, 1], got {self.lose_commit_probability}"
            )
        if not (
            0 < self.lie_output_scale < float("inf") and 0 < self.lie_gradient_scale < float("inf")
        ):
            raise ValueError(
                f"lie_output_scale and lie_gradient_scale are finite factors > 0 (1 = honest), got "
                f"{self.lie_output_scale} and {self.lie_gradient_scale}"
            )
        if self.log_every_s < 0:
            raise ValueError(
                f"log_every_s must be >= 0 seconds (0 = no summaries), got {self.log_every_s}"
            )
        if not self.drain_idle_s > 0:
            raise ValueError(f"drain_idle_s must be > 0 seconds, got {self.drain_idle_s}")
        if not 0 <= self.drain_notice_s < self.drain_timeout_s:
            raise ValueError(
                f"need 0 <= drain_notice_s < drain_timeout_s, got {self.drain_notice_s} and "
                f"{self.drain_timeout_s}"
            )
        if self.checkpoint_every_steps < 1:
            raise ValueError(
                f"checkpoint_every_steps must be >= 1, got {self.checkpoint_every_steps}"
            )
        if self.threads < 1 or self.max_microbatch_size < 1 or self.calibration_batch < 1:
            raise ValueError(
                f"threads ({self.threads}), max_microbatch_size ({self.max_microbatch_size}) and "
                f"calibration_batch ({self.calibration_batch}) must be >= 1"
            )
