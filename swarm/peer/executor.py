"""One stage replica's compute: forward, backward, gradient accumulation and optimizer steps.

Not thread-safe by design: the peer runs every call on one worker thread, so parameters are never read
by a backward while an optimizer step writes them. All methods validate before they touch state, so a bad
request leaves the accumulated gradients exactly as they were.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass

import torch

from swarm.config import RunConfig
from swarm.errors import GradientOutlier, InvalidRequest, NotCached
from swarm.model import Stage, state_digest
from swarm.model.device import CPU, Compute, GradScale
from swarm.optim import StageOptimizer
from swarm.outliers import OutlierBound
from swarm.peer.config import CacheConfig
from swarm.peer.ledger import UNKNOWN, CommitLedger
from swarm.peer.memory import resolve_graph_cache
from swarm.peer.versions import ParamVersions, Version

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DigestWork:
    """A stage's state at one optimizer step, to hash away from the compute thread (see
    :meth:`StageExecutor.digest_snapshot`)."""

    generation: int  # the executor's count of parameter changes when it was taken
    step: int
    state: dict[str, torch.Tensor]


@dataclass
class _Cached:
    inputs: torch.Tensor
    # (leaf input with requires_grad, output, the parameters it ran on) while the graph is kept; None once dropped
    graph: tuple[torch.Tensor, torch.Tensor, Version] | None
    # the optimizer step whose parameters the forward ran on (a backward recomputes on them too)
    params_step: int
    graph_bytes: int = (
        0  # bytes the graph holds (tensors saved for backward), counted while it is kept
    )


def _busy(method):
    """Count the wall time of an executor method in ``busy_s`` (errors included: the thread was taken)."""

    @functools.wraps(method)
    def timed(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return method(self, *args, **kwargs)
        finally:
            self.busy_s += time.perf_counter() - t0

    return timed


def _host_copy(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` on the host (checkpoints and the wire take host tensors)."""
    return t.detach().to("cpu", copy=True)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class StageExecutor:
    """Serves ``stage_module`` and steps it with ``optimizer``, which must hold that module's parameters
    (:class:`LocalStageOptimizer` for a replica that steps alone, the stage's hivemind optimizer with
    averaging)."""

    def __init__(
        self,
        stage_module: Stage,
        run: RunConfig,
        *,
        optimizer: StageOptimizer,
        cache: CacheConfig = CacheConfig(),
        slowdown: float = 1.0,
        compute: Compute = CPU,
    ):
        if not slowdown >= 1:
            raise ValueError(f"slowdown is a factor >= 1 (1 = normal speed), got {slowdown}")
        self.stage_module = stage_module
        # where the stage computes and in which dtype (its parameters must already be on that device); every
        # tensor in or out of the executor's methods is on the host in the wire's dtype
        self.compute = compute
        self._grad_scale = GradScale(compute.dtype == torch.float16)  # fp16 only
        # Fault injection: emulate a device this many times slower (see _timed_compute).
        self.slowdown = slowdown
        self.run = run
        # an unset graph budget is sized here as a peer sizes it (a peer passes it sized)
        self.cache_config = resolve_graph_cache(
            cache, run.model, stage_module.index, compute.device, compute_dtype=compute.dtype
        )
        self.optimizer = optimizer
        self.microbatches_applied = 0
        self.samples_applied = 0
        # Seconds of compute-thread time spent serving (forward, backward, commits, optimizer steps): with
        # samples_applied, the rate this replica delivers while busy, whatever its per-call costs.
        self.busy_s = 0.0
        self._cache: OrderedDict[str, _Cached] = OrderedDict()
        self._cache_bytes = 0
        self._graph_bytes = 0  # bytes of the graphs kept in _cache
        self._graph_bytes_per_token = 0.0  # measured on the last graph kept; 0 until then
        # the parameters of the current and recent optimizer steps that forwards run on (see swarm.peer.versions)
        self._versions = ParamVersions(stage_module, optimizer.step, keep=cache.kept_param_steps)
        # backwards that found their forward's graph, and those that computed the forward again (its graph was
        # dropped: the cache budget, a parameter version no longer held, or no forward here)
        self.backwards_from_graph = 0
        self.backwards_recomputed = 0
        # bytes one held gradient takes: a copy of every trainable parameter's gradient
        self._gradient_bytes = sum(_nbytes(p) for p in stage_module.parameters() if p.requires_grad)
        self._ledger = CommitLedger(cache)
        # per-sample norms of the last microbatches' parameter gradients (the outlier bound's reference)
        self._gradient_norms = OutlierBound(cache.max_gradient_ratio)
        # seconds per sample of forward and of backward, EMA; seeded by calibrate()
        self._fwd_s_per_sample = 0.0
        self._bwd_s_per_sample = 0.0
        # (step, digest of the parameters at that step), computed on demand and dropped whenever the parameters
        # change (a step, a state load); None until computed again
        self._digest: tuple[int, str] | None = None
        # counts the changes of the parameters, so a hash begun before a change is not recorded after it
        self._generation = 0

    @property
    def stage_index(self) -> int:
        return self.stage_module.index

    # ---------------------------------------------------------------- throughput

    @property
    def throughput(self) -> float:
        """Measured samples/s of forward + backward (0 until measured). On the last stage one call does
        both, and its time is all in ``_bwd_s_per_sample``."""
        per_sample = self._bwd_s_per_sample + (
            0.0 if self.stage_module.is_last else self._fwd_s_per_sample
        )
        return 1.0 / per_sample if per_sample > 0 else 0.0

    def predicted_s(self, samples: int, *, forward: bool, backward: bool) -> float:
        """Seconds of compute-thread time a call of ``samples`` is expected to take (0 until measured): a
        forward, a backward (``forward`` too when it recomputes from resent inputs), or on the last stage the
        loss call (``backward``: its time is all counted there)."""
        per_sample = (
            self._fwd_s_per_sample if forward and not self.stage_module.is_last else 0.0
        ) + (self._bwd_s_per_sample if backward else 0.0)
        return samples * per_sample

    def _observe(self, attr: str, seconds: float, samples: int, alpha: float = 0.1) -> None:
        value = seconds / max(samples, 1)
        old = getattr(self, attr)
        setattr(self, attr, value if old == 0 else (1 - alpha) * old + alpha * value)

    def calibrate(self, batch_size: int, repeats: int = 3) -> float:
        """Time forward + backward on synthetic input (grads discarded) to seed the throughput: the
        fastest of ``repeats`` runs after a warm-up, since a busy machine only ever adds time. With a
        ``slowdown``, the seed is what the emulated device will take (see :meth:`_emulated_s`)."""
        x = self.compute.to_device(self.stage_module.synthetic_input(batch_size))
        saved = [None if p.grad is None else p.grad.clone() for p in self.stage_module.parameters()]
        runs = []  # (wall, cpu) of the forward and of forward + backward
        for _ in range(1 + repeats):  # the first run includes one-off allocation costs
            t0, c0 = time.perf_counter(), time.thread_time()
            with torch.enable_grad(), self.compute.autocast():
                out = self.stage_module(x)
            self.compute.synchronize()
            t1, c1 = time.perf_counter(), time.thread_time()
            out.float().square().mean().backward()
            self.compute.synchronize()
            t2, c2 = time.perf_counter(), time.thread_time()
            runs.append(((t1 - t0, c1 - c0), (t2 - t0, c2 - c0)))
        for p, g in zip(self.stage_module.parameters(), saved):
            p.grad = g
        runs = runs[1:]
        fwd_s, total_s = (min(self._emulated_s(*run[i]) for run in runs) for i in (0, 1))
        self._fwd_s_per_sample = fwd_s / batch_size
        self._bwd_s_per_sample = (
            total_s if self.stage_module.is_last else max(total_s - fwd_s, 0.0)
        ) / batch_size
        return self.throughput

    def _emulated_s(self, wall_s: float, cpu_s: float) -> float:
        """How long a call whose compute took ``wall_s`` (``cpu_s`` of this thread's CPU time) holds the
        emulated device: ``wall_s`` plus the sleep of :meth:`_timed_compute`."""
        return wall_s + (self.slowdown - 1) * self._compute_s(wall_s, cpu_s)

    @staticmethod
    def _compute_s(wall_s: float, cpu_s: float) -> float:
        """A call's compute: this thread's CPU time when torch runs single-threaded (on this thread), else
        the wall time. CPU time leaves out what the machine's load adds (waiting for a core, or for the GIL
        while the event loop decodes the next request)."""
        return cpu_s if torch.get_num_threads() == 1 else wall_s

    @contextlib.contextmanager
    def _timed_compute(self, attr: str, samples: int):
        """Time the compute in the block into the ``attr`` EMA (seconds per sample). With ``slowdown`` f > 1,
        first hold the compute thread as a device f times slower would: sleep (f - 1) times the compute
        just done (see :meth:`_compute_s`). Counting CPU time keeps the emulated device's speed on a busy
        machine, where f would otherwise multiply every wait. The throughput the peer measures (sleep
        included) is the capacity it really has. A block that raises is neither slowed nor measured."""
        t0, cpu0 = time.perf_counter(), time.thread_time()
        yield
        self.compute.synchronize()
        if self.slowdown > 1:
            time.sleep(
                (self.slowdown - 1)
                * self._compute_s(time.perf_counter() - t0, time.thread_time() - cpu0)
            )
        self._observe(attr, time.perf_counter() - t0, samples)

    # ---------------------------------------------------------------- forward

    @_busy
    def forward(
        self, microbatch_id: str, x: torch.Tensor, *, keep: bool, params_step: int | None = None
    ) -> torch.Tensor:
        """Run the stage on the parameters of optimizer step ``params_step`` (None: the current step; see
        :meth:`version`). With ``keep``, hold what backward needs: the graph while ``graph_cache_bytes``
        allows (its size predicted from the last graph kept, then measured), else just the inputs (backward
        then recomputes on the same parameters)."""
        self._check_input(x)
        x = self.compute.to_device(x)
        version = self._versions.pick(params_step)
        tokens = x.shape[0] * x.shape[1]
        predicted = self._graph_bytes_per_token * tokens
        with self._timed_compute("_fwd_s_per_sample", x.shape[0]):
            if keep and self._graph_bytes + predicted <= self.cache_config.graph_cache_bytes:
                leaf = self._leaf(x)
                saved = [0]
                with (
                    torch.enable_grad(),
                    self.compute.autocast(),
                    self._count_saved(saved, version),
                ):
                    out = version.call(self.stage_module, "forward", leaf)
                self._graph_bytes_per_token = saved[0] / tokens
                if self._graph_bytes + saved[0] <= self.cache_config.graph_cache_bytes:
                    self._remember(
                        microbatch_id, _Cached(x, (leaf, out, version), version.step, saved[0])
                    )
                else:  # the prediction was short: keep only the inputs
                    self._remember(microbatch_id, _Cached(x, None, version.step))
                out = out.detach()
            else:
                with torch.no_grad(), self.compute.autocast():
                    out = version.call(self.stage_module, "forward", x)
                if keep:
                    self._remember(microbatch_id, _Cached(x, None, version.step))
        return self.compute.to_host(out)

    @_busy
    def eval_loss(
        self, x: torch.Tensor, targets: torch.Tensor, params_step: int | None = None
    ) -> float:
        self._check_input(x)
        self._check_targets(x, targets)
        x, targets = self.compute.to_device(x), self.compute.to_device(targets)
        version = self._versions.pick(params_step)
        with torch.no_grad(), self.compute.autocast():
            return float(version.call(self.stage_module, "loss", x, targets))

    # ---------------------------------------------------------------- backward

    @_busy
    def forward_loss_backward(
        self,
        microbatch_id: str,
        x: torch.Tensor,
        targets: torch.Tensor,
        num_samples: int,
        params_step: int | None = None,
    ) -> tuple[float, torch.Tensor | None]:
        """Last stage: loss and input gradient in one call, on the parameters of optimizer step ``params_step``
        (None: the current step). The parameter gradients are held until :meth:`commit` (or dropped by
        :meth:`abort`). Raises PeerOverloaded, before computing, when ``held_gradient_bytes`` of gradients
        already wait for their commit."""
        if (known := self._ledger.known_reply(microbatch_id)) is not UNKNOWN:
            return known
        self._ledger.check_room(microbatch_id, self._gradient_bytes + _nbytes(x))
        self._check_input(x)
        self._check_targets(x, targets)
        x, targets = self.compute.to_device(x), self.compute.to_device(targets)
        version = self._versions.pick(params_step)
        with self._timed_compute("_bwd_s_per_sample", x.shape[0]):
            leaf = self._leaf(x)
            with torch.enable_grad(), self.compute.autocast():
                loss = version.call(self.stage_module, "loss", leaf, targets)
            if not torch.isfinite(loss):
                raise InvalidRequest(
                    f"microbatch {microbatch_id}: the loss is {float(loss.detach())}; the inputs "
                    f"drove the model to a non-finite value, nothing was accumulated"
                )
            # Weight by samples: after dividing by the samples of the global batch at step time, the gradient
            # is that of the mean loss over the global batch, however it was cut into microbatches.
            grads, grad_input = self._gradients(loss * num_samples, None, leaf, version)
            self._check_gradient_size(microbatch_id, grads, num_samples)
            reply = (float(loss.detach()), grad_input)
            self._ledger.hold(microbatch_id, grads, reply, num_samples)
        return reply

    @_busy
    def backward(
        self,
        microbatch_id: str,
        grad_output: torch.Tensor,
        inputs: torch.Tensor | None,
        num_samples: int,
        params_step: int | None = None,
    ) -> torch.Tensor | None:
        """Compute this microbatch's gradients; return the gradient of the stage input (None on the first
        stage, whose input is token ids). The parameters are those its forward here ran on (its graph, or a
        recompute on them), else those of optimizer step ``params_step`` (None: the current step). Parameter
        gradients are held until :meth:`commit`. Raises
        NotCached if this peer holds neither the graph nor the inputs and none were sent, PeerOverloaded
        (before computing) when ``held_gradient_bytes`` of gradients already wait for their commit."""
        if (known := self._ledger.known_reply(microbatch_id)) is not UNKNOWN:
            return known
        self._ledger.check_room(microbatch_id, self._gradient_bytes + _nbytes(grad_output))
        cached = self._cache.get(microbatch_id)
        if cached is None and inputs is None:
            raise NotCached(
                f"microbatch {microbatch_id} is not cached here (evicted, or served by another "
                f"peer); resend it with its inputs"
            )
        if inputs is not None:
            self._check_input(inputs)
            inputs = self.compute.to_device(inputs)
        x = cached.inputs if cached is not None else inputs
        expected = (*x.shape[:2], self.stage_module.output_width)
        if tuple(grad_output.shape) != expected or grad_output.dtype != torch.float32:
            raise InvalidRequest(
                f"grad_output must be float32 of shape {list(expected)} for this microbatch, "
                f"got {grad_output.dtype} {list(grad_output.shape)}"
            )
        grad_output = self.compute.to_device(grad_output)
        with self._timed_compute("_bwd_s_per_sample", x.shape[0]):
            if cached is not None and cached.graph is not None:
                leaf, out, version = cached.graph
                self._drop_graph(
                    cached
                )  # autograd frees it below; a retry after a failure recomputes
                self.backwards_from_graph += 1
            else:  # recompute from the inputs, on the parameters the forward ran on (or the nearest still held)
                version = (
                    self._versions.resolve(cached.params_step)
                    if cached is not None
                    else self._versions.pick(params_step)
                )
                leaf = self._leaf(x)
                with torch.enable_grad(), self.compute.autocast():
                    out = version.call(self.stage_module, "forward", leaf)
                self.backwards_recomputed += 1
            grads, grad_input = self._gradients(out, grad_output, leaf, version)
            self._forget(microbatch_id)
            self._check_gradient_size(microbatch_id, grads, num_samples)
            self._ledger.hold(microbatch_id, grads, grad_input, num_samples)
        return grad_input

    def _check_gradient_size(self, microbatch_id: str, grads, num_samples: int) -> None:
        """Refuse (GradientOutlier, nothing held) a microbatch whose parameter gradient per sample is an outlier
        against this stage's recent ones (``max_gradient_ratio``, see swarm.outliers)."""
        if not self._gradient_norms.active:
            return
        norms = [torch.linalg.vector_norm(g, dtype=torch.float64) for g in grads if g is not None]
        norm = float(torch.stack(norms).norm()) if norms else 0.0
        if why := self._gradient_norms.excess(norm / max(num_samples, 1)):
            raise GradientOutlier(
                f"microbatch {microbatch_id}: its parameter gradient per sample {why}: refused, nothing was "
                f"accumulated (the gradient or the input it came with is corrupted)"
            )

    def _gradients(
        self,
        out: torch.Tensor,
        grad_output: torch.Tensor | None,
        leaf: torch.Tensor,
        version: Version,
    ):
        """Parameter gradients (with respect to ``version``'s parameters, which ``out`` was computed with; not yet
        applied, on the device, float32 like the parameters) and the input gradient (on the host, float32: the
        reply's). Loss-scaled with fp16 compute (see GradScale)."""
        params = version.trainable
        wrt = params + ([leaf] if leaf.requires_grad else [])
        try:
            grads = self._grad_scale.grad(out, wrt, grad_output)
        except FloatingPointError as e:
            raise InvalidRequest(
                f"stage {self.stage_index}: {e}; nothing was accumulated"
            ) from None
        grad_input = self.compute.to_host(grads[-1]) if leaf.requires_grad else None
        return list(grads[: len(params)]), grad_input

    # ---------------------------------------------------------------- two-phase apply

    @_busy
    def commit(self, microbatch_id: str, batch_step: int | None = None) -> bool:
        """The caller has the reply: add the held gradients to the accumulators, toward optimizer step
        ``batch_step`` (None: the current one). Idempotent: True if this call applied them, False if they were
        applied before. Raises GradientsDropped if none are held and none were applied (the hold expired, the
        call was aborted, or it never reached this peer): nothing counted, the caller computes it again."""
        held = self._ledger.take(microbatch_id)
        if held is None:
            return False
        self.microbatches_applied += 1
        self.samples_applied += held.num_samples
        if self.optimizer.accumulate(self._all_params(held.grads), held.num_samples, batch_step):
            self._after_step()
        return True

    def close_batch(
        self, batch_step: int, replicas: int = 0, group=None, *, stage_step: int = 0
    ) -> None:
        """A trainer has every microbatch of global batch ``batch_step`` committed; ``replicas`` of this stage
        answered it just now, ``group`` (a swarm.averaging.direct.Group, or None) names them, ``stage_step`` is the
        furthest step it found one at (see the optimizers)."""
        self.optimizer.close_batch(batch_step, replicas, group, stage_step=stage_step)

    def abort(
        self, microbatch_id: str, reason: str = "the call ended before its reply was sent"
    ) -> None:
        """The caller cannot commit (it retries elsewhere): drop the held gradients; a later commit of them is
        refused naming ``reason``."""
        self._ledger.drop(microbatch_id, reason)

    def release(self, microbatch_id: str) -> None:
        """Forget what a forward kept for backward (the backward ran, or will not come: a push chain failed)."""
        self._forget(microbatch_id)

    def drop_held(self, reason: str) -> int:
        """Drop every held gradient uncommitted (the replica leaves its stage): a late commit of one is refused
        naming ``reason``, so its caller computes it again elsewhere. How many were dropped."""
        return self._ledger.drop_all(reason)

    @property
    def awaiting_commit(self) -> int:
        """Held gradients whose commit may still come (their hold has not run out)."""
        return self._ledger.waiting()

    @property
    def held_gradients(self) -> int:
        """Computed gradients waiting for their commit."""
        return len(self._ledger)

    @property
    def held_gradient_bytes(self) -> int:
        """Bytes of the computed gradients waiting for their commit (bounded by ``held_gradient_bytes``)."""
        return self._ledger.held_bytes

    @property
    def state_bytes(self) -> int:
        """Bytes of one copy of the stage's parameters (what a snapshot takes)."""
        return sum(_nbytes(p) for p in self.stage_module.parameters())

    @property
    def gradient_bytes(self) -> int:
        """Bytes one held gradient of this stage takes (its reply's tensor aside)."""
        return self._gradient_bytes

    @property
    def graphs_kept(self) -> tuple[int, int]:
        """Autograd graphs kept for backward, and their bytes (bounded by ``graph_cache_bytes``)."""
        return sum(e.graph is not None for e in self._cache.values()), self._graph_bytes

    @property
    def param_steps(self) -> list[int]:
        """The optimizer steps whose parameters this replica holds for forwards (see swarm.peer.versions)."""
        return self._versions.steps

    @property
    def missed_param_steps(self) -> int:
        """Calls pinned to a step whose parameters this replica did not hold (they ran on the nearest held)."""
        return self._versions.missed

    @property
    def gradients_dropped(self) -> int:
        """Held gradients dropped uncommitted (aborted calls, holds that ran out) since the start."""
        return self._ledger.dropped_count

    # ---------------------------------------------------------------- optimizer

    @property
    def step(self) -> int:
        """Optimizer steps this replica has taken (its stage's step once in sync)."""
        return self.optimizer.step

    @property
    def samples_left_out(self) -> int:
        """Samples counted in ``samples_applied`` that reached no optimizer step of the stage (this replica missed
        their step's all-reduce and could not hand them over; see swarm.averaging.optimizer)."""
        return self.optimizer.samples_left_out

    @property
    def averaged_steps(self) -> tuple[tuple[int, tuple[str, ...]], ...]:
        """This replica's last steps whose makers it knows, each with the replicas whose gradients it averaged (see
        swarm.averaging.optimizer). Any thread."""
        return self.optimizer.averaged_steps

    @property
    def samples_accumulated(self) -> int:
        """Samples committed here since the last optimizer step."""
        return self.optimizer.local_samples

    @_busy
    def maybe_step(self) -> bool:
        """Take part in the stage's optimizer step if its global batch is full (called periodically, so a
        replica that receives no more commits still steps with its peers). True if parameters changed."""
        if self.optimizer.maybe_step():
            self._after_step()
            return True
        return False

    def _after_step(self) -> None:
        """The parameters changed (an optimizer step, a state load): copy them as the new step's version, and drop
        the graphs of versions no longer held (their backward recomputes on the nearest version held)."""
        self._digest = None
        self._generation += 1
        self._versions.changed(self.step)
        for entry in self._cache.values():
            if entry.graph is not None and entry.graph[2] is not self._versions.get(
                entry.params_step
            ):
                self._drop_graph(entry)

    def parameters_changed(self) -> None:
        """Tell the executor that something else wrote its parameters (the optimizer downloading its peers'
        state): its digest and kept graphs are stale."""
        self._after_step()

    def param_digest(self) -> str:
        """:func:`swarm.model.state_digest` of ``stage_module.state_dict()``; hashes only if the parameters
        changed since the last call (call it on the compute thread: it reads every parameter). A running peer
        hashes in another thread instead (:meth:`digest_snapshot`)."""
        work = self.digest_snapshot()
        if work is not None:
            self.record_digest(work, state_digest(work.state))
        assert self._digest is not None
        return self._digest[1]

    def digest_snapshot(self) -> DigestWork | None:
        """What to hash for the digest of the current parameters, so that another thread can hash it while this
        one computes (call on the compute thread; then :func:`swarm.model.state_digest` of ``.state`` anywhere, and
        :meth:`record_digest` here). None when the digest is known. The state holds the current version's copies
        of the parameters, which no optimizer step writes (so nothing is copied), and copies of the buffers.

        Hashing a stage of GPT-2 small on the compute thread was half of a GPU peer's busy time (bench/results/
        gpu_swarm.md): copying every parameter to the host and hashing it, after every optimizer step."""
        if self._digest is not None:
            return None
        current = self._versions.current
        copies = {}
        if current.step == self.step:  # else (never after _after_step) copy the live parameters
            copies = {
                id(p): current.params[f"stage.{name}"]
                for name, p in self.stage_module.named_parameters()
            }
        state = {
            name: copies[id(t)] if id(t) in copies else t.detach().clone()
            for name, t in self.stage_module.state_dict(keep_vars=True).items()
        }
        return DigestWork(self._generation, self.step, state)

    def record_digest(self, work: DigestWork, digest: str) -> None:
        """Keep ``digest``, the hash of ``work.state``, unless the parameters changed since the snapshot (then
        the next :meth:`digest_snapshot` hashes the new ones). Call on the compute thread."""
        if work.generation != self._generation:
            return
        self._digest = (work.step, digest)
        current = self._versions.current
        if current.step == work.step:  # the version forwards run on holds these very values
            current.digest = digest

    def step_and_digest(self, params_step: int | None = None) -> tuple[int, str]:
        """The optimizer step and the digest of the parameters at that step ("" if they changed since the last
        :meth:`param_digest`). Never hashes: callable from any thread (the heartbeat, Info), and the pair is
        consistent: a digest is never paired with a step it was not computed at. With ``params_step`` (on the
        compute thread only): the step and digest of the version a call pinned to that step ran on."""
        if params_step is not None:
            version = self._versions.resolve(params_step)
            return version.step, version.digest
        hashed, step = self._digest, self.step
        return step, (hashed[1] if hashed is not None and hashed[0] == step else "")

    def _all_params(self, grads: list) -> list:
        """Gradients of requires_grad parameters -> one entry per ``stage.parameters()`` (None = no grad)."""
        it = iter(grads)
        return [next(it) if p.requires_grad else None for p in self.stage_module.parameters()]

    def state_dict(self) -> dict:
        """Parameters and optimizer state (with its step), for checkpoints."""
        params = {k: _host_copy(v) for k, v in self.stage_module.state_dict().items()}
        return {
            "stage": self.stage_index,
            "params": params,
            "optimizer": self.optimizer.state_dict(),
            "step": self.step,
        }

    def load_state(self, state: dict) -> None:
        """Restore :meth:`state_dict` output. Raises ValueError if it belongs to another stage or config."""
        if state.get("stage") != self.stage_index:
            raise ValueError(
                f"the state is for stage {state.get('stage')}, this executor serves stage "
                f"{self.stage_index}"
            )
        try:
            self.stage_module.load_state_dict(state["params"], strict=True)
        except RuntimeError as e:
            raise ValueError(
                f"the state does not match stage {self.stage_index} of this run's model: {e}"
            ) from None
        self.optimizer.load_state_dict(state["optimizer"])
        self._after_step()

    # ---------------------------------------------------------------- helpers

    def _check_input(self, x: torch.Tensor) -> None:
        try:
            self.stage_module.check_input(x)
        except ValueError as e:
            raise InvalidRequest(f"stage {self.stage_index} input: {e}") from None

    def _check_targets(self, x: torch.Tensor, targets: torch.Tensor) -> None:
        if not self.stage_module.is_last:
            raise InvalidRequest(
                f"stage {self.stage_index} is not the last stage; it computes no loss"
            )
        try:
            self.stage_module.check_targets(x, targets)
        except ValueError as e:
            raise InvalidRequest(str(e)) from None

    @staticmethod
    def _leaf(x: torch.Tensor) -> torch.Tensor:
        return x.detach().requires_grad_() if x.is_floating_point() else x

    @contextlib.contextmanager
    def _count_saved(self, total: list[int], version: Version):
        """Add to ``total[0]`` the bytes of the tensors autograd saves for backward in the block, the parameters of
        ``version`` excepted (they live anyway): what keeping the graph costs."""
        param_ids = version.storage_ids

        def pack(t: torch.Tensor) -> torch.Tensor:
            if t.untyped_storage().data_ptr() not in param_ids:
                total[0] += _nbytes(t)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield

    def _drop_graph(self, entry: _Cached) -> None:
        if entry.graph is not None:
            entry.graph = None
            self._graph_bytes -= entry.graph_bytes

    def _remember(self, microbatch_id: str, entry: _Cached) -> None:
        self._forget(microbatch_id)
        self._cache[microbatch_id] = entry
        self._cache_bytes += _nbytes(entry.inputs)
        self._graph_bytes += entry.graph_bytes if entry.graph is not None else 0
        while self._cache_bytes > self.cache_config.input_cache_bytes and self._cache:
            self._forget(next(iter(self._cache)))

    def _forget(self, microbatch_id: str) -> None:
        entry = self._cache.pop(microbatch_id, None)
        if entry is not None:
            self._cache_bytes -= _nbytes(entry.inputs)
            self._drop_graph(entry)

    def snapshot(self, *, include_grads: bool) -> dict[str, torch.Tensor]:
        """Copies of the parameters ("param/<name>") and optionally of the accumulated gradients
        ("grad/<name>", sums over samples, not yet averaged), taken between two calls, so consistent."""
        out = {f"param/{n}": _host_copy(p) for n, p in self.stage_module.named_parameters()}
        if include_grads:
            for (n, _), g in zip(self.stage_module.named_parameters(), self.optimizer.grad_sums()):
                out[f"grad/{n}"] = g.cpu()
        return out

    @property
    def cached_microbatches(self) -> int:
        return len(self._cache)
