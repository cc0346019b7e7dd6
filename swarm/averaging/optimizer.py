"""One stage's hivemind optimizer: the peers of a stage accumulate toward one global batch, all-reduce and
step together.

:class:`HivemindStageOptimizer` wraps ``hivemind.Optimizer`` with run id ``f"{run_id}_stage{k}"``: commits report
samples to the stage's progress tracker; when the stage as a whole has the global batch, every peer of the stage
averages its gradient sums weighted by samples (exact global mean) and steps. The parts of hivemind it needs
apart are reached through :mod:`swarm.averaging.hivemind_private` (pinned version).

Why synchronous (``delay_optimizer_step=False``, ``delay_grad_averaging=False``, no local updates): the
optimizer step runs on the peer's compute thread, so it never races a forward or backward and the swarm
optimises exactly what the single-process model does (no stale parameters). The all-reduce itself does not hold
the compute thread: ``maybe_step`` hands the gradients to hivemind's averager process and returns; the thread
serves calls meanwhile (microbatches of the next batch are kept aside, see ``accumulate``) and takes the update
once the all-reduce is done. hivemind starts matchmaking ``matchmaking_s`` before the batch is expected to fill,
and the trainer closes each batch (``close_batch``), so the wait for the group is mostly the all-reduce itself
(tokens/s in bench/results/convergence.md). The delayed modes would run the step on hivemind's thread and write
parameters under a running backward (or, with an offloaded optimizer, apply one step late), which breaks the
parity the issue asks for.

With ``--all-reduce direct`` (the default) the step's all-reduce is :mod:`swarm.averaging.direct` with the group the
trainer's close names (``_maybe_step_direct``); hivemind's progress records and state downloads stay as they are,
and the rules below about groups apply to ``--all-reduce hivemind``.

How the replicas of a stage stay equal (each rule closes a way they drifted apart in measurements):

* an all-reduce group only joins replicas at the same step (its key holds the step): a replica one step behind
  never adds its gradients of another batch to its peers' average;
* a replica never waits for a group on its compute thread: if its peers' group assembled without it, they step
  without its samples of that batch and it loads their state;
* a replica that stepped on partial results (a groupmate's part timed out: hivemind keeps the local values
  there and only logs it), on its own gradients, or skipped a non-finite step, reloads its peers' state;
* a donor serves its step, parameters and optimizer state together (hivemind counts the step up before the
  update and reads parameters without the update's lock), and a loaded state keeps its own step: hivemind's
  "catching up" would label a state one step old with the stage's step.
"""

from __future__ import annotations

import functools
import logging
import random
import time
from collections.abc import Callable

import torch
from hivemind.averaging.control import AveragingStage
from hivemind.compression import Float16Compression, NoCompression, ScaledFloat16Compression
from hivemind.utils.crypto import RSAPrivateKey

from swarm.averaging import hivemind_private as hp
from swarm.averaging.config import AveragingConfig
from swarm.averaging.direct import DirectAllReduce, Group
from swarm.averaging.keys import stage_run_id, step_group_bits
from swarm.config import RunConfig
from swarm.model import Stage
from swarm.optim import (
    LaterBatches,
    adamw_param_groups,
    build_stage_optimizer,
    saved_step,
    set_learning_rate,
)

logger = logging.getLogger(__name__)

# steps a trainer's count of the stage's replicas stands for when later batches bring none (see _recent_count)
COUNT_MEMORY_STEPS = 2

# Seconds between step checks while a closed batch's all-reduce group forms (see check_soon): the group is usually
# in within a few tenths of a second, and each check is cheap.
CHECK_SOON_S = 0.02
# The stalest samples a replica that missed its stage's steps hands over into the current one (see _hand_over); staler
# gradients are left out. A replica frozen for a few steps comes back that far behind, and one that loads its peers'
# state is often behind again before its next step (they step every ~0.7 s on tiny: the soak lost 16 samples 7 steps
# stale with a bound of 4). What the staleness costs, bench/results/stale_handover.md: a replica's half of every
# fourth batch handed over 1, 4, 16 or 64 steps late ends within the seeds' spread of each other and of leaving
# those samples out (+1.8% to +2.8% above training on whole batches, spread ~1 point).
HAND_OVER_STEPS = 16
# how many of its last steps a replica averaging directly says the makers of (InfoResponse.averaged_steps): a trainer
# asks about the few batches it still holds (swarm.trainer.holdings keeps them up to STALE_STEPS behind)
AVERAGED_STEPS_KEPT = 8

# How often a replica that averages directly reads its stage's progress records (hivemind's tracker: a DHT read), and
# at most how often it writes its own: they only tell it that its peers stepped past it (it then loads their state), or
# who is left to load from. Also at most how often it declares a higher step as a state donor.
DIRECT_PROGRESS_REFRESH_S = 5.0

# How long a replica about to load its peers' state waits for a fresh reading of its stage's progress records (the
# DHT answers in ~10 ms; a DHT node that froze costs seconds on first contact): past it, it judges on the last one.
FRESH_READ_TIMEOUT_S = 2.0

# A doubtful replica whose every donor refuses the connection this many times in a row keeps its own state.
UNREACHABLE_DONOR_TRIES = 3

COMPRESSIONS = {
    "none": NoCompression,
    "fp16": Float16Compression,
    "scaled-fp16": ScaledFloat16Compression,
}


class HivemindStageOptimizer:
    """hivemind.Optimizer for one stage. Every method but the constructor runs on the peer's compute thread
    (``maybe_step`` may hold it for the all-reduce; never the event loop). It splits accumulation from the
    global step through :mod:`swarm.averaging.hivemind_private`."""

    # called (any thread) when a step check would find something to do now: a batch closed, an all-reduce done (the
    # peer then runs its step check at once instead of at its period)
    wake: Callable[[], None] | None = None
    # whether the last step check left a closed batch's group forming: the peer checks again after CHECK_SOON_S
    # rather than its period (hivemind's matchmaking says nothing when the group is in)
    check_soon = False

    def __init__(
        self,
        stage_module: Stage,
        run: RunConfig,
        *,
        dht,
        run_id: str,
        config: AveragingConfig,
        private_key=None,
    ):
        self.stage_module, self.run, self.config = stage_module, run, config
        self.stage_index = stage_module.index
        self.params = list(stage_module.parameters())
        self._later = LaterBatches()
        self._closed_through = -1  # the last global batch known closed (see close_batch)
        # the all-reduce of the step under way (see maybe_step), and what _finish_step needs of its start
        self._pending = None
        self._step_started: tuple[int, int, float, bool] = (0, 0, 0.0, False)
        self._hold_s = 0.0
        # global batch -> its stage's replicas the trainer reached
        self._replicas: dict[int, int] = {}
        # the trainer's latest count of the stage's replicas, whatever the batch, and the batch it was counted for
        # (a count older than COUNT_MEMORY_STEPS is dropped)
        self._last_count, self._last_count_step = 0, 0
        # (step, replicas) the forming group was last told to expect (see _size_group); None: hivemind's rule
        self._group_sized: tuple[int, int] | None = None
        self._handed = 0  # samples this replica put into the step under way
        # of them, samples of earlier batches, by batch (see _hand_over)
        self._handed_over: dict[int, int] = {}
        # samples this replica counted that reached no step of its stage (see _hand_over): lost to the model unless
        # their trainer computed them again elsewhere
        self.samples_left_out = 0
        # (step, the replicas whose gradients its update averaged) for its last steps whose makers it knows (see
        # _note_makers); replaced whole on the compute thread, so any thread reads a consistent tuple
        self.averaged_steps: tuple[tuple[int, tuple[str, ...]], ...] = ()
        # how many steps past the one they were computed for a replica that missed its group hands its samples over
        # (see _hand_over)
        self.hand_over_steps = HAND_OVER_STEPS
        # microbatches of a batch whose step's all-reduce already runs, summed into one copy: (sums in the optimizer's
        # order, samples by batch), handed over into the next step once it is taken (see accumulate)
        self._late: tuple[list[torch.Tensor | None], dict[int, int]] | None = None
        self._regrouped = -1  # the last step whose all-reduce was run again (see _regroup)
        # Averaging directly (set by the peer; None: through hivemind): the groups trainers named, by batch; the group
        # of the all-reduce under way; the key of the last group whose all-reduce failed (not run again)
        self.direct: DirectAllReduce | None = None
        self._groups: dict[int, Group] = {}
        self._direct_group: Group | None = None
        # (step, round): this replica's direct all-reduce of that step failed in round - 1 (see retry_round)
        self._retry = (-1, 0)
        # step -> keys of the groups whose all-reduce failed here (none is run again)
        self._failed_groups: dict[int, set[str]] = {}
        # the last step whose all-reduce returned part of the average only (see _regroup)
        self._partial_step = -1
        self._regrouped_at = 0.0
        self._beside_others = False  # see _begin_step
        # (step, when this replica first saw its batch closed): for the step's log line
        self._closed_at = (-1, 0.0)
        # the furthest step a trainer's close said a replica of the stage holds (see close_batch, _peers_ahead)
        self._peers_step = -1
        # the last step this replica left to take its peers' state (see _maybe_step_direct)
        self._rejoined = -1
        # Whether this replica's endpoint may be gone without its knowing yet (a relayed replica whose relay was not
        # heard for a while: see swarm.peer.relaying); set by the peer, called on the compute thread.
        self.endpoint_in_doubt: Callable[[], bool] = lambda: False
        self._doubt_logged = -1
        self.step_pause_s = (
            0.0  # how long global steps hold the compute thread: quick to rise, slow to fall
        )
        groups = adamw_param_groups(stage_module, run.weight_decay)
        # adamw_param_groups keeps parameters in stage order within each group; hivemind averages in the
        # optimizer's order, so map stage order -> position for gradient reads.
        self._order = [p for g in groups for p in g["params"]]
        self._partial = hp.PartialResults.install()  # before hivemind forks its averager processes
        with hp.keep_sigint_handler():
            self.opt = self._build(groups, dht, run_id, private_key)
        self.opt.grad_averager.step_key = lambda: step_group_bits(self.step)
        self.opt.grad_averager.group_size = self._expected_group
        self.opt.grad_averager.group_wait_s = config.group_wait_s
        if config.all_reduce == "direct":
            # Like its progress records: a donor's step a few seconds late still finds its state.
            self.opt.state_averager.declare_every_s = DIRECT_PROGRESS_REFRESH_S

        # hivemind creates Adam's moments with one virtual step on zero gradients. At lr 0 it moved nothing
        # (no decay either); undo its step count, or every later step's bias correction would be off by one.
        for param_state in self.opt.opt.state.values():
            if "step" in param_state:
                param_state["step"] = torch.zeros_like(torch.as_tensor(param_state["step"]))

    def _build(self, groups, dht, run_id: str, private_key):
        run, config = self.run, self.config
        # hivemind advises a request timeout below the matchmaking time (else matchmaking can deadlock).
        request_timeout = min(5.0, config.matchmaking_s / 2)
        if private_key is None:
            # A DHT node signs owner-marked records with one key (hivemind keeps its first signature validator): the
            # progress records must be marked with that key, the one start_dht keeps with the node.
            identity = getattr(dht, "swarm_identity", None)
            private_key = identity.private_key if identity is not None else RSAPrivateKey()
        return hp.GlobalBatchOptimizer(
            dht=dht,
            run_id=stage_run_id(run_id, self.stage_index),
            target_batch_size=run.target_batch_size,
            params=groups,
            optimizer=lambda params: build_stage_optimizer(params, run, lr=0.0),
            matchmaking_time=config.matchmaking_s,
            averaging_timeout=config.averaging_timeout_s,
            # hivemind's default waits one matchmaking time for each chunk: a groupmate busy computing for longer
            # would be dropped and the replicas would average different partial results.
            next_chunk_timeout=config.chunk_timeout_s,
            load_state_timeout=config.load_state_timeout_s,
            offload_optimizer=False,
            delay_optimizer_step=False,
            delay_grad_averaging=False,
            use_local_updates=False,
            # Replicas start equal (same seed or a downloaded state) and apply the same averaged gradients, so
            # they stay equal without averaging parameters; newcomers download the state instead.
            average_state_every=2**31,
            grad_compression=COMPRESSIONS[config.grad_compression](),
            # Newcomers download the state averager's state; the gradient averager's would never be asked for, yet
            # hivemind's averager declares it in the DHT again each time an all-reduce updates one of its tensors:
            # a DHT store per parameter tensor per step, more than all of a peer's other DHT traffic together.
            grad_averager_factory=functools.partial(
                hp.SampleSumGradientAverager,
                request_timeout=request_timeout,
                allow_state_sharing=False,
            ),
            tracker_opts=dict(
                private_key=private_key,
                min_refresh_period=0.2,
                default_refresh_period=0.5,
                metadata_expiration=config.progress_ttl_s,
                report_every_s=DIRECT_PROGRESS_REFRESH_S if config.all_reduce == "direct" else 0.0,
                read_every_s=DIRECT_PROGRESS_REFRESH_S if config.all_reduce == "direct" else 0.0,
            ),
            averager_opts=dict(request_timeout=request_timeout),
            verbose=False,
        )

    @property
    def step(self) -> int:
        """Optimizer steps this replica has taken (hivemind counts them as its local epoch)."""
        return self.opt.local_epoch

    @property
    def local_samples(self) -> int:
        return self.opt.grad_averager.local_samples_accumulated

    @property
    def holds_unaveraged(self) -> bool:
        """Whether this replica holds samples its stage has not averaged yet: of the current batch, or handed to an
        all-reduce still running. A replica that leaves now drops them from the stage's step."""
        return self.local_samples > 0 or self._pending is not None or self._late is not None

    def accumulate(self, grads, num_samples, batch_step=None):
        """Add one microbatch toward step ``batch_step``: now if that is the stage's current step, aside until the
        stage gets there if it is a later one. A late microbatch (its batch's step taken, or its all-reduce under way)
        joins the next step handed over, as a sample of its own batch (see _hand_over).
        Each replica reports only the current step's samples, so the stage's count reaches the target
        exactly when the trainer's global batch is in, and the step averages exactly that batch.

        Never blocks for the all-reduce (``maybe_step`` takes the step once the group is ready), so a
        commit stays cheap. Returns True if the parameters changed (a replica that fell behind reloads)."""
        if batch_step is not None and batch_step > self.step:
            self._later.add(batch_step, self.step, grads, num_samples)
            if (
                batch_step >= self.step + self._later.max_ahead
                and self.opt.tracker.global_progress.samples_accumulated
            ):
                # The trainer is that many batches further: whatever of this one is still missing is not coming
                # (its trainer restarted, a replica holding part of it died). Step on what the stage has.
                self.close_batch(self.step)
            return False
        batch = self.step if batch_step is None else batch_step
        if self._pending is not None:
            # This step's gradients already went to the all-reduce: a late microbatch joins the next step, one step
            # late, as a sample of its own batch (not the next batch's progress: the stage would step before that
            # batch is in).
            self._keep_late(batch, grads, num_samples)
            return False
        if batch < self.step:
            # a microbatch of a batch whose step was taken (its commit came late): the same, now
            self.opt.grad_averager.carry_in(self._in_optimizer_order(grads), {batch: num_samples})
            return False
        return self._add(grads, num_samples)

    def leave_out_held(self, reason: str) -> int:
        """Leave out every sample this replica holds for a step not yet taken (this batch's, those kept for later
        batches or handed over), counted in ``samples_left_out``; how many. For when a trainer may have computed
        them again elsewhere: a relayed replica whose relay closed its port (see swarm.peer.lifecycle), which a
        trainer closing a batch then takes for gone. Samples already handed to an all-reduce under way stay there
        (their part is out). Compute thread."""
        samples = self._later.clear()
        if self._late is not None:
            samples += sum(self._late[1].values())
            self._late = None
        if self._pending is None and self.local_samples:
            samples += self.local_samples
            self._drop_accumulated()
        if samples:
            self.samples_left_out += samples
            logger.warning(
                "stage %d: %s; leaving out the %d samples it holds of steps not yet taken (a trainer may have "
                "computed them again elsewhere)",
                self.stage_index,
                reason,
                samples,
            )
        return samples

    def _keep_late(self, batch: int, grads, num_samples: int) -> None:
        """Add a late microbatch to the one copy kept for the next step (memory: one gradient set, however many)."""
        late = self._in_optimizer_order(grads)
        if self._late is None:
            self._late = (late, {batch: num_samples})
            return
        sums, by_batch = self._late
        for i, g in enumerate(late):
            if g is not None:
                sums[i] = g if sums[i] is None else sums[i].add_(g)
        by_batch[batch] = by_batch.get(batch, 0) + num_samples

    def _in_optimizer_order(self, grads) -> list[torch.Tensor | None]:
        """Gradients in the stage's parameter order, detached copies in the order of hivemind's accumulators."""
        by_param = {id(p): g for p, g in zip(self.params, grads)}
        return [
            None if by_param[id(p)] is None else by_param[id(p)].detach().clone()
            for p in self._order
        ]

    def _add(self, grads, num_samples: int) -> bool:
        """hivemind.Optimizer.step() up to, not including, the global step: accumulate, report progress, and
        schedule the all-reduce group ahead of the batch's end. (A replica that fell behind catches up in
        ``maybe_step``.)"""
        opt = self.opt
        for p, g in zip(self.params, grads):
            p.grad = g if g is not None else torch.zeros_like(p)
        # Averaging directly, the step waits for the trainer's group, not for the stage's progress records: report
        # the batch's first samples only (its peers then see it holds some), not every microbatch (a DHT store each:
        # a fifth of the tokens/s on two cores, bench/results/convergence.md).
        report = self.direct is None or self.opt.grad_averager.batch_samples == 0
        hp.accumulate_gradients(opt, num_samples, report=report)
        for p in self.params:
            p.grad = None
        if (
            self.direct is None
            and opt.tracker.global_progress.num_peers > 1
            and opt.tracker.global_epoch <= self.step
        ):
            # (behind its peers, no group of this step will form: maybe_step loads their state instead)
            hp.schedule_gradient_averaging(opt)
        return False

    def close_batch(
        self,
        batch_step: int,
        replicas: int = 0,
        group: Group | None = None,
        *,
        stage_step: int = 0,
    ) -> None:
        """The trainer has every microbatch of global batch ``batch_step`` committed (the CloseBatch RPC): the stage
        steps on what it has once its batch is closed, without waiting for samples that will not come (a replica
        killed with its part). ``replicas``: how many of the stage's replicas answered the trainer just before (0 =
        not known). It decides who steps together: one, and this replica steps alone without waiting for a group,
        although the stage's progress records still count a replica just killed (they outlive it); more, and it
        averages, although the records may not show its peers yet (stepping alone, it would drift apart). Any
        thread: the next ``maybe_step`` reads it."""
        # The count first, then the close: maybe_step runs on the compute thread and steps once it sees the close,
        # reading the count then (read before it was set, a replica of several stepped alone: tests/test_regroup.py).
        if group is not None and self.direct is not None:
            # averaging directly: the group names whom to step with (the latest close wins, as for the count,
            # unless it is of an earlier round: a close sent before a member said the group failed, come late)
            known = self._groups.get(batch_step)
            if known is None or group.round >= known.round:
                self._groups[batch_step] = group
            replicas = len(group.members)
        if replicas:  # the latest count wins: a trainer closes again while it waits
            self._replicas[batch_step] = replicas
            self._last_count, self._last_count_step = replicas, batch_step
        self._closed_through = max(self._closed_through, batch_step)
        # the furthest step the trainer saw a replica of the stage at: its peers' step before their records say it
        self._peers_step = max(self._peers_step, stage_step)
        if self.wake is not None:
            self.wake()
        logger.debug(
            "stage %d: batch %d closed, %d replicas counted", self.stage_index, batch_step, replicas
        )

    def retry_round(self, batch_step: int) -> int:
        """The round a trainer should name the group of step ``batch_step`` in: past the last round whose direct
        all-reduce failed here (a groupmate's share did not come: killed, frozen, its relay lost), so that the
        members left run it again at once rather than each wait out ``averaging_timeout_s`` for another group
        (none runs a group that failed there again); 0: none failed. Any thread."""
        step, round = self._retry
        return round if step == batch_step else 0

    def _catch_up(self) -> None:
        """After a step: count the microbatches kept aside for the step the stage has now reached. Those kept for a
        step it went past without them (it loaded its peers' state beyond it) are that batch's samples, late: handed
        over (_hand_late), never counted as this batch's (the soak saw a replica put 16 samples of batch 833 into
        step 834 as its own: 48 samples in that step, 16 in the step before)."""
        while (due := self._later.pop_due(self.step)) is not None:
            batch, sums, samples = due
            if batch == self.step:
                self._add(sums, samples)
            else:
                self._hand_late(self._in_optimizer_order(sums), {batch: samples}, batch)
        if self._late is not None:
            late, self._late = self._late, None
            self.opt.grad_averager.carry_in(*late)

    def maybe_step(self) -> bool:
        """Take the stage's optimizer step if its global batch is in and the all-reduce group has formed
        (called every ``step_check_s``; cheap when not). Waiting for the group and the all-reduce happen in
        hivemind's averager process, not here, so compute goes on meanwhile; only loading the gradients and the
        update hold the compute thread. Returns True if the parameters changed."""
        opt, tracker = self.opt, self.opt.tracker
        self.check_soon = False
        if self._pending is not None:
            # The step's all-reduce runs in hivemind's averager (bounded by averaging_timeout_s); the compute thread
            # serves meanwhile and takes the step once it is done.
            if not self._pending.done():
                if self._newer_group():
                    # The trainer closed again and named other replicas (a groupmate stopped answering it: killed or
                    # frozen): that group's all-reduce cannot complete; run the new one now rather than time out.
                    self._pending.cancel()
                elif time.perf_counter() - self._step_started[2] < self.config.averaging_timeout_s:
                    return False
                else:
                    # hivemind bounds a round it scheduled itself only when someone waits for its result
                    logger.warning(
                        "stage %d: the all-reduce of step %d did not end within %.0fs; abandoning it",
                        self.stage_index,
                        self.step,
                        self.config.averaging_timeout_s,
                    )
                    self._pending.cancel()
            if self._regroup():
                return False
            self._finish_step()
            self._catch_up()
            return True
        if self._holds_samples() and self.endpoint_in_doubt():
            # Thawed after a freeze, say, with the news of a lost relay still unread: a trainer may have found the
            # port refusing meanwhile and computed these samples again elsewhere. Stepping on them (or handing them
            # over) before the relaying loop tells would apply them twice; it tells within a keepalive, either way.
            if self._doubt_logged != self.step:
                self._doubt_logged = self.step
                logger.warning(
                    "stage %d: its endpoint may be gone (relay not heard for a while); step %d waits for word",
                    self.stage_index,
                    self.step,
                )
            self.check_soon = True
            return False
        tracker.batch_closed = self._closed_through >= self.step
        if self._closed_through >= self.step and self._closed_at[0] != self.step:
            self._closed_at = (self.step, time.perf_counter())
        if self.direct is not None:
            return self._maybe_step_direct()
        if (
            tracker.global_epoch <= self.step
            and tracker.global_progress.samples_accumulated == 0
            and self.local_samples == 0
        ):
            return False  # nothing to average (this replica's own samples count before the records show them)
        if (
            self.local_samples == 0
            and self._closed_through < self.step
            and tracker.global_epoch <= self.step
        ):
            # None of the batch is here and the trainer has not closed it here yet (a replica that just joined, or
            # got no microbatch of it): looking for a group now, it could take the place of a replica that holds
            # samples in a group sized by the trainer's count, which did not count it yet (bench/soak.py: a
            # newcomer averaged 0 samples with one peer while the third, holding 24, was left out). Its close comes
            # with its peers'; if their group forms first, it takes their state (below) and loses nothing.
            return False
        if not tracker.ready_to_update_epoch:
            if tracker.global_progress.num_peers > 1:
                hp.schedule_gradient_averaging(opt)
            return False
        control = opt.scheduled_grads
        _drop_before(self._replicas, self.step)
        replicas = self._replicas.get(self.step, 0)
        # Unknown for this batch yet: the progress records, unless the trainer last counted more replicas (records
        # read while the DHT is slow to answer can show none, and a replica stepping alone then drifts apart).
        alone = replicas == 1 or (
            replicas == 0 and tracker.global_progress.num_peers <= 1 and self._recent_count() <= 1
        )
        behind = tracker.global_epoch > self.step
        if not alone and not behind and (control is None or control.done()):
            # The batch filled before any group was scheduled. (Behind its peers, no group of its step will form:
            # a search started now would still run in hivemind's averager while this replica, having loaded their
            # state, looks for the next step's group, and could join that group in its place: its samples of the
            # next step then missed it too: tests/test_hand_over.py.)
            opt.scheduled_grads = control = opt.grad_averager.schedule_step(
                timeout=opt.averaging_timeout
            )
        live = control is not None and not control.done()
        forming = live and control.stage in (AveragingStage.IDLE, AveragingStage.LOOKING_FOR_GROUP)
        # since the batch closed, or since its all-reduce failed and this replica looked for a new group (_regroup)
        looking_since = max(
            self._closed_at[1], self._regrouped_at if self._regrouped == self.step else 0.0
        )
        # Matchmaking has its own deadline, but a groupmate frozen after it let this replica into its group holds it
        # far longer (minutes, until the groupmate thaws: tests/test_averaging.py's frozen replica). The batch is
        # closed: step without a group (and reload, see _finish_step) rather than stall the stage.
        looked_too_long = (
            self._closed_at[0] == self.step
            and time.perf_counter() - looking_since > self.config.averaging_timeout_s
        )
        if forming and (alone or looked_too_long):
            # alone: its last peer left; step alone rather than wait averaging_timeout_s for a group
            control.cancel()
            opt.scheduled_grads, live, forming = None, False, False
            if not alone:
                # Once per step, look again first: a leader can count this replica in a group it never heard of
                # (the leader's word lost on a loaded machine), and that group's all-reduce then fails for want of
                # its part. Its members look for a new group for the same step (_regroup); stepping alone here, this
                # replica would move the stage's step on past them and all of them would lose their samples
                # (bench/soak.py: the largest cause left once groups were sized right).
                again = self._regrouped != self.step
                logger.warning(
                    "stage %d: no all-reduce group for step %d within %.0fs; %s",
                    self.stage_index,
                    self.step,
                    self.config.averaging_timeout_s,
                    "looking for a new one" if again else "stepping without one",
                )
                if again:
                    self._regrouped, self._regrouped_at = self.step, time.perf_counter()
                    return False
        grouped = live and not forming
        if behind and not grouped:
            # A peer already stepped past this replica's step and this replica is in no group: groups only join
            # replicas at the same step, and that step's group could not complete without this replica's part, so
            # it ran without it (it joined mid-step, or its peers' group assembled before it looked for one).
            self._rejoin_peers()
            return True
        if forming:
            self._size_group(replicas)
            # Still looking for groupmates (hivemind assembles the group matchmaking_s after the first of them started
            # looking). Never wait for it on the compute thread: a group that forms without this replica steps
            # without it, and the check above then loads the peers' state (a missed group costs this replica's
            # samples of the batch, never a stalled stage or a replica out of step).
            # The batch is closed: its group is all the step waits for, so look again soon (see ``check_soon``).
            self.check_soon = self._closed_through >= self.step
            return False
        if alone and self.local_samples == 0 and tracker.global_progress.samples_accumulated:
            # Told to step alone, with none of the batch's samples, while another replica holds them: a replica that
            # just joined (or came back) after the trainer last counted the stage. Stepping here would move its
            # parameters on the optimizer's momentum and decay alone (a zero gradient): the same step as the replica
            # that stepped on the batch, other parameters. Wait: that replica steps, and the check above then
            # loads its state.
            return False
        self._begin_step(alone)
        if self._pending is not None:
            return False  # the all-reduce runs; a later check finishes the step
        self._catch_up()
        return True

    def _peers_ahead(self) -> int:
        """The furthest step this replica knows a peer of its stage holds: their progress records' (the tracker reads
        them every few seconds), or a trainer's close's, which is news of a moment ago."""
        return max(self.opt.tracker.global_epoch, self._peers_step)

    def _rejoin_peers(self, peers_at: int | None = None) -> None:
        """A peer stepped past this replica's step (to ``peers_at``; default: as its progress records say) without
        it: take their state now, in time for the next step's group. Its samples of that step are not lost: handed
        over into the next step, late (see _hand_over)."""
        if peers_at is None:
            peers_at = self.opt.tracker.global_epoch
        missed, held = self.step, self._held_sums()
        logger.warning(
            "stage %d replica is behind its peers (step %d < %d): loading their state (%d samples of its "
            "own left out of step %d)",
            self.stage_index,
            missed,
            peers_at,
            sum(held[1].values()) if held else 0,
            missed,
        )
        self._load_from_peers(peers_at)
        self._hand_over(held, missed)
        self._catch_up()

    def _maybe_step_direct(self) -> bool:
        """``maybe_step`` for replicas that average directly (swarm.averaging.direct): the group is the one the
        trainer's close names for this step, so there is no matchmaking to wait for. No group naming this replica
        (none sent, or the last one failed): its peers' step makes it load their state; the trainer's next close
        (it closes again while a stage is behind) names a new group; past ``averaging_timeout_s`` it steps on its
        own gradients and reloads."""
        _drop_before(self._groups, self.step)
        _drop_before(self._failed_groups, self.step)
        group = self._groups.get(self.step)
        if group is not None and (
            group.key in self._failed_groups.get(self.step, ())
            or self.direct.peer_id not in group.ids
        ):
            group = None  # a group that failed here already, or one without this replica
        # a group of one, or a close with a count of one and no group (a trainer of before): step alone
        alone = (
            len(group.members) == 1
            if group is not None
            else self._closed_through >= self.step and self._replicas.get(self.step) == 1
        )
        peers_at = self._peers_ahead()
        # Named alone although the same close found a replica of the stage past this step (its step is taken,
        # without this replica): stepping alone would give this replica a second, different step of the same number,
        # and the stage two models for the rest of the run (averaging later steps never brings them together; a
        # frozen replica thawed, took its peer's state one step behind, and its trainer, finding it alone at that
        # step, named it alone). It takes their state and hands its samples over instead, once per step: if no
        # donor is left to load from, it steps alone after all (its peers are gone, its state is the stage's).
        overtaken = alone and self._peers_step > self.step and self._rejoined != self.step
        if peers_at > self.step and (
            group is None or (alone and self.local_samples == 0) or overtaken
        ):
            # A peer stepped past this step, and this replica has no group of it to take part in, or nothing to
            # step on alone: take their state. (Named alone with nothing, it waited for nothing: a trainer closing
            # the step again while its peer waited in the next step's all-reduce named it alone each time; a soak's
            # replica sat there 30 s and its peer stepped without its gradients.)
            self._rejoined = self.step
            self._rejoin_peers(peers_at)
            return True
        if alone:
            if self.local_samples == 0:
                # nothing to step on (a step on a zero gradient still moves the parameters: momentum and decay); if
                # another replica holds the batch after all, it steps, and this one then loads its state (above)
                return False
            self._begin_step(alone=True)
            self._catch_up()
            return True
        if group is None:
            if self._closed_through < self.step:
                return False
            looking_since = max(
                self._closed_at[1], self._regrouped_at if self._regrouped == self.step else 0.0
            )
            if (
                time.perf_counter() - looking_since <= self.config.averaging_timeout_s
                or self.local_samples == 0
            ):
                return False
            logger.warning(
                "stage %d: no all-reduce group named this replica for step %d within %.0fs; stepping without one",
                self.stage_index,
                self.step,
                self.config.averaging_timeout_s,
            )
            self._begin_step(alone=False)
            self._catch_up()
            return True
        self._begin_direct(group)
        return False

    def _newer_group(self) -> bool:
        """Whether a trainer named another group naming this replica for the step whose direct all-reduce runs."""
        if self._direct_group is None:
            return False
        newer = self._groups.get(self.step)
        return (
            newer is not None
            and newer.key != self._direct_group.key
            and self.direct.peer_id in newer.ids
        )

    def _begin_direct(self, group: Group) -> None:
        """Hand this replica's gradient sums to the direct all-reduce with ``group`` (it runs on the event loop);
        a later check takes the step once it is done."""
        self._start_step(alone=False)
        sums = torch.cat(
            [
                acc.detach().reshape(-1).to("cpu", torch.float32)
                for acc in hp.gradient_accumulators(self.opt)
            ]
        )
        self._direct_group = group
        self._pending = self.direct.start(group, sums, self.local_samples)
        self._hold_s = time.perf_counter() - self._step_started[2]
        self._wake_when_done()

    def _holds_samples(self) -> bool:
        """Whether it holds gradients of samples for a step not yet taken (``leave_out_held`` would drop some)."""
        return bool(self.local_samples or self._late is not None or self._later.samples)

    def _held_sums(self) -> tuple[list[torch.Tensor], dict[int, int]] | None:
        """A copy of this replica's gradient sums and their samples by batch: its current step's, and any handed over
        from earlier batches (None if it holds none)."""
        samples = self.local_samples
        if samples == 0:
            return None
        by_batch = dict(self.opt.grad_averager.carried)
        own = samples - sum(by_batch.values())
        if own:
            by_batch[self.step] = by_batch.get(self.step, 0) + own
        return [acc.detach().clone() for acc in hp.gradient_accumulators(self.opt)], by_batch

    def _hand_over(
        self, held: tuple[list[torch.Tensor], dict[int, int]] | None, missed: int
    ) -> None:
        """After loading its peers' state past step ``missed``, whose all-reduce ran without this replica: add the
        gradient sums it held to the next step, so its samples reach the stage's parameters late instead of never
        (the issue's "late join": every sample the trainer committed is applied once), weighted by their samples and
        never counted as the next batch's progress. Only while the oldest of them is at most ``hand_over_steps``
        steps stale (a replica frozen for several steps comes back that far behind): staler gradients, or a load that
        did not arrive, and the samples stay out (logged, counted in ``samples_left_out``). A replica that misses
        again carries them again (bench/soak.py saw three in a row).

        Never applied twice: a trainer computes a replica's samples again elsewhere only once its port refuses
        connections (swarm.trainer.stagesteps), i.e. its process is gone with them; a frozen replica keeps its port
        and so its samples. A relayed replica's port is its relay's, which the relay closes once the replica has
        been silent for a while, so a frozen relayed replica can be taken for gone: when it finds its relay lost, it
        leaves out what it holds (``leave_out_held``)."""
        if held is None:
            return
        sums, by_batch = held
        averager, samples = self.opt.grad_averager, sum(by_batch.values())
        if self._partial_step == missed and self.step > missed:
            # Its all-reduce of that step returned part of the average only: the group ran with it, its part went
            # out to its groupmates' reductions, and they stepped on that all-reduce, so their step very likely
            # holds these samples (for some coordinates or all). Handed over, they would be applied twice there
            # (bench/soak.py: a replica partial in a 3-replica group whose two peers averaged 8 + 8 samples of a
            # 32-sample batch, its 16 in their average). Left out: at worst lost where its part did not arrive,
            # never applied twice.
            logger.warning(
                "stage %d: its all-reduce of step %d returned part of the average only before its peers stepped: "
                "their step very likely holds its %d samples; not handed over, so none is applied twice",
                self.stage_index,
                missed,
                samples,
            )
            return
        if self.step == missed:
            # Still at the step it missed (no donor answered in time): its sums are still that step's; keep them.
            own = by_batch.pop(missed, 0)
            averager.carry_in(sums, by_batch)
            averager.local_samples_accumulated += own
            self.opt.tracker.report_local_progress(self.step, own)
            return
        self._hand_late(sums, by_batch, missed)

    def _hand_late(self, sums: list[torch.Tensor], by_batch: dict[int, int], missed: int) -> None:
        """Add gradient sums of batches before the current step (``by_batch``: their samples) to this step, late, if
        the oldest is at most ``hand_over_steps`` stale; leave them out (logged, counted) otherwise."""
        averager, samples = self.opt.grad_averager, sum(by_batch.values())
        stale = self.step - min(by_batch, default=missed)
        if self.step <= missed or stale > self.hand_over_steps:
            self.samples_left_out += samples
            logger.warning(
                "stage %d: loaded step %d, %d past the step %d its %d samples were computed for (it hands over at "
                "most %d); leaving them out",
                self.stage_index,
                self.step,
                stale,
                min(by_batch, default=missed),
                samples,
                self.hand_over_steps,
            )
            return
        averager.carry_in(sums, by_batch)
        logger.info(
            "stage %d: %d samples of step %d handed over into step %d",
            self.stage_index,
            samples,
            missed,
            self.step,
        )

    def _expected_group(self) -> int:
        """The replicas this step's all-reduce group should hold: the trainer's count of the stage's replicas that
        answered it (``close_batch``; before this batch's close, its last count) or the replicas whose progress
        records stand at this step or the one before (a frozen one among them: the group waits for it up to
        ``group_wait_s``), whichever is higher. Under 2: not known."""
        # Whichever is higher: a group sized below the replicas that hold samples of the batch starts at once and
        # leaves one out (the trainer's records of a live replica expire between heartbeats on a loaded machine, and
        # a replica still finishing the last step reports this one a moment later). A count too high (a killed
        # replica's progress record outlives it by up to progress_ttl_s) costs at most group_wait_s.
        # A replica one step behind is counted too: it is still finishing the step before (or its record is a
        # heartbeat late) and joins in a moment; sized without it, the group of the others assembled at once and it
        # lost its samples of the batch (the largest cause of lost samples in bench/soak.py).
        tracker = self.opt.tracker
        at_step = (
            tracker.peers_at_epoch + tracker.peers_one_behind
            if tracker.global_epoch == self.step
            else 0
        )
        return max(at_step, self._replicas.get(self.step, 0) or self._recent_count())

    def _recent_count(self) -> int:
        """The trainer's last count of the stage's replicas while it is recent (0 after COUNT_MEMORY_STEPS steps
        without one): a groupmate killed where its address does not refuse (another host, a container) is never
        counted out by the trainer, and an old count of 2 would make this replica wait for it at every step; the
        progress records drop it once they expire."""
        if self.step - self._last_count_step > COUNT_MEMORY_STEPS:
            return 0
        return self._last_count

    def _size_group(self, replicas: int) -> None:
        """Tell the group forming for this step how many replicas to expect once the trainer counted them
        (``close_batch``; the group was scheduled with the count known then, see ``_expected_group``). The group
        assembles once they have all joined, not at the end of its wait: in lockstep training that wait was most
        of each step. Unknown or alone: the size it was scheduled with stands."""
        size = self._expected_group() if replicas >= 2 else 0
        if size >= 2 and self._group_sized != (self.step, size):
            self._group_sized = (self.step, size)
            self.opt.grad_averager.set_group_size(size)

    def _begin_step(self, alone: bool) -> None:
        """Start the stage's step: hand this replica's gradients to the group's all-reduce (hivemind's averager runs
        it in its process), or with no group, step at once on them."""
        self._start_step(alone)
        began = hp.begin_global_step(self.opt)
        self._hold_s = time.perf_counter() - self._step_started[2]
        self._pending = self.opt.scheduled_grads if began else None
        if self._pending is None:
            self._finish_step()
        else:
            self._wake_when_done()

    def _start_step(self, alone: bool) -> None:
        """What a step notes as it starts, for _finish_step and its log line, whichever all-reduce runs it."""
        self._step_started = (
            self.opt.opt.skipped_steps,
            self._partial.count.value,
            time.perf_counter(),
            alone,
        )
        # Alone, while the stage's records show samples of this batch beyond this replica's own: another replica
        # holds part of the batch and steps on it (the trainer's count missed it: it answered late or wrongly on a
        # loaded machine), or it left and the trainer computed its part again here. Either way this replica's step
        # may differ from a peer's: it reloads after the step (one that left is no donor, see _load_from_peers).
        tracker = self.opt.tracker
        self._beside_others = alone and (
            tracker.global_epoch == self.step
            and tracker.global_progress.samples_accumulated > self.opt.grad_averager.batch_samples
        )
        set_learning_rate(self.opt.opt, self.run, self.step)
        self.opt.used_local_gradients = False
        self._handed = self.local_samples
        self._handed_over = self.opt.grad_averager.carried

    def _wake_when_done(self) -> None:
        """Have the step check run as soon as the all-reduce under way ends."""
        if self.wake is not None:
            wake = self.wake
            self._pending.add_done_callback(lambda _: wake())

    def _regroup(self) -> bool:
        """The step's all-reduce ended without the whole average: it failed (a groupmate frozen or killed in it), or
        a groupmate's part never came (hivemind keeps this replica's own values there). Once per step, drop that
        result and look for a new group for the same step with the same gradients (they stay accumulated until the
        step): the groupmates left do the same and average their samples together, instead of each stepping on
        what it has, reloading, and losing its samples of the batch. True if it will look again."""
        pending, (_, partial, _, alone) = self._pending, self._step_started
        failed = _failed(pending)
        if self._direct_group is not None:
            if not failed:
                return False
            group, self._direct_group = self._direct_group, None
            self._failed_groups.setdefault(group.step, set()).add(group.key)
            self._retry = (group.step, max(group.round + 1, self.retry_round(group.step)))
            if self.direct.own_part_completed(group):
                # Every member's share of its part came in, so a groupmate may have had every part and stepped on
                # this group's average, its samples in it: should it end up loading the peers' state, it must not
                # hand them over too (see _hand_over). (Its own part incomplete, nobody could step on the group.)
                self._partial_step = self.step
            self._regrouped, self._regrouped_at = self.step, time.perf_counter()
            logger.warning(
                "stage %d: the all-reduce of step %d with %d replicas failed (%s); waiting for the trainer's next "
                "group",
                self.stage_index,
                self.step,
                len(group.members),
                "abandoned" if pending.cancelled() else pending.exception(),
            )
            self._pending = None
            return True
        if (
            alone
            or self._regrouped == self.step
            or not (failed or self._partial.count.value > partial)
        ):
            return False
        self._regrouped, self._regrouped_at = self.step, time.perf_counter()
        if not failed:
            self._partial_step = self.step
        logger.warning(
            "stage %d: the all-reduce of step %d %s; looking for a new group with the same %d samples",
            self.stage_index,
            self.step,
            "failed" if failed else "returned part of the average only",
            self._handed,
        )
        self._pending = self.opt.scheduled_grads = None
        hp.forget_averaged(self.opt)
        return True

    def _finish_step(self) -> None:
        """The all-reduce is done (or none began): load its result, step, count the step."""
        began = self._pending is not None
        before = self.step
        skipped, partial, _, alone = self._step_started
        t0 = time.perf_counter()
        # About to step on its own gradients beside other replicas (no group, or its all-reduce failed twice): it
        # reloads after the step, and a state it loads then never saw these samples; keep a copy to hand over.
        # (Not on an all-reduce that came back in part: its own values there hold some of its peers' gradients.)
        on_its_own = (not alone and (not began or _failed(self._pending))) or self._beside_others
        held = self._held_sums() if on_its_own else None
        averaged, group = None, self._direct_group
        if group is not None:  # (a failed one went to _regroup)
            averaged, self._direct_group = self._pending.result(), None
        self._pending = None
        hp.finish_global_step(self.opt, began and averaged is None, averaged)
        now, started = time.perf_counter(), self._step_started[2]
        closed = self._closed_at[1] if self._closed_at[0] == before else started
        if self._group_sized is not None:  # the next step's group waits for its own count
            self._group_sized = None
            self.opt.grad_averager.set_group_size(None)
        self.opt.tracker.batch_closed = False
        took = self._hold_s + time.perf_counter() - t0  # what the step held the compute thread
        self.step_pause_s = max(took, 0.8 * self.step_pause_s + 0.2 * took)
        opt_inner = self.opt.opt
        why = (
            "skipped its step"
            if opt_inner.skipped_steps > skipped
            else "stepped without its peers' gradients"
            if self.opt.used_local_gradients and not alone
            else "received part of the all-reduce only"
            if self._partial.count.value > partial
            else "stepped alone beside a replica holding samples"
            if self._beside_others
            else None
        )
        # One line per step (bench/soak.py sums the samples each stage averaged from these): how the step went,
        # the samples this replica put in, and the time from the batch's close to the group and to the update.
        logger.debug(
            "stage %d step %d: %s, %d samples in%s, group %.3fs after the batch closed, all-reduce %.3fs",
            self.stage_index,
            before,
            why or ("averaged" if began else "stepped alone"),
            self._handed,
            " (handed over: "
            + ", ".join(f"{n} of step {k}" for k, n in sorted(self._handed_over.items()))
            + ")"
            if self._handed_over
            else "",
            started - closed,
            now - started,
        )
        if why is None:
            self._note_makers(before, group, alone)
        # (Not gated on the progress records showing peers: they lag, and a replica that took part in a group had
        # peers whatever they show. One truly alone finds no donor and keeps its state, saying so.)
        if why:
            # This replica missed the stage's all-reduce and stepped on its own gradients, got only part of the
            # averaged gradient (a groupmate's part timed out: it used its own values there), or skipped the step
            # (a non-finite average): its parameters now differ from its peers'. Take theirs rather than carry (and
            # later average) a private state.
            logger.warning(
                "stage %d %s at step %d: reloading the stage's state from its peers",
                self.stage_index,
                why,
                before,
            )
            # (not after a skipped step: non-finite sums must not reach the next one)
            if opt_inner.skipped_steps > skipped:
                held = None
            own = [p.detach().clone() for p in self.params] if held is not None else None
            self._load_from_peers(self.step, doubtful=True)
            if own is not None:
                self._after_own_step(held, before, own)
        set_learning_rate(opt_inner, self.run, self.step)

    def _note_makers(self, step: int, group: Group | None, alone: bool) -> None:
        """Step ``step`` went as it should: note whose gradients it averaged (``group``'s members, or this replica's
        alone). Only a replica averaging directly knows them (hivemind's matchmaking does not say). A trainer that
        finds a replica of the stage gone reads these to learn whether that replica's gradients reached the stage's
        steps since, or left with it (swarm.trainer.stagesteps)."""
        if self.direct is None or (group is None and not alone):
            return
        makers = group.ids if group is not None else (self.direct.peer_id,)
        self.averaged_steps = (*self.averaged_steps[1 - AVERAGED_STEPS_KEPT :], (step, makers))

    def _after_own_step(
        self, held: tuple[list[torch.Tensor], dict[int, int]], stepped: int, own: list[torch.Tensor]
    ) -> None:
        """After stepping on its own gradients of step ``stepped`` and reloading: the samples it stepped on are in
        the stage's state if it kept its own (no donor; or the donor's state is this replica's, which a replica
        behind it loaded meanwhile: bench/soak.py), and nowhere if it loaded another replica's state: hand them over
        then, as a replica that missed its group does (_hand_over)."""
        if all(torch.equal(p, q) for p, q in zip(self.params, own)):
            logger.info(
                "stage %d kept the state it stepped into at step %d: its %d samples stay in",
                self.stage_index,
                stepped,
                sum(held[1].values()),
            )
            return
        self._hand_over(held, stepped)

    def sync_with_peers(self, peers_step: int = 0) -> bool:
        """Download parameters and optimizer state from the stage's peers if they are ahead of us (a
        newcomer, or a restarted peer whose checkpoint is older). ``peers_step`` is the highest step the
        stage's peers announce in the swarm's records: the tracker's first readings may predate them, so wait
        (up to ``load_state_timeout_s``) until it sees that step. Returns True if state was loaded; raises
        RuntimeError if the peers are ahead and their averaging is not visible (serving stale parameters would
        feed wrong gradients into the stage's average)."""
        tracker = self.opt.tracker
        deadline = time.monotonic() + self.config.load_state_timeout_s
        # The tracker reads the stage's progress from the DHT in the background: wait for its first reading.
        tracker.fetched_global_progress_this_epoch.wait(timeout=self.config.load_state_timeout_s)
        while tracker.global_epoch < peers_step and time.monotonic() < deadline:
            # (there is no event per read: ask for one and look again shortly)
            tracker.read_soon()
            time.sleep(0.2)
        if tracker.global_progress.num_peers == 0 or tracker.global_epoch <= self.step:
            if peers_step > self.step:
                raise RuntimeError(
                    f"stage {self.stage_index}'s peers announce step {peers_step} but their "
                    f"averaging state was not visible within {self.config.load_state_timeout_s:.0f}s; "
                    f"check that they run with --average and this peer can reach them, then restart"
                )
            return False
        self._load_from_peers(max(peers_step, tracker.global_epoch))
        return True

    def _load_from_peers(self, want_step: int, *, doubtful: bool = False) -> None:
        """Download parameters and optimizer state from the stage's most advanced peer until this replica holds a
        state of step ``want_step`` or later (retrying up to ``load_state_timeout_s``; still behind after that, the
        next step check tries again). ``doubtful``: this replica's own state of its step is known to be off (it
        ranks below its peers as a donor meanwhile).

        Like hivemind's ``Optimizer.load_state_from_peers`` but without its "catching up", which labels a state one
        step behind the stage with the stage's step although its parameters are the older step's (the replica would
        then carry that difference to the end of the run)."""
        opt, averager = self.opt, self.opt.state_averager
        control = opt.scheduled_grads
        if control is not None and not control.done():
            if control.stage in (AveragingStage.IDLE, AveragingStage.LOOKING_FOR_GROUP):
                control.cancel()  # no group counts on us yet (waiting for one could take averaging_timeout_s)
            else:
                # a group counts on us: take part with weight 0
                hp.tag_along_with_zero_weight(opt, control)
            opt.scheduled_grads = None
        if doubtful:
            averager.state_sharing_priority = self.step - 0.5
        deadline, alone, unreachable = time.monotonic() + self.config.load_state_timeout_s, False, 0
        while True:
            # Whether anyone is left to load from is the records' to say: read them now, not at their next reading
            # (a replica averaging directly reads them every DIRECT_PROGRESS_REFRESH_S).
            opt.tracker.read_fresh(timeout_s=FRESH_READ_TIMEOUT_S)
            # Every donor refused the connection at once, several times over: they are gone (a busy donor makes the
            # download wait, it does not fail it), though their records have not expired yet. A doubtful replica
            # holds a whole state of its own: it keeps it rather than hold its compute thread until they expire.
            if alone := self._alone() or (doubtful and unreachable >= UNREACHABLE_DONOR_TRIES):
                # The replicas it would load from left (killed, drained, moved): their progress records expired
                # (``--progress-ttl-s``). This replica is the stage's only one now; its own state is the stage's.
                logger.warning(
                    "stage %d: no other replica left to load the state of step %d from; continuing "
                    "with its own (step %d)",
                    self.stage_index,
                    want_step,
                    self.step,
                )
                break
            tried = time.monotonic()
            with opt.tracker.pause_updates():
                loaded = averager.load_state_from_peers(
                    timeout=max(1.0, deadline - time.monotonic())
                )
            unreachable = (
                unreachable + 1 if loaded is None and time.monotonic() - tried < 1.0 else 0
            )
            if (loaded is not None and loaded >= want_step) or time.monotonic() >= deadline:
                break
            # The peer we reached is at an older step (it steps next, or the one ahead is busy), or none answered
            # (two doubtful replicas asking each other at once, or the one it asked is gone): ask again after a
            # random pause, so one goes first; the tracker meanwhile sees who is still there.
            time.sleep(self.config.step_check_s * random.uniform(2, 8))
        self._announce_step()
        self._drop_accumulated()
        if self.step < want_step and not alone:
            logger.warning(
                "stage %d: downloaded the state of step %d, its peers are at step %d",
                self.stage_index,
                self.step,
                want_step,
            )

    def _drop_accumulated(self) -> None:
        """Forget the gradients accumulated for the current step, those carried into it included, and report no
        progress for it."""
        opt = self.opt
        with opt.tracker.pause_updates():
            opt.tracker.report_local_progress(self.step, samples_accumulated=0)
            opt.grad_averager.reset_accumulated_grads_()

    def _alone(self) -> bool:
        """No other replica of the stage is left to load a state from, as far as the stage's progress records say
        (a replica's record expires ``--progress-ttl-s`` after it stops reporting). This replica's own record may
        have expired too (it was frozen): one record and no step ahead of this replica's is alone. Not alone,
        whatever the records say, when the trainer last counted other live replicas of the stage (``close_batch``)
        for this step or the one before: on a loaded DHT the records lag, and a replica that stepped without its
        peers then kept its own state and ended the run apart from them (measured in bench/soak.py). If those
        replicas are gone after all, the download fails and the retries bound the wait."""
        tracker = self.opt.tracker
        counted = max((n for k, n in self._replicas.items() if k >= self.step - 1), default=0)
        if counted >= 2:
            return False
        peers = tracker.global_progress.num_peers
        return peers == 0 or (peers == 1 and tracker.global_epoch <= self.step)

    def grad_sums(self):
        by_param = {id(p): acc for p, acc in zip(self._order, hp.gradient_accumulators(self.opt))}
        return [by_param[id(p)].detach().clone() for p in self.params]

    def state_dict(self) -> dict:
        return {"optimizer": self.opt.state_dict(), "step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.opt.load_state_dict(state["optimizer"])
        self.opt.state_averager.local_epoch = saved_step(state)
        self.opt.tracker.report_local_progress(self.step, 0)
        self._announce_step()

    def _announce_step(self) -> None:
        """Peers downloading the stage's state prefer the replica with the highest priority: its step."""
        self.opt.state_averager.state_sharing_priority = self.step

    def shutdown(self) -> None:
        """Leave the stage's averaging (a drain, a move, the end). A group still forming for the next step counts on
        no one yet: leave it now; hivemind's shutdown would take part in it with weight 0 once it formed, holding a
        moving replica for up to ``averaging_timeout_s`` (a group that already formed is still served that way, so
        its members are not left waiting for this replica's part)."""
        control = self.opt.scheduled_grads
        if (
            control is not None
            and not control.done()
            and control.stage in (AveragingStage.IDLE, AveragingStage.LOOKING_FOR_GROUP)
        ):
            control.cancel()
            self.opt.scheduled_grads = None
        self.opt.shutdown()


def _drop_before(by_batch: dict, step: int) -> None:
    """Drop the entries of batches before ``step``, in place, from a snapshot of the keys: close_batch adds entries
    from another thread."""
    for k in list(by_batch):
        if k < step:
            by_batch.pop(k, None)


def _failed(pending) -> bool:
    """Whether a step's all-reduce ended without a result (cancelled or raised), as opposed to a full or partial one."""
    return pending.cancelled() or pending.exception() is not None
