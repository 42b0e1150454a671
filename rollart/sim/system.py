"""The full system in simulated time: the real scheduler and the real Router over priced pools.

`SystemSimulation` is `Simulation` (rollart/sim/simulator.py: the real `RolloutScheduler`, its
episodes, batcher and trainer events) with the constants replaced by models (rollart/sim/cluster):

    episode   env start-up (attempts, failures, timeouts) -> [route -> queue -> generate call ->
              env step]* -> reward scoring (fixed pool or serverless) -> counted in a batch
    routing   every turn goes through the real `Router` (affinity / round robin / least loaded,
              sticky replicas, spill, failover) with the real `TaskProfiles` feeding it decode
              lengths; calls report back `on_batch` / `on_finished`, as the service does
    engines   a call's time from the replica's class (PoolModel: cost model, roofline, efficiency);
              a prefix-cache hit when the turn lands where the episode's last turn ran
    trainer   the update starts when the batch's rewards are in; update time from tokens and GPUs
              (TrainModel), sync from weight bytes and bandwidth (SyncModel); colocated engines
              serve nothing during an update
    failures  `fail_replica(t, index, down_s)`: the router's on_failed; lost turns re-routed

Per step it attributes the trainer's critical path: the wait for the batch is split over the
last-finishing episode's life (env start-up, generation incl. queueing, env steps; any part of
the wait before that episode existed is idle), then reward wait, training, sync.
"""

from __future__ import annotations

import random

from rollart.rollout.scheduler import Cancel, Start
from rollart.routing.profile import TaskProfiles
from rollart.routing.router import ReplicaSpec, Router, RouteRequest
from rollart.sim.cluster import SystemConfig
from rollart.sim.results import PARTS, EpisodeLife, SystemResult
from rollart.sim.rewards import RewardPool
from rollart.sim.simulator import Planner, Simulation, _Engine, _Episode


class SystemSimulation(Simulation):
    def __init__(self, cfg: SystemConfig, plan: Planner | None = None) -> None:
        super().__init__(cfg.sim, plan)
        self.scfg = cfg
        self.tasks = {t.name: t for t in cfg.sim.tasks}
        self.pool_of: list[int] = []
        self.hw = []
        specs = []
        for p_i, pool in enumerate(cfg.pools):
            hw = pool.replica_class(cfg.catalog)
            for _ in range(pool.replicas):
                specs.append(ReplicaSpec(f"{pool.hw.lower()}-{len(specs)}", hw))
                self.pool_of.append(p_i)
                self.hw.append(hw)
        self.rids = [s.replica_id for s in specs]
        self.index = {rid: i for i, rid in enumerate(self.rids)}
        self.engines = [_Engine() for _ in specs]
        r = cfg.routing
        self.cost = cfg.model.cost_model(cfg.pools[0].max_batch)
        # A sharded rollout service: shard k routes over replicas k, k + K, ... (each shard gets
        # the pools' mix) with its own real Router; episodes are dealt to shards in turn.
        n = len(specs)
        shards = -(-n // r.shard_replicas) if r.shard_replicas else 1
        self.shard_of = [i % shards for i in range(n)]
        self.routers = [Router([sp for i, sp in enumerate(specs) if i % shards == k], self.cost,
                               policy=r.policy, sticky=r.sticky,
                               imbalance_threshold_s=r.imbalance_threshold_s,
                               prefix_cache=r.prefix_cache) for k in range(shards)]
        self.ep_shard: dict[str, Router] = {}
        self.profiles = TaskProfiles(alpha=0.2)
        self.rewards = RewardPool(cfg.reward) if cfg.reward else None
        self.life: dict[str, EpisodeLife] = {}
        self.reward_done: dict[str, float] = {}
        # request id -> (queued at, prefill tokens, decode tokens, new prompt tokens)
        self.turn: dict[str, tuple[float, float, float, float]] = {}
        self.ctx: dict[str, tuple[float, float]] = {}  # episode id -> (context, new) tokens
        self.inflight: dict[int, list[tuple[str, _Episode]] | None] = {}
        self.call_dur: dict[int, float] = {}
        # continuous: turns in flight per replica, request id -> (episode, dispatch token)
        self.rows: dict[int, dict[str, tuple[_Episode, int]]] = {}
        self.busy_since: dict[int, float] = {}
        self.events = 0
        self.steps: list[dict[str, float]] = []
        self._pending_step: dict[str, float] = {}
        self._train_end = 0.0

    # ---- episodes: env start-up, routing ---------------------------------------------------
    def _launch(self, starts: list[Start]) -> None:
        env = self.scfg.env
        for st in starts:
            # Common random numbers: an episode's plan, start-up and reward draws come from its
            # own stream (seed, episode id), so every design plays the same episodes and their
            # differences are the design's, not the draw's.
            rng = random.Random(f"{self.cfg.seed}/{st.episode_id}")
            ep = _Episode(st, self.plan(st, rng), 0)
            self.live[st.episode_id] = ep
            self.group_version[st.group_id] = st.version
            self.life[st.episode_id] = life = EpisodeLife(self.now)
            self.ctx[st.episode_id] = (0.0, float(self.tasks[st.task].first_prompt_tokens))
            self.events += 1
            if env is None:
                self._request(ep)
                continue
            delay, ok = 0.0, False
            for _ in range(env.max_attempts):
                t = env.startup.sample(rng)
                if rng.random() < env.startup_fail_prob:
                    delay += env.startup_timeout_s  # noticed only when the start times out
                    self.counters["env_startup_failures"] += 1
                else:
                    delay, ok = delay + t, True
                    break
            life.startup_s = delay
            self._at(self.now + delay, self._env_ready if ok else self._startup_failed, ep)

    def _env_ready(self, ep: _Episode) -> None:
        if not ep.cancelled:
            self._request(ep)

    def _startup_failed(self, ep: _Episode) -> None:
        if not ep.cancelled:
            self._episode_over(ep, failed=True)

    def _request(self, ep: _Episode) -> None:
        eid, task = ep.start.episode_id, self.tasks[ep.start.task]
        ctx, new = self.ctx[eid]
        decode = ep.plan.decode[ep.step] if ep.plan.decode else task.decode_tokens
        rid = f"{eid}#t{ep.step}"
        router = self.ep_shard.setdefault(eid, self.routers[len(self.ep_shard) % len(self.routers)])
        prev = router.home(eid)
        d = router.route(RouteRequest(
            rid, eid, task.name, new_tokens=int(new), context_tokens=int(ctx),
            decode_tokens=self.profiles.expected_decode_tokens(task.name, task.decode_tokens)))
        hit = self.scfg.routing.prefix_cache and prev == d.replica_id
        self.turn[rid] = (self.now, new + (0.0 if hit else ctx), float(decode), new)
        ep.engine = self.index[d.replica_id]
        self.engines[ep.engine].queue.append((rid, ep))
        self.events += 1
        self._wake(ep.engine)

    def _cancel(self, cancels: list[Cancel]) -> None:
        for c in cancels:
            ep = self.live.get(c.episode_id)
            if ep is None:
                continue
            for rid, other in self.engines[ep.engine].queue:
                if other is ep:
                    self.routers[self.shard_of[ep.engine]].on_finished(rid)
                    self.turn.pop(rid, None)
            self.ep_shard.pop(c.episode_id, self.routers[0]).on_episode_end(c.episode_id)
        super()._cancel(cancels)

    def _episode_over(self, ep: _Episode, failed: bool) -> None:
        eid = ep.start.episode_id
        self.ep_shard.pop(eid, self.routers[0]).on_episode_end(eid)
        self.life[eid].end = self.now
        self.events += 1
        if not failed and self.rewards is not None:
            rng = random.Random(f"{self.cfg.seed}/reward/{eid}")
            cost = self.scfg.reward.cost.sample(rng)  # type: ignore[union-attr]
            self.reward_done[eid] = self.rewards.submit(self.now, cost)
            self.events += 2  # invoke, result
        super()._episode_over(ep, failed)

    # ---- engines ---------------------------------------------------------------------------
    def _max_batch(self, e: int) -> int:
        return self.scfg.pools[self.pool_of[e]].max_batch

    def _step_s(self, e: int, rows: int) -> float:
        """One decode step with `rows` rows (roofline: weights read once, compute per row)."""
        pool, hw, m = self.scfg.pools[self.pool_of[e]], self.hw[e], self.scfg.model
        weights = (m.weight_bytes + rows * m.kv_bytes_per_token) / (hw.bandwidth * pool.decode_eff)
        return max(weights, rows * self.cost.flops_per_token / (hw.flops * pool.prefill_eff))

    def _prefill_s(self, e: int, tokens: float) -> float:
        pool, hw = self.scfg.pools[self.pool_of[e]], self.hw[e]
        return tokens * self.cost.flops_per_token / (hw.flops * pool.prefill_eff)

    def _call_s(self, e: int, items: list[tuple[str, _Episode]]) -> float:
        pool, hw = self.scfg.pools[self.pool_of[e]], self.hw[e]
        prefill = self._prefill_s(e, sum(self.turn[rid][1] for rid, _ in items))
        decodes = sorted(self.turn[rid][2] for rid, _ in items)
        if pool.decode == "per_row":
            decode = sum(decodes) * self.cost.bytes_per_token / (hw.bandwidth * pool.decode_eff)
        else:  # roofline over decode steps; rows drop out as their answers end
            decode, done = 0.0, 0.0
            for j, d in enumerate(decodes):
                decode += (d - done) * self._step_s(e, len(decodes) - j)
                done = d
        dur = pool.overhead_s + prefill + decode
        self.inflight[e], self.call_dur[e] = items, dur
        return dur

    def _turn_done(self, e: int, rid: str, ep: _Episode) -> None:
        """Bookkeeping for one finished turn (the router, profiles, the episode's tokens)."""
        self.routers[self.shard_of[e]].on_finished(rid)
        queued, prefill, decode, new = self.turn.pop(rid)
        self.events += 1
        if ep.cancelled:
            return
        eid = ep.start.episode_id
        self.profiles.observe_turn(ep.start.task, int(prefill), int(decode))
        ctx, _ = self.ctx[eid]
        self.ctx[eid] = (ctx + new, decode + self.tasks[ep.start.task].obs_tokens)
        life = self.life[eid]
        life.gen_s += self.now - queued
        life.env_s += ep.plan.step_s[ep.step]
        life.tokens = ctx + new + decode
        self.events += 1  # the env step

    def _call_done(self, e: int, items: list[tuple[str, _Episode]]) -> None:
        if self.inflight.get(e) is not items:
            return  # the replica failed during the call: its turns were re-routed
        self.inflight[e] = None
        self.routers[self.shard_of[e]].on_batch(self.rids[e], [rid for rid, _ in items],
                                                self.call_dur[e])
        for rid, ep in items:
            self._turn_done(e, rid, ep)
        super()._call_done(e, items)

    # continuous batching (vLLM-like): a turn joins as soon as a row is free and leaves when its
    # own answer ends; its decode steps cost _step_s(rows on the replica when it joined).
    def _dispatch(self, e: int) -> None:
        pool = self.scfg.pools[self.pool_of[e]]
        if pool.batching == "static":
            super()._dispatch(e)
            return
        eng = self.engines[e]
        eng.pending = False
        if self.now < eng.paused_until:  # weight sync in progress
            self._wake(e)
            return
        free = pool.max_batch - eng.running
        if free <= 0 or not eng.queue:
            return
        queued = sorted(eng.queue, key=lambda x: x[0])
        items, eng.queue = queued[:free], queued[free:]
        if eng.running == 0:
            self.busy_since[e] = self.now
        eng.running += len(items)
        step = self._step_s(e, eng.running)
        rows = self.rows.setdefault(e, {})
        for rid, ep in items:
            _, prefill, decode, _ = self.turn[rid]
            dur = pool.overhead_s + self._prefill_s(e, prefill) + decode * step
            eng.call_end = max(eng.call_end, self.now + dur)
            eng.calls += 1
            token = next(self._seq)  # tells this run of the turn from a re-issued one
            rows[rid] = (ep, token)
            # replica time this turn uses (the router's notion: wait = sum of outstanding work)
            self._at(self.now + dur, self._row_done, e, rid, token, dur / eng.running)

    def _row_done(self, e: int, rid: str, token: int, share_s: float) -> None:
        rows = self.rows.get(e, {})
        if rid not in rows or rows[rid][1] != token:
            return  # the replica failed or the sync interrupted it: the turn was re-issued
        ep = rows.pop(rid)[0]
        eng = self.engines[e]
        eng.running -= 1
        if eng.running == 0:
            eng.busy_s += self.now - self.busy_since[e]
        self.routers[self.shard_of[e]].on_batch(self.rids[e], [rid], share_s)
        self._turn_done(e, rid, ep)
        if not ep.cancelled:
            self._at(self.now + ep.plan.step_s[ep.step], self._env_done, ep)
        self._wake(e)

    def fail_replica(self, t: float, index: int, down_s: float) -> None:
        """Schedule replica `index` to fail at simulated time t and recover down_s later."""
        self._at(t, self._replica_failed, index, down_s)

    def _replica_failed(self, e: int, down_s: float) -> None:
        eng = self.engines[e]
        router = self.routers[self.shard_of[e]]
        router.on_failed(self.rids[e])
        lost = (list(eng.queue) + list(self.inflight.get(e) or [])
                + [(rid, ep) for rid, (ep, _) in self.rows.pop(e, {}).items()])
        if eng.running and e in self.busy_since and self.scfg.pools[self.pool_of[e]].batching \
                == "continuous":
            eng.busy_s += self.now - self.busy_since[e]
        eng.queue, eng.running, eng.call_end = [], 0, self.now
        self.inflight[e] = None
        self.counters["replica_failures"] += 1
        for rid, ep in sorted(lost, key=lambda x: x[0]):
            self.turn.pop(rid, None)
            if not ep.cancelled:
                self.counters["turns_failed_over"] += 1
                self._request(ep)  # the router places it on a healthy replica ("failover")
        self._at(self.now + down_s, lambda: router.on_recovered(self.rids[e]))

    # ---- trainer ---------------------------------------------------------------------------
    def _kept(self, batch: dict[str, list[str]]) -> list[str]:
        return [eid for eids in batch.values() for eid in eids]

    def _update_start(self, batch: dict[str, list[str]]) -> float:
        kept = self._kept(batch)
        start = max([self.now] + [self.reward_done.get(eid, self.now) for eid in kept])
        wait = self.wait_s[-1]
        last = self.life[max(kept, key=lambda eid: self.life[eid].end)]
        life = last.end - last.start
        part = {k: 0.0 for k in PARTS}
        covered = min(wait, life)
        if life > 0:
            for k, v in (("env_startup", last.startup_s), ("generation", last.gen_s),
                         ("env_step", last.env_s)):
                part[k] = covered * v / life
            # queueing for an env slot, retries after failures: the rest of its life
            rest = life - last.startup_s - last.gen_s - last.env_s
            part["idle"] += covered * max(0.0, rest) / life
        part["idle"] += wait - covered
        part["reward"] = start - self.now
        # Where the batch's episodes spent their lives on average (not the critical path).
        lives = [self.life[eid] for eid in kept]
        total = sum(x.end - x.start for x in lives) or 1.0
        part["episode_mix"] = {  # type: ignore[assignment]
            "env_startup": sum(x.startup_s for x in lives) / total,
            "generation": sum(x.gen_s for x in lives) / total,
            "env_step": sum(x.env_s for x in lives) / total}
        self._pending_step = part
        if self.scfg.colocated:
            for eng in self.engines:
                eng.paused_until = start + self._update_s(batch)
        return start

    def _update_s(self, batch: dict[str, list[str]]) -> float:
        t = self.scfg.train
        if t is None:
            return self.cfg.trainer.update_s
        tokens = sum(self.life[eid].tokens for eid in self._kept(batch))
        return t.update_s(tokens, self.scfg.model.active, self.scfg.catalog)

    def _sync_s(self) -> float:
        s = self.scfg.sync
        return self.cfg.trainer.sync_s if s is None else s.sync_s(self.scfg.model.weight_bytes)

    def _train_done(self) -> None:
        self._train_end = self.now
        if self.scfg.sync_interrupts:
            self._interrupt_rows()
        super()._train_done()

    def _interrupt_rows(self) -> None:
        """Abort the turns in flight (continuous engines) and queue them again on the same
        replica: they re-run from scratch after the sync (ROLL / SkyRL's abort-and-reissue)
        instead of holding the sync until the longest answer ends."""
        for e, rows in self.rows.items():
            if not rows:
                continue
            eng = self.engines[e]
            eng.busy_s += self.now - self.busy_since[e]  # the work done so far is lost
            self.counters["turns_interrupted"] += len(rows)
            eng.queue.extend((rid, ep) for rid, (ep, _) in rows.items())
            self.rows[e] = {}
            eng.running, eng.call_end = 0, self.now

    def _sync_done(self) -> None:
        part = self._pending_step
        part["training"] = self.trainer_busy_s - sum(s["training"] for s in self.steps)
        part["sync"] = self.now - self._train_end
        part["step_s"] = sum(part[k] for k in PARTS)
        self.steps.append(part)
        super()._sync_done()

    # ---- result ----------------------------------------------------------------------------
    def run_system(self, max_events: int = 50_000_000) -> SystemResult:
        sim = self.run(max_events)
        for e, eng in enumerate(self.engines):  # continuous: count the busy period still open
            if self.scfg.pools[self.pool_of[e]].batching == "continuous":
                sim.engine_busy_s[e] = eng.busy_s + (
                    sim.wall_s - self.busy_since[e] if eng.running else 0.0)
        wall = sim.wall_s or 1.0
        util: dict[str, float] = {}
        for p_i, pool in enumerate(self.scfg.pools):
            busy = [b for b, p in zip(sim.engine_busy_s, self.pool_of, strict=True) if p == p_i]
            util[f"engines/{pool.hw}#{p_i}"] = sum(busy) / (len(busy) * wall)
        util["trainer"] = min(sim.trainer_busy_s, wall) / wall
        if self.scfg.colocated:  # the same GPUs: generation time plus update time
            util = {k: (v + util["trainer"] if k != "trainer" else v) for k, v in util.items()}
        rw = {}
        if self.rewards is not None:
            rw = {"cold_starts": float(self.rewards.cold_starts), "peak": float(self.rewards.peak),
                  "busy_s": self.rewards.busy_s}
        decisions: dict[str, float] = {"router/shards": float(len(self.routers))}
        for router in self.routers:
            for k, v in router.metrics().items():
                if k.count("/") == 1:
                    decisions[k] = decisions.get(k, 0.0) + v
        return SystemResult(sim, self.steps, util, decisions, rw, self.events)


def simulate_system(cfg: SystemConfig, plan: Planner | None = None) -> SystemResult:
    return SystemSimulation(cfg, plan).run_system()
