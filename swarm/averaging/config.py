"""How the peers of a stage average: ``--average`` (the default; ``--no-average`` turns it off) and its timeouts
(flags of ``swarm peer``)."""

from __future__ import annotations

from dataclasses import dataclass, field

GRAD_COMPRESSIONS = ("none", "fp16", "scaled-fp16")
ALL_REDUCES = ("hivemind", "direct")


@dataclass(frozen=True, kw_only=True)
class AveragingConfig:
    FLAG_TITLE = "averaging"

    # all-reduce gradients with this stage's other peers and step together once per global batch (hivemind), so
    # the replicas of a stage stay one model; --no-average: each replica steps alone on the microbatches it
    # served (single-replica experiments; replicas drift apart)
    average: bool = True
    # seconds peers of a stage spend forming an all-reduce group before a step
    matchmaking_s: float = 2.0
    # an all-reduce that takes longer is abandoned (the step uses local grads)
    averaging_timeout_s: float = 30.0
    # The longest a step's all-reduce group waits for every replica of the stage at that step (the trainer's count,
    # else the stage's progress records) before it averages without the missing ones; it starts at once when they
    # are all in. A replica that misses its group loses its samples of the batch (it loads its peers' state).
    group_wait_s: float = 10.0
    # A groupmate silent this long mid all-reduce is dropped from it (the replicas that miss its part reload: see
    # HivemindStageOptimizer._finish_step). Long enough for a groupmate whose view of the stage lags (its DHT reads
    # stall for seconds on a loaded machine).
    chunk_timeout_s: float = 10.0
    load_state_timeout_s: float = 60.0  # how long a newcomer waits for its stage's state from peers
    # A replica that stops reporting its progress (killed, frozen, gone) stops counting in its stage's averaging
    # after this long: the most a kill costs its peers (they re-report twice per period; under a second risks
    # missing a live replica on a loaded DHT, and then replicas step alone and drift apart).
    progress_ttl_s: float = 15.0
    # gradient all-reduce codec (hivemind's 8-bit codecs fail under numpy 2)
    grad_compression: str = field(default="none", metadata={"choices": GRAD_COMPRESSIONS})
    step_check_s: float = 0.1  # seconds between checks whether the stage's global batch is full
    # How the replicas of a stage all-reduce: "direct" averages with exactly the replicas the trainer's close names,
    # over the replicas' own gRPC servers (swarm.averaging.direct), with no matchmaking; "hivemind" forms each step's
    # group through the DHT and averages over libp2p (1.6x slower on two cores). Every replica of a stage must use
    # the same.
    all_reduce: str = field(default="direct", metadata={"choices": ALL_REDUCES})

    def __post_init__(self):
        if self.all_reduce not in ALL_REDUCES:
            raise ValueError(
                f"all_reduce '{self.all_reduce}' is unknown; choose one of {', '.join(ALL_REDUCES)}"
            )
        if self.grad_compression not in GRAD_COMPRESSIONS:
            raise ValueError(
                f"grad_compression '{self.grad_compression}' is unknown; choose one of "
                f"{', '.join(GRAD_COMPRESSIONS)} (hivemind's 8-bit codecs fail under numpy 2)"
            )
        if (
            min(
                self.matchmaking_s,
                self.averaging_timeout_s,
                self.chunk_timeout_s,
                self.load_state_timeout_s,
                self.progress_ttl_s,
                self.step_check_s,
                self.group_wait_s,
            )
            <= 0
        ):
            raise ValueError(
                f"matchmaking_s ({self.matchmaking_s}), "
                f"averaging_timeout_s ({self.averaging_timeout_s}), "
                f"chunk_timeout_s ({self.chunk_timeout_s}), load_state_timeout_s "
                f"({self.load_state_timeout_s}), progress_ttl_s ({self.progress_ttl_s}) and "
                f"step_check_s ({self.step_check_s}) and group_wait_s ({self.group_wait_s}) must be > 0"
            )
        if not self.matchmaking_s <= self.group_wait_s < self.averaging_timeout_s:
            raise ValueError(
                f"group_wait_s ({self.group_wait_s}) must be at least matchmaking_s ({self.matchmaking_s}) and "
                f"below averaging_timeout_s ({self.averaging_timeout_s}): a group that waits longer than the "
                f"all-reduce may take is abandoned before it starts; lower --group-wait-s or raise "
                f"--averaging-timeout-s"
            )
