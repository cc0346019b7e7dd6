"""``swarm train``: reads data, keeps several microbatches in flight, reports loss and tokens/s.

A training "step" here is one global batch (``target_batch_size`` samples) sent through the swarm; the
peers of each stage step their optimizers when they have accumulated that many samples.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import math
import re
import sys
import time
import uuid
from dataclasses import dataclass

from hivemind.utils import get_dht_time

from swarm.config import RunConfig
from swarm.discovery.dht import RunDirectory, start_dht
from swarm.discovery.records import TrainerRecord
from swarm.discovery.watch import EXIT_DHT_LOST, DHTLost, DHTWatch
from swarm.trainer.config import TrainerConfig
from swarm.trainer.data import TrainerData
from swarm.trainer.metrics import TrainerMetrics
from swarm.trainer.pipeline import MicrobatchResult, Pipeline
from swarm.trainer.stagesteps import CLOSE_WAIT_FOR_STEP_S
from swarm.trainer.tensorboard import TensorBoardLog

logger = logging.getLogger(__name__)

# A trainer's record outlives this many missed heartbeats (and its last one this long after it exits).
TRAINER_TTL_HEARTBEATS = 5
# --max-batches-ahead when every stage averages: lockstep, what one process computes. 1 overlaps each batch's
# all-reduce with the next batch's compute, one step stale: 1.78x lockstep's tokens/s in one run, but 8.4% worse in
# validation loss on `tiny` after 30 batches (bench/results/convergence.md), too much to be the default.
DEFAULT_BATCHES_AHEAD = 0


@dataclass
class TrainSummary:
    steps: int
    samples: int
    microbatches: int  # completed (forward, backward and every stage's commit)
    microbatches_started: int
    failed_calls: int  # calls that failed and were retried at another peer
    # commits whose outcome stayed unknown, the peer unreachable past its hold (see swarm.trainer.commits)
    unconfirmed_commits: int
    initial_loss: float  # mean training loss over the first step
    final_loss: float  # mean training loss over the last 5 steps (one step is a noisy estimate)
    val_loss: float
    tokens_per_s: float
    seconds: float
    losses: list[float]  # mean training loss of each step

    def describe(self) -> str:
        return (
            f"trained {self.steps} steps ({self.samples} samples, {self.microbatches}/{self.microbatches_started}"
            f" microbatches completed) in "
            f"{self.seconds:.0f}s | initial loss {self.initial_loss:.3f} -> final loss "
            f"{self.final_loss:.3f} | validation loss {self.val_loss:.3f} | {self.tokens_per_s:,.0f} tokens/s"
            f" | {self.failed_calls} calls retried elsewhere, {self.unconfirmed_commits} unconfirmed commits"
        )

    @classmethod
    def parse(cls, text: str) -> TrainSummary:
        """The summary in ``text`` (a line :meth:`describe` wrote, or a whole log holding one; the last wins).
        Its fields at the precision printed (losses to 3 decimals, seconds and tokens/s whole); ``losses``
        is empty, the line does not carry it. ValueError if ``text`` holds no summary line."""
        matches = list(_SUMMARY_LINE.finditer(text))
        if not matches:
            raise ValueError(f"no trainer summary line in {text[-300:]!r}")
        found = matches[-1]
        ints = {name: int(found[name]) for name in _SUMMARY_INTS}
        floats = {name: float(found[name]) for name in _SUMMARY_FLOATS}
        return cls(
            **ints, **floats, tokens_per_s=float(found["tokens_per_s"].replace(",", "")), losses=[]
        )


# The parser of TrainSummary.describe's line: change both together (tests/test_trainer_summary.py checks
# the round trip). Losses may be "nan" (a run that trained no step).
_NUMBER = r"(?:[\d.]+|nan)"
_SUMMARY_LINE = re.compile(
    r"trained (?P<steps>\d+) steps \((?P<samples>\d+) samples, (?P<microbatches>\d+)/"
    r"(?P<microbatches_started>\d+) microbatches completed\) in (?P<seconds>\d+)s \| "
    rf"initial loss (?P<initial_loss>{_NUMBER}) -> final loss (?P<final_loss>{_NUMBER}) \| "
    rf"validation loss (?P<val_loss>{_NUMBER}) \| (?P<tokens_per_s>[\d,]+) tokens/s \| "
    r"(?P<failed_calls>\d+) calls retried elsewhere, (?P<unconfirmed_commits>\d+) unconfirmed commits"
)
_SUMMARY_INTS = (
    "steps",
    "samples",
    "microbatches",
    "microbatches_started",
    "failed_calls",
    "unconfirmed_commits",
)
_SUMMARY_FLOATS = ("initial_loss", "final_loss", "val_loss", "seconds")


class _Tally:
    """What the finished microbatches add up to: counts, and the loss of each global batch."""

    def __init__(self, per_step: int):
        self.per_step = per_step
        self.samples = self.microbatches = self.tokens = 0
        self.step_losses: list[float] = []  # mean training loss of each global batch
        self._buckets: dict[
            int, list[MicrobatchResult]
        ] = {}  # global batch -> its finished microbatches

    def add(self, index: int, result: MicrobatchResult) -> list[tuple[int, float]]:
        """Count finished microbatch ``index``; (step, mean loss) of the global batches that are now complete, in
        batch order (a microbatch of the next batch may finish before the last of this one), steps from 1."""
        self.samples += result.samples
        self.tokens += result.tokens
        self.microbatches += 1
        self._buckets.setdefault(index // self.per_step, []).append(result)
        losses = []
        while len(bucket := self._buckets.get(len(self.step_losses), [])) == self.per_step:
            del self._buckets[len(self.step_losses)]
            loss = sum(r.loss * r.samples for r in bucket) / sum(r.samples for r in bucket)
            self.step_losses.append(loss)
            losses.append((len(self.step_losses), loss))
        return losses


class Trainer:
    def __init__(
        self,
        config: TrainerConfig,
        pipeline: Pipeline,
        data: TrainerData,
        run: RunConfig,
        *,
        trainer_id: str,
    ):
        self.config = config
        self.pipeline = pipeline
        self.data = data
        self.run = run
        # its identity's peer id (it signs the trainer's records); microbatch ids add a per-start prefix, so a
        # restarted trainer's ids never meet its former ones at a peer (held or applied)
        self.trainer_id = trainer_id
        self._microbatch_prefix = f"{self.trainer_id[:8]}.{uuid.uuid4().hex[:6]}"
        self.metrics_port: int | None = None  # where its Prometheus metrics are served, if they are
        self.tensorboard: TensorBoardLog | None = None  # with --tensorboard-dir
        # set when the DHT node it started is lost (its process exited): it can no longer find peers (see open)
        self.dht_lost = asyncio.Event()
        self._next_microbatch = 0
        # microbatches per global batch
        self._per_step = math.ceil(run.target_batch_size / config.microbatch_size)
        # flow control (see _stages_caught_up): the flag, or by default lockstep when the stages average
        self._batches_ahead = config.max_batches_ahead
        # closes the stages again while calls sent ahead of their step wait for it (see _stages_caught_up)
        self._step_watch: asyncio.Task | None = None
        if self._batches_ahead is None:
            self._batches_ahead = DEFAULT_BATCHES_AHEAD if pipeline.steps.stages_average() else -1
        # Bounded ahead of averaging stages: each batch is pinned to the parameters of one step (see
        # _param_steps), and the trainer keeps what it takes to compute again the gradients of a replica that
        # leaves before its stage steps (see swarm.trainer.holdings).
        self._pinned = self._batches_ahead >= 0 and pipeline.steps.stages_average()
        if self._pinned and self._batches_ahead > 0 and config.pipeline.activations == "push":
            raise ValueError(
                "--activations push does not carry a pinned parameter step to the stages after the first yet, so "
                f"--max-batches-ahead {self._batches_ahead} would compute them on whatever step they hold; use "
                "--max-batches-ahead 0 (lockstep) or --activations relayed"
            )
        pipeline.holdings.enabled = self._pinned
        # what the metrics endpoint shows: the last step's and validation's numbers, and the counts
        self.latest: dict[str, float] = dict(
            step=0, loss=math.nan, val_loss=math.nan, tokens_per_s=0.0, microbatches=0, samples=0
        )

    @classmethod
    @contextlib.asynccontextmanager
    async def open(cls, config: TrainerConfig, *, dht=None):
        """Join the DHT (unless given one), read the run config, load data, connect to the stages."""
        async with contextlib.AsyncExitStack() as stack:
            if config.tensorboard_dir is not None:
                TensorBoardLog.require()
            dht_lost = asyncio.Event()
            # the task opening the trainer while it does: a lost node cancels it (every DHT call would wait forever)
            opening = [asyncio.current_task()]
            if dht is None:
                dht = await asyncio.to_thread(
                    start_dht, config.dht, host=config.host, client_mode=True
                )
                stack.callback(dht.shutdown)
                # its own node's process watched (a node given by the caller is the caller's to watch)
                watch = DHTWatch(dht, silent_s=math.inf, on_lost=_say_dht_lost(dht_lost, opening))
                watch.start()
                stack.callback(watch.stop)  # before the node's shutdown ends its process
            try:
                trainer = await cls._join(config, dht, stack)
            except asyncio.CancelledError:
                if dht_lost.is_set():
                    raise DHTLost(
                        f"the trainer could not start: {watch.lost}; start `swarm train` again (check the log "
                        "above for why the node ended)"
                    ) from None
                raise
            opening.clear()
            trainer.dht_lost = dht_lost
            if config.heartbeat_s > 0:
                heartbeat = asyncio.create_task(
                    trainer._announce_forever(), name="trainer-heartbeat"
                )

                async def stop_heartbeat() -> None:
                    heartbeat.cancel()
                    await asyncio.gather(heartbeat, return_exceptions=True)
                    if not dht_lost.is_set():  # (a lost node would never answer)
                        await trainer._announce()  # the final numbers, until the record expires

                stack.push_async_callback(stop_heartbeat)
            yield trainer

    @classmethod
    async def _join(cls, config: TrainerConfig, dht, stack: contextlib.AsyncExitStack) -> Trainer:
        """The part of ``open`` that reads the DHT: the run config, the data, the stages' peers; its metrics and
        logs."""
        logger.info(
            "trainer joined the DHT; reading run '%s' (up to %.0f s for it and its stages' peers)",
            config.run_id,
            config.peers_wait_s,
        )
        directory = RunDirectory(dht, config.run_id, run_owner=config.dht.run_owner)
        run = await directory.wait_for_run(timeout_s=config.peers_wait_s)
        identity = directory.identity
        trainer_id = identity.peer_id if identity is not None else uuid.uuid4().hex[:16]
        data = await asyncio.to_thread(TrainerData.open, config, run, trainer_id)
        pipeline = Pipeline(
            directory, run, config=config.pipeline, routing=config.routing, seed=data.seed
        )
        stack.push_async_callback(pipeline.close)
        await pipeline.start()
        await pipeline.wait_for_peers(timeout_s=config.peers_wait_s)
        trainer = cls(config, pipeline, data, run, trainer_id=trainer_id)
        if config.tensorboard_dir is not None:
            trainer.tensorboard = TensorBoardLog(
                config.tensorboard_dir, run_id=config.run_id, trainer_id=trainer.trainer_id
            )
            stack.callback(trainer.tensorboard.close)
            logger.info(
                "trainer %s writes TensorBoard scalars to %s",
                trainer.trainer_id,
                trainer.tensorboard.path,
            )
        if config.metrics_port is not None:
            metrics = TrainerMetrics(trainer)
            trainer.metrics_port = metrics.serve(config.host, config.metrics_port)
            stack.callback(metrics.close)
            logger.info(
                "trainer %s serves Prometheus metrics at http://%s:%d/metrics",
                trainer.trainer_id,
                config.host,
                trainer.metrics_port,
            )
        return trainer

    # ------------------------------------------------------------------ training

    async def train(self) -> TrainSummary:
        """Stream microbatches through the swarm, ``in_flight`` at a time, with no pause between steps; then
        validate the model the stages hold after the last batch."""
        cfg = self.config
        total = cfg.steps * self._per_step if cfg.steps else math.inf
        tally = _Tally(self._per_step)
        # Microbatch i belongs to global batch i // per_step: tell each stage which of its optimizer steps
        # that is, counting from the step it has reached now (so a restarted trainer continues the count).
        await self.pipeline.steps.poll()
        first_steps = self.pipeline.steps.stage_steps()
        solo = self.pipeline.steps.solo_replicas()
        if self._batches_ahead >= 0 and solo:
            logger.warning(
                "--max-batches-ahead %d counts global batches, but stage(s) %s are served by several replicas "
                "that do not average (%s): each steps alone on its own %d samples, so their steps lag the "
                "batches and the trainer will wait up to --stage-step-wait-s (%.0f s) at each. Run those peers "
                "with averaging (the default, drop --no-average) or leave --max-batches-ahead unset.",
                self._batches_ahead,
                sorted(solo),
                ", ".join(f"stage {k}: {n}" for k, n in sorted(solo.items())),
                self.run.target_batch_size,
                cfg.stage_step_wait_s,
            )
        launched = 0
        started = self._last_log = time.monotonic()
        self._last_val_loss = float("nan")  # shown on progress lines until the next validation
        pending: dict[asyncio.Task, int] = {}  # microbatch task -> its index
        batches = _BatchCloser(self.pipeline, self._per_step, first_steps)
        try:
            while launched < total or pending:
                while len(pending) < cfg.in_flight and launched < total:
                    if not await self._stages_caught_up(
                        launched, first_steps, waiting_on_replies=bool(pending)
                    ):
                        break
                    task = asyncio.create_task(
                        self._train_microbatch(launched, first_steps, batches)
                    )
                    pending[task] = launched
                    launched += 1
                done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    # A microbatch that exhausted its retries ends training here (task.result() raises).
                    index = pending.pop(task)
                    step_losses = tally.add(index, task.result())
                    batches.completed(index)
                    self.latest.update(microbatches=tally.microbatches, samples=tally.samples)
                    for step, step_loss in step_losses:
                        await self._after_step(tally, step, step_loss, started)
        finally:
            for task in pending:
                task.cancel()
            watch = [self._step_watch] if self._step_watch is not None else []
            for task in watch:
                task.cancel()
            await asyncio.gather(*pending, *watch, return_exceptions=True)
            await batches.close()
            await asyncio.to_thread(
                self.data.save
            )  # microbatches drawn but lost are not read again
        return await self._finish(tally, launched, first_steps, started)

    async def _stages_caught_up(
        self, launched: int, first_steps: list[int], *, waiting_on_replies: bool
    ) -> bool:
        """Flow control before microbatch ``launched``: the stages step a little after each batch (the
        all-reduce); never run more than ``max_batches_ahead`` (default: 0 when they average) batches ahead of
        them, or microbatches would use ever staler parameters and the replicas would hold ever more batches
        aside. False: wait for the replies in flight first (they carry the stages' steps); True: go ahead (after
        waiting here if nothing is in flight, up to ``stage_step_wait_s`` without progress)."""
        ahead = self._batches_ahead
        applied = launched // self._per_step - ahead
        if ahead < 0 or applied <= 0:
            return True
        targets = [first + applied for first in first_steps]
        # Pinned batches wait for every live replica: one that has not taken the step yet does not hold the
        # parameters the batch is pinned to (the first replica done with it is not enough).
        every = self._pinned
        stage_steps = self.pipeline.steps
        steps = stage_steps.stage_steps(every_replica=every)
        if all(now >= target for now, target in zip(steps, targets)):
            return True

        def stepping() -> bool:
            """Each stage misses one step at most, on the batch whose close found every replica answering and
            named them all in its group: they are averaging it. Send on: a call pinned to a step its replica has
            not taken waits there for it (StageService), and starts the moment the step is done instead of a round
            trip after this trainer hears of it. (A close that found a replica silent or gone, or behind: wait
            for the step here, as calls sent now could only wait it out or fail.)"""
            return every and all(
                stage_steps.closed_soundly(k, target - 1)
                for k, target in enumerate(targets)
                if steps[k] < target
            )

        if stepping():
            # Someone must still close the stages again while they are behind (a replica killed in the all-reduce
            # leaves its groupmates waiting for a new group): a watch in the background, as the wait below does.
            if self._step_watch is None or self._step_watch.done():
                self._step_watch = asyncio.create_task(
                    stage_steps.wait_for_stage_steps(
                        targets, stall_s=self.config.stage_step_wait_s, every_replica=every
                    ),
                    name="stage-step-watch",
                )
            return True
        if waiting_on_replies:
            return False
        await stage_steps.wait_for_stage_steps(
            targets, stall_s=self.config.stage_step_wait_s, every_replica=every, ready=stepping
        )
        return True

    def _train_microbatch(self, index: int, first_steps: list[int], batches: _BatchCloser):
        """The coroutine of microbatch ``index``: fresh training samples, tagged with each stage's step; each
        stage's part of it counts toward closing that stage's batch as soon as it is committed."""
        cfg = self.config
        tokens = self.data.feed.next_batch(cfg.microbatch_size, self.run.model.seq_len)
        batch = index // self._per_step
        batch_steps = [first + batch for first in first_steps]
        return self.pipeline.train_microbatch(
            self._microbatch_id(),
            tokens,
            batch_steps,
            self._param_steps(batch, first_steps),
            on_settled=functools.partial(batches.settled, index),
        )

    def _param_steps(self, batch: int, first_steps: list[int]) -> list[int] | None:
        """The optimizer step of each stage whose parameters this trainer's global batch ``batch`` computes on:
        the step on batch ``batch - max_batches_ahead - 1`` (0: the step just before it, lockstep), and for the
        first batches the stages' step when the trainer started. The schedule fixes it, not the moment a call
        reaches a replica, so the run trains what ``swarm.trainer.reference`` trains with the same delay. None:
        not pinned (stages that do not average; no limit ahead)."""
        if not self._pinned:
            return None
        return [first + max(batch - self._batches_ahead, 0) for first in first_steps]

    async def _after_step(self, tally: _Tally, step: int, step_loss: float, started: float) -> None:
        """Report finished global batch ``step``; validate every ``eval_every_steps`` (but the last, see _finish)."""
        cfg = self.config
        elapsed = time.monotonic() - started
        tokens_per_s = tally.tokens / elapsed
        self._metric(
            {"step": step, "loss": step_loss, "tokens_per_s": tokens_per_s, "time_s": elapsed}
        )
        await asyncio.to_thread(self.data.save)
        if cfg.eval_every_steps and step % cfg.eval_every_steps == 0 and step != cfg.steps:
            val_loss = await self.validate()
            self._metric({"step": step, "val_loss": val_loss, "time_s": time.monotonic() - started})
            self._progress(step, step_loss, tokens_per_s, val_loss, elapsed, final=True)
            self._last_val_loss = val_loss
        elif time.monotonic() - self._last_log >= cfg.log_every_s:
            self._progress(step, step_loss, tokens_per_s, self._last_val_loss, elapsed)
            self._last_log = time.monotonic()

    async def _finish(
        self, tally: _Tally, launched: int, first_steps: list[int], started: float
    ) -> TrainSummary:
        """Validate the model that has learned from every batch sent, and sum the run up."""
        cfg = self.config
        elapsed = time.monotonic() - started
        # Averaging stages step a little after the trainer sends a batch's last microbatch (the all-reduce).
        if self._batches_ahead >= 0:  # the stages count global batches (averaging peers)
            batches = math.ceil(launched / self._per_step)
            await self.pipeline.steps.wait_for_stage_steps(
                [first + batches for first in first_steps],
                stall_s=cfg.stage_step_wait_s,
                every_replica=True,
            )
        val_loss = await self.validate()
        if self.pipeline.holdings.redone:
            logger.info(
                "%d gradient(s) computed again: the replicas that counted them left before their stage stepped",
                self.pipeline.holdings.redone,
            )
        await self.pipeline.spot_checks.settle()
        spot = self.pipeline.spot_checks.counts
        logger.info(
            "spot-checks: %d compared (%d agreed, %d mismatched), %d inconclusive; banned for the run: %s",
            spot.checked,
            spot.agreed,
            spot.mismatched,
            spot.inconclusive,
            ", ".join(sorted(self.pipeline.banned_for_run)) or "none",
        )
        losses = tally.step_losses
        self._metric(
            {"step": len(losses), "val_loss": val_loss, "time_s": time.monotonic() - started}
        )
        if losses:
            self._progress(
                len(losses), losses[-1], tally.tokens / elapsed, val_loss, elapsed, final=True
            )
        return TrainSummary(
            steps=len(losses),
            samples=tally.samples,
            microbatches=tally.microbatches,
            microbatches_started=launched,
            failed_calls=self.pipeline.failed_calls,
            unconfirmed_commits=self.pipeline.unconfirmed_commits,
            initial_loss=losses[0] if losses else float("nan"),
            final_loss=sum(losses[-5:]) / len(losses[-5:]) if losses else float("nan"),
            val_loss=val_loss,
            tokens_per_s=tally.tokens / max(elapsed, 1e-9),
            seconds=elapsed,
            losses=losses,
        )

    async def validate(self) -> float:
        """Mean validation loss over the fixed validation batches (the same on every machine)."""
        batches = self.data.feed.val_batches(
            self.config.microbatch_size, self.run.model.seq_len, self.config.eval_batches
        )
        sem = asyncio.Semaphore(self.config.in_flight)

        async def one(tokens):
            async with sem:
                return await self.pipeline.eval_microbatch(tokens)

        losses = await _gather_or_cancel([one(b) for b in batches])
        return sum(losses) / len(losses)

    def _microbatch_id(self) -> str:
        self._next_microbatch += 1
        return f"{self._microbatch_prefix}-{self._next_microbatch}"

    async def _announce(self) -> None:
        """Publish this trainer's progress (``latest``) in the DHT for a few heartbeats."""
        latest = self.latest
        record = TrainerRecord(
            trainer_id=self.trainer_id,
            step=int(latest["step"]),
            loss=latest["loss"] if math.isfinite(latest["loss"]) else None,
            val_loss=latest["val_loss"] if math.isfinite(latest["val_loss"]) else None,
            tokens_per_s=float(latest["tokens_per_s"]),
            microbatches=int(latest["microbatches"]),
            announced_s=get_dht_time(),
        )
        try:
            await self.pipeline.directory.announce_trainer(
                record, ttl_s=TRAINER_TTL_HEARTBEATS * self.config.heartbeat_s
            )
        except Exception as e:  # the DHT may be briefly unreachable: training goes on
            logger.warning("announcing the trainer's progress failed: %s", e)

    async def _announce_forever(self) -> None:
        while True:
            await self._announce()
            await asyncio.sleep(self.config.heartbeat_s)  # the announcement period

    def _metric(self, record: dict) -> None:
        self.latest.update((k, v) for k, v in record.items() if k in self.latest)
        if self.tensorboard is not None:
            pipeline = self.pipeline
            self.tensorboard.record(
                record,
                {
                    "calls_retried": pipeline.failed_calls,
                    "unconfirmed_commits": pipeline.unconfirmed_commits,
                    "peers_banned_for_bad_replies": len(pipeline.banned_for_run),
                    "spot_checks_agreed": pipeline.spot_checks.counts.agreed,
                    "spot_checks_mismatched": pipeline.spot_checks.counts.mismatched,
                },
            )
        if self.config.metrics_path:
            with open(self.config.metrics_path, "a") as f:
                f.write(json.dumps({**record, "wall_time": time.time()}) + "\n")

    def _progress(
        self,
        step: int,
        loss: float,
        tokens_per_s: float,
        val_loss: float,
        elapsed_s: float,
        *,
        final=False,
    ) -> None:
        """A progress line: rewritten in place with a bar and the time left on a terminal, one plain line
        per report otherwise (logs, pipes: what scripts and tests read)."""
        tty = sys.stdout.isatty()
        line = progress_line(
            step, self.config.steps, loss, val_loss, tokens_per_s, elapsed_s, bar=tty
        )
        if tty and not final:
            print("\r" + line, end="", flush=True)
        else:
            print(("\r" if tty else "") + line, flush=True)


def progress_line(
    step: int,
    total: int,
    loss: float,
    val_loss: float,
    tokens_per_s: float,
    elapsed_s: float,
    *,
    bar: bool = False,
    width: int = 20,
) -> str:
    """``step 12/100 | loss 3.100 | val 3.200 | 14,000 tok/s``; with ``bar`` (a terminal) and a known
    ``total``, a bar of ``width`` cells after the step and the time left at the current pace at the end."""
    count = f"step {step}/{total}" if total else f"step {step}"
    val = f" | val {val_loss:.3f}" if math.isfinite(val_loss) else ""
    line = f"{count} | loss {loss:.3f}{val} | {tokens_per_s:,.0f} tok/s"
    if not (bar and total):
        return line
    done = min(step / total, 1.0)
    cells = round(done * width)
    left_s = elapsed_s / step * (total - step) if step else math.inf
    return f"{count} [{'#' * cells}{'.' * (width - cells)}]{line[len(count) :]} | {_duration(left_s)} left"


def _duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    seconds = round(seconds)
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return (
        f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"
    )


class _BatchCloser:
    """Closes each global batch at each stage once all its microbatches are in at that stage (their gradients
    committed there): see :meth:`StageSteps.close_batch`. A later stage closes first, while the earlier ones still
    compute their part of the batch's last microbatches: its all-reduce and step are then off the path to the next
    batch, which waits for every stage. Batches close in the background, in any order."""

    def __init__(self, pipeline: Pipeline, per_step: int, first_steps: list[int]):
        self.pipeline, self.per_step, self.first_steps = pipeline, per_step, first_steps
        # microbatch in flight -> the stages it was counted at so far
        self._early: dict[int, set[int]] = {}
        # (global batch, stage) -> microbatches of it in there
        self._done: dict[tuple[int, int], int] = {}
        self._tasks: set[asyncio.Task] = set()

    def settled(self, index: int, stage: int) -> None:
        """Microbatch ``index``'s gradient is committed at ``stage`` (it is still in flight)."""
        stages = self._early.setdefault(index, set())
        if stage not in stages:
            stages.add(stage)
            self._count(index, stage)

    def completed(self, index: int) -> None:
        """Microbatch ``index`` is done at every stage (a stage it skipped, its gradient refused there, counts as
        done: the batch is closed without it)."""
        early = self._early.pop(index, set())
        for stage in range(len(self.first_steps)):
            if stage not in early:
                self._count(index, stage)

    def _count(self, index: int, stage: int) -> None:
        batch = index // self.per_step
        done = self._done[batch, stage] = self._done.get((batch, stage), 0) + 1
        if done < self.per_step:
            return
        del self._done[batch, stage]
        steps: list[int | None] = [None] * len(self.first_steps)
        steps[stage] = self.first_steps[stage] + batch
        task = asyncio.create_task(
            self.pipeline.steps.close_batch(steps, wait_for_step_s=CLOSE_WAIT_FOR_STEP_S),
            name=f"close-{batch}-stage-{stage}",
        )
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        """Let the closes sent finish (each is bounded by its deadline)."""
        await asyncio.gather(*self._tasks, return_exceptions=True)


async def _gather_or_cancel(coros):
    """Like ``asyncio.gather`` but cancels the rest when one fails (Python 3.10 has no TaskGroup)."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


def _say_dht_lost(lost: asyncio.Event, opening: list[asyncio.Task]):
    def on_lost(reason: str) -> None:
        logger.error(
            "the trainer lost its DHT node: %s. It can no longer find the stages' peers: it stops (`swarm train` "
            "exits with code %d); start it again to continue from the stages' step",
            reason,
            EXIT_DHT_LOST,
        )
        lost.set()
        for task in opening:  # still starting
            task.cancel()

    return on_lost
