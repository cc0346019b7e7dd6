"""Discrete-event simulation of a swarm: peers, trainers, routing, churn and rebalancing.

A single ``heapq`` event loop over simulated seconds; no clocks, threads or I/O. It drives the
trainer's real policies: :class:`~swarm.routing.Router` picks every peer (one router per trainer)
and :func:`~swarm.balance.plan_moves` / :func:`~swarm.balance.claim_winners` move peers.

Model:

* A peer serves one stage at a time, one request after another (FIFO). Base speed ``v`` samples/s
  (forward + backward) becomes ``v / cost[s]`` on stage ``s``. A forward of ``m`` samples takes
  ``(1 - backward_share) * m / speed``, a backward ``backward_share * m / speed``; the last stage
  does forward, loss and backward in one request, and a backward whose forward peer is gone is
  sent to another peer with the inputs and costs a full forward + backward (recompute).
* A trainer keeps ``microbatches_in_flight`` microbatches going; each visits stages 0..S-1 forward
  and S-2..0 backward. Every request goes through the trainer's retry rule
  (:class:`~swarm.routing.StageRequest`): deadline from ``Router.deadline_s``, a failure bans the
  peer (or, for a peer that moved, just moves on) and tries another, no peer -> wait for the first
  ban end or ``retry_wait_s``. Where the trainer would give up (budget spent), the simulator waits
  ``retry_wait_s`` and starts a fresh budget: a microbatch is never dropped. Requests are sized for the
  router in forward passes, as the trainer sizes its calls (:mod:`swarm.routing.work`), so a backward's
  deadline fits a backward; a backward goes to its forward's peer while that peer serves or drains.
* A reply reports the peer's compute time for the request (as the daemon's ``ReplyMeta.compute_s``), which
  the router weighs peers by; the round trip (queue and links included) sets its deadlines.
* Trainers learn the serving peers every ``discovery_period_s``; until then they may pick a peer
  that died (the request fails after one round trip) or stopped serving.
* A peer that dies fails its unfinished requests after one round trip (connection reset).
* Links (``config.links.model_links``, :mod:`swarm.sim.links`): every request and reply crosses the
  trainer's and the peer's links (and a relay's), sized by the codec; else a flat ``latency_s`` each way.
* A moving peer announces "draining" on its old stage and "starting" on the new one, keeps
  serving until ``drain_s`` has passed and its queue is empty, then spends ``load_s`` starting.
"""

from __future__ import annotations

import heapq
import random

from swarm.balance import (
    PeerRecord,
    SwarmView,
    arrival_delay_s,
    choose_stage_on_arrival,
    claim_winners,
    plan_moves,
)
from swarm.errors import DeadlineUnmet, WrongPeer
from swarm.routing import NoPeersAvailable, RetriesExhausted, Router, StageRequest, wake_at
from swarm.routing.shedding import shed_reason
from swarm.routing.work import BACKWARD_COST, FORWARD_COST, STEP_COST
from swarm.sim.config import SimConfig
from swarm.sim.entities import (
    ARRIVE,
    DEAD,
    DEATH,
    DISCOVER,
    DONE,
    DRAINING,
    FAIL,
    JOIN,
    LEAVE,
    PREEMPT,
    READY,
    REBALANCE,
    REPLY,
    RETRY,
    SAMPLE,
    SERVING,
    STARTING,
    SimMicrobatch,
    SimPeer,
    SimRequest,
)
from swarm.sim.links import Link, draw_peer_link, hop_bytes, transfer
from swarm.sim.result import Move, SimResult

__all__ = ["simulate"]

# One instance for every refusal: the simulator never reads its message, and refusals can number millions.
_SHED = DeadlineUnmet("the peer's queue would finish this request after its deadline")


def simulate(config: SimConfig) -> SimResult:
    """Run ``config`` to ``config.duration_s`` simulated seconds and report (deterministic per seed)."""
    return _Simulation(config).run()


class _Simulation:
    def __init__(self, config: SimConfig) -> None:
        self.cfg = config
        self.rng = random.Random(config.seed)
        self.route_rng = random.Random(config.seed + 1)
        self.link_rng = random.Random(
            config.seed + 2
        )  # apart, so links leave the other draws as they were
        self.now = 0.0
        self.heap: list[tuple] = []
        self.seq = 0
        self.peers: dict[str, SimPeer] = {}
        self.next_pid = 0
        self.costs = [config.stage_cost(s) for s in range(config.num_stages)]
        self.routers = [Router(config.routing) for _ in range(config.num_trainers)]
        links = config.links
        # Links (when modelled): one per trainer, per relay node, per peer (drawn when it is added).
        self.trainer_links = [
            Link(links.trainer_mbit_s, links.trainer_latency_s) for _ in range(config.num_trainers)
        ]
        self.relays = [
            Link(links.relay_mbit_s, links.relay_latency_s) for _ in range(links.num_relays)
        ]
        # The peers the trainers' last refresh listed (the same for all of them), serving or draining: the
        # routers choose among the serving ones, and a backward goes to the peer that ran its forward while
        # it is listed (the trainer's records keep draining peers for that, as swarm.trainer.pipeline does).
        self.listed: list[set[str]] = [set() for _ in range(config.num_stages)]
        self.dirty = [True] * config.num_stages
        self.last_moved: dict[str, float] = {}
        self.active: set[SimMicrobatch] = set()
        # Counters.
        self.started = self.completed = self.hop_failures = self.recomputes = self.shed = 0
        self.arrived = self.died = self.events = 0
        self.window_samples = 0
        self.requests_by_peer: dict[str, int] = {}
        # Compute seconds scheduled on each stage's peers, and those of requests whose caller gave up first.
        self.busy_s = [0.0] * config.num_stages
        self.late_s = [0.0] * config.num_stages
        self.moves: list[Move] = []
        self.times: list[float] = []
        self.throughput: list[float] = []
        self.placement: list[tuple[int, ...]] = []
        self.capacity: list[tuple[float, ...]] = []

    # ---- setup and loop -------------------------------------------------------------------

    def run(self) -> SimResult:
        cfg = self.cfg
        self._place_initial_peers()
        for preemption in cfg.preemptions:
            self._push(preemption.time_s, PREEMPT, preemption)
        if cfg.arrival_rate_per_s > 0:
            self._push(self.rng.expovariate(cfg.arrival_rate_per_s), ARRIVE)
        self._discover()
        if cfg.rebalance and cfg.num_stages > 1:
            # Mid-period, so that "now" falls well inside one claim period.
            self._push(cfg.balance.period_s * 0.5, REBALANCE)
        self._push(cfg.sample_period_s, SAMPLE)
        for trainer in range(cfg.num_trainers):
            for _ in range(cfg.microbatches_in_flight):
                self._start_microbatch(trainer)
        self._loop()
        oldest = min((mb.started_at for mb in self.active), default=None)
        return SimResult(
            config=cfg,
            times_s=tuple(self.times),
            throughput=tuple(self.throughput),
            peers_per_stage=tuple(self.placement),
            capacity_per_stage=tuple(self.capacity),
            moves=tuple(self.moves),
            microbatches_started=self.started,
            microbatches_completed=self.completed,
            microbatches_in_flight=len(self.active),
            oldest_in_flight_started_s=oldest,
            hop_failures=self.hop_failures,
            requests_shed=self.shed,
            busy_s_per_stage=tuple(self.busy_s),
            late_s_per_stage=tuple(self.late_s),
            recomputes=self.recomputes,
            peers_arrived=self.arrived,
            peers_died=self.died,
            requests_by_peer=dict(self.requests_by_peer),
            events=self.events,
        )

    def _loop(self) -> None:
        end = self.cfg.duration_s
        heap = self.heap
        pop = heapq.heappop
        while heap:
            when, _, kind, item = pop(heap)
            if when > end:
                break
            self.now = when
            self.events += 1
            if kind == DONE:
                self._on_done(item)
            elif kind == REPLY:
                self._on_reply(item)
            elif kind == FAIL:
                self._on_fail(item)
            elif kind == RETRY:
                self._send(item)
            elif kind == LEAVE:
                self._on_leave(*item)
            elif kind == READY:
                self._on_ready(*item)
            elif kind == DEATH:
                self._on_death(item)
            elif kind == PREEMPT:
                self._on_preempt(item)
            elif kind == ARRIVE:
                self._on_arrive()
            elif kind == JOIN:
                self._on_join(item)
            elif kind == DISCOVER:
                self._discover()
            elif kind == REBALANCE:
                self._rebalance()
            elif kind == SAMPLE:
                self._sample()

    def _push(self, when: float, kind: int, item: object = None) -> None:
        self.seq += 1  # FIFO among equal times; never compares the items
        heapq.heappush(self.heap, (when, self.seq, kind, item))

    def _place_initial_peers(self) -> None:
        cfg = self.cfg
        count = cfg.initial_peer_count
        speeds = (
            list(cfg.peer_speeds)
            if cfg.peer_speeds is not None
            else [self._draw_speed() for _ in range(count)]
        )
        if cfg.initial_peers_per_stage is not None:
            stages = [s for s, n in enumerate(cfg.initial_peers_per_stage) for _ in range(n)]
        else:
            stages = []
            capacity = [0.0] * cfg.num_stages
            for speed in speeds:
                stage = choose_stage_on_arrival(capacity, self._rates(speed), self.rng)
                capacity[stage] += speed / self.costs[stage]
                stages.append(stage)
        for speed, stage in zip(speeds, stages):
            self._add_peer(speed, stage, SERVING)

    def _draw_speed(self) -> float:
        return self.rng.uniform(self.cfg.peer_speed_min, self.cfg.peer_speed_max)

    def _rates(self, speed: float) -> list[float]:
        return [speed / cost for cost in self.costs]

    def _add_peer(self, speed: float, stage: int, state: str) -> SimPeer:
        pid = f"p{self.next_pid}"
        self.next_pid += 1
        peer = SimPeer(pid, speed, stage, state)
        if self.cfg.links.model_links:
            peer.link = draw_peer_link(self.cfg.links, self.link_rng, self.relays)
        self.peers[pid] = peer
        self.dirty[stage] = True
        if self.cfg.mean_lifetime_s > 0:
            self._push(self.now + self.rng.expovariate(1.0 / self.cfg.mean_lifetime_s), DEATH, peer)
        return peer

    # ---- microbatches ---------------------------------------------------------------------

    def _start_microbatch(self, trainer: int) -> None:
        mb = SimMicrobatch(trainer, self.cfg.num_stages, self.now)
        self.active.add(mb)
        self.started += 1
        self._send(mb)

    def _send(self, mb: SimMicrobatch) -> None:
        """Send ``mb``'s current request, as the trainer's retry helper would."""
        cfg = self.cfg
        stage, now = mb.stage, self.now
        router = self.routers[mb.trainer]
        if mb.request is None:
            mb.request = StageRequest(
                router, stage, preferred=mb.fwd_peer[stage] if mb.backward else None
            )
        share = 1.0 if stage == cfg.num_stages - 1 else 1.0 - cfg.backward_share
        if mb.backward:
            share = cfg.backward_share
        try:
            # Backward prefers the forward peer while discovery lists it (and the shared rule allows).
            listed = mb.request.preferred in self.listed[stage]
            pid = mb.request.choose(now, self.route_rng, preferred_known=listed)
        except NoPeersAvailable as error:
            self._push(wake_at(error, now, wait_s=cfg.retry_wait_s), RETRY, mb)
            return
        peer = self.peers.get(pid)
        size = cfg.microbatch_size
        deadline = router.deadline_s(stage, pid, self._work(mb, stage))
        router.on_start(stage, pid, now)
        request = SimRequest(mb, pid, stage, now)
        latency = cfg.latency_s
        if peer is None or peer.stage != stage or peer.state not in (SERVING, DRAINING):
            # Dead (the connection is refused), or alive and serving another stage (it answers WrongPeer):
            # either way after a round trip.
            if peer is not None:
                request.error = WrongPeer(f"{pid} does not serve stage {stage} now")
            self._push(now + 2 * latency, FAIL, request)
            return
        recompute = mb.backward and (
            pid != mb.fwd_peer[stage] or peer.generation != mb.fwd_generation[stage]
        )
        if recompute:
            share = 1.0  # the inputs travel along and the forward is recomputed
        in_bytes = out_bytes = 0.0
        if cfg.links.model_links:
            in_bytes, out_bytes = hop_bytes(
                cfg.links, cfg.microbatch_size, stage, cfg.num_stages, mb.backward, recompute
            )
            trainer_link = self.trainer_links[mb.trainer]
            arrive = transfer(now, in_bytes, trainer_link, peer.link)
            latency = peer.link.latency_s + trainer_link.latency_s  # a refusal is a small message
        else:
            arrive = now + latency
        start = max(arrive, peer.free_at)
        cost = share * size / (peer.speed / self.costs[stage])
        if cfg.skip_expired and (
            shed_reason(
                now_s=arrive,
                deadline_s=now + deadline,
                queue_wait_s=start - arrive,
                cost_s=cost,
                max_queue_wait_s=cfg.max_queue_wait_s,
            )
            is not None
        ):
            # The peer refuses it on arrival, as the daemon does: the caller hears so after a round trip.
            self.shed += 1
            request.error = _SHED
            self._push(arrive + latency, FAIL, request)
            return
        if recompute:
            self.recomputes += 1
        request.finish = start + cost
        request.compute_s = cost
        peer.free_at = request.finish
        peer.outstanding[request] = None
        self.busy_s[stage] += cost
        request.deadline_at = now + deadline
        if cfg.links.model_links and request.finish <= request.deadline_at:
            request.reply_bytes = out_bytes
            self._push(request.finish, REPLY, request)  # the reply then queues on the links
            return
        if request.finish + latency > request.deadline_at:
            self.late_s[stage] += cost
            self._push(request.deadline_at, FAIL, request)  # the peer still spends the time
        else:
            self._push(request.finish + latency, DONE, request)

    def _work(self, mb: SimMicrobatch, stage: int) -> float:
        """The request's work in routing's unit (forward passes of one sample), as the trainer sizes its calls:
        a forward, the last stage's forward + loss + backward, or a backward (sized so even when it is sent
        elsewhere and recomputes, as the trainer's retries do)."""
        if stage == self.cfg.num_stages - 1:
            per_sample = STEP_COST
        else:
            per_sample = BACKWARD_COST if mb.backward else FORWARD_COST
        return self.cfg.microbatch_size * per_sample

    def _on_reply(self, request: SimRequest) -> None:
        """A peer finished computing ``request``: its reply crosses the links back to the trainer."""
        if request.done:
            return
        peer = self.peers.get(request.pid)
        if peer is None:
            return  # it died before sending: _kill failed the request
        reply_at = transfer(
            self.now, request.reply_bytes, peer.link, self.trainer_links[request.mb.trainer]
        )
        if reply_at > request.deadline_at:
            self.late_s[request.stage] += request.finish - request.sent_at  # at most; a diagnostic
            self._push(request.deadline_at, FAIL, request)
        else:
            self._push(reply_at, DONE, request)

    def _on_done(self, request: SimRequest) -> None:
        if request.done:
            return
        request.done = True
        now, cfg = self.now, self.cfg
        peer = self.peers.get(request.pid)
        if peer is not None:
            peer.outstanding.pop(request, None)
        mb = request.mb
        stage = request.stage
        # The reply reports the peer's compute time, as the daemon's does (routing weighs by it).
        self.routers[mb.trainer].on_success(
            stage, request.pid, self._work(mb, stage), now - request.sent_at, now, request.compute_s
        )
        self.requests_by_peer[request.pid] = self.requests_by_peer.get(request.pid, 0) + 1
        mb.request = None
        if not mb.backward:
            mb.fwd_peer[stage] = request.pid
            mb.fwd_generation[stage] = peer.generation if peer is not None else -1
            if stage < cfg.num_stages - 1:
                mb.stage = stage + 1
                self._send(mb)
                return
            mb.backward = True  # the last stage already did its backward with the loss
        if stage == 0:
            self.active.discard(mb)
            self.completed += 1
            self.window_samples += cfg.microbatch_size
            self._start_microbatch(mb.trainer)
            return
        mb.stage = stage - 1
        self._send(mb)

    def _on_fail(self, request: SimRequest) -> None:
        if request.done:
            return
        request.done = True
        self.hop_failures += 1
        peer = self.peers.get(request.pid)
        if peer is not None:
            peer.outstanding.pop(request, None)
        mb = request.mb
        try:
            mb.request.failed(request.pid, request.error, self.now)
        except RetriesExhausted:
            # Where the trainer gives up, the simulator keeps the microbatch: a fresh budget after a pause.
            mb.request = None
            self._push(self.now + self.cfg.retry_wait_s, RETRY, mb)
            return
        self._send(mb)

    # ---- peers come and go ----------------------------------------------------------------

    def _on_death(self, peer: SimPeer) -> None:
        if peer.state == DEAD:
            return
        self._kill(peer)

    def _kill(self, peer: SimPeer) -> None:
        self.died += 1
        self.dirty[peer.stage] = True
        self.dirty[peer.target] = True
        peer.state = DEAD
        del self.peers[peer.pid]
        now = self.now
        for request in peer.outstanding:
            if request.finish > now:  # replies already on the wire still arrive
                self._push(now + self.cfg.latency_s, FAIL, request)
        peer.outstanding.clear()

    def _on_preempt(self, preemption) -> None:
        serving = sorted(
            (p for p in self.peers.values() if p.stage == preemption.stage and p.state == SERVING),
            key=lambda p: p.pid,
        )
        victims = self.rng.sample(serving, round(preemption.fraction * len(serving)))
        for peer in victims:
            self._kill(peer)

    def _on_arrive(self) -> None:
        cfg = self.cfg
        self.arrived += 1
        delay = arrival_delay_s(self.rng, cfg.balance.arrival_max_delay_s)
        self._push(self.now + delay, JOIN, self._draw_speed())
        self._push(self.now + self.rng.expovariate(cfg.arrival_rate_per_s), ARRIVE)

    def _on_join(self, speed: float) -> None:
        # After its random delay the newcomer reads the records again and picks its stage.
        stage = choose_stage_on_arrival(
            self._capacities(count_starting=True), self._rates(speed), self.rng
        )
        peer = self._add_peer(speed, stage, STARTING)
        self._push(self.now + self.cfg.load_s, READY, (peer, peer.generation))

    def _on_ready(self, peer: SimPeer, generation: int) -> None:
        if peer.state != STARTING or peer.generation != generation:
            return
        peer.state = SERVING
        self.dirty[peer.stage] = True
        # As a real peer does: arriving on (or moving to) a stage starts its rebalancing cooldown.
        self.last_moved[peer.pid] = self.now

    def _on_leave(self, peer: SimPeer, generation: int) -> None:
        if peer.state != DRAINING or peer.generation != generation:
            return
        if peer.free_at > self.now:  # finish the queue first: no request is cut off by a move
            self._push(peer.free_at, LEAVE, (peer, generation))
            return
        self.dirty[peer.stage] = True  # no longer listed there, even as draining
        peer.stage = peer.target
        peer.state = STARTING
        peer.generation += 1
        self._push(self.now + self.cfg.load_s, READY, (peer, peer.generation))

    def _capacities(self, *, count_starting: bool) -> list[float]:
        capacity = [0.0] * self.cfg.num_stages
        for peer in self.peers.values():
            if peer.state == SERVING or (count_starting and peer.state == STARTING):
                capacity[peer.stage] += peer.speed / self.costs[peer.stage]
            elif count_starting and peer.state == DRAINING:
                capacity[peer.target] += peer.speed / self.costs[peer.target]
        return capacity

    # ---- periodic duties ------------------------------------------------------------------

    def _discover(self) -> None:
        now = self.now
        for stage in range(self.cfg.num_stages):
            if not self.dirty[stage]:
                continue  # nothing changed: a refresh would hand the routers the same mapping
            self.dirty[stage] = False
            # Peers announce samples/s of forward + backward; routing counts forward passes (as the trainer).
            serving = {
                p.pid: p.speed / self.costs[stage] * STEP_COST
                for p in self.peers.values()
                if p.stage == stage and p.state == SERVING
            }
            self.listed[stage] = set(serving) | {
                p.pid for p in self.peers.values() if p.stage == stage and p.state == DRAINING
            }
            for router in self.routers:
                router.update_peers(stage, serving, now)
        self._push(now + self.cfg.discovery_period_s, DISCOVER)

    def _view(self) -> SwarmView:
        stages: list[dict[str, PeerRecord]] = [{} for _ in range(self.cfg.num_stages)]
        for peer in self.peers.values():
            rate = peer.speed / self.costs[peer.stage]
            if peer.state == DRAINING:
                stages[peer.stage][peer.pid] = PeerRecord(rate, DRAINING)
                target_rate = peer.speed / self.costs[peer.target]
                stages[peer.target][peer.pid] = PeerRecord(target_rate, STARTING)
            else:
                stages[peer.stage][peer.pid] = PeerRecord(rate, peer.state)
        return SwarmView(stages=stages, last_moved_s=self.last_moved, stage_costs=self.costs)

    def _rebalance(self) -> None:
        cfg, now = self.cfg, self.now
        view = self._view()
        # Every peer reads the same view, so the peers whose decide_move says "move" are exactly
        # those of the shared plan (tests/test_balance.py checks it); computing it once avoids an
        # O(peers * plan) period.
        movers = plan_moves(view, now, cfg.balance)
        claims: dict[str, set[str]] = {}
        budgets: dict[str, int] = {}
        for move in movers:
            claims.setdefault(move.claim_key, set()).add(move.peer_id)
            budgets[move.claim_key] = move.budget
        # What each mover then checks in the claims it re-read (is_my_turn), once per key.
        winners = {
            key: claim_winners(claimers, movers[0].period_index, budgets[key])
            for key, claimers in claims.items()
        }
        for move in movers:
            if move.peer_id not in winners[move.claim_key]:
                continue
            peer = self.peers[move.peer_id]
            peer.state = DRAINING
            peer.target = move.to_stage
            self.dirty[move.from_stage] = True
            self.last_moved[peer.pid] = now
            self.moves.append(
                Move(
                    time_s=now, peer_id=peer.pid, from_stage=move.from_stage, to_stage=move.to_stage
                )
            )
            self._push(now + cfg.drain_s, LEAVE, (peer, peer.generation))
        self._push(now + cfg.balance.period_s, REBALANCE)

    def _sample(self) -> None:
        cfg = self.cfg
        self.times.append(self.now)
        self.throughput.append(self.window_samples / cfg.sample_period_s)
        self.window_samples = 0
        counts = [0] * cfg.num_stages
        for peer in self.peers.values():
            if peer.state == SERVING:
                counts[peer.stage] += 1
        self.placement.append(tuple(counts))
        self.capacity.append(tuple(self._capacities(count_starting=False)))
        self._push(self.now + cfg.sample_period_s, SAMPLE)
