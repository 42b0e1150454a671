"""The Router's cached queue costs (rollart.routing.cost.QueueCost) against the plain sums.

The Router keeps each replica's batch cost between decisions so that a decision is O(replicas),
not O(replicas x queue). These tests drive random event sequences and check, exactly (==, not
approx), that every wait, marginal service time and affinity cost equals the plain formula over
the replica's current queue, and that a router that never caches takes the same decisions.
A rebuild after a completion reuses the batch windows priced before (QueueWindows): the last
tests drive that at the rollout service's scale (decode_batch 8, ~300 outstanding per replica)."""

import random

import pytest

from rollart.routing import DEFAULT_CATALOG, CostModel, ReplicaSpec, Router, RouteRequest
from rollart.routing.cost import QueueCost, QueueWindows

H800, H20 = DEFAULT_CATALOG["H800"], DEFAULT_CATALOG["H20"]


def plain_batch_s(cost: CostModel, hw, items: list[tuple[float, float]]) -> float:
    """CostModel.batch_s as written before the cache: every batch summed from scratch."""
    step = cost.decode_batch * cost.bytes_per_token / hw.bandwidth
    total = 0.0
    for i in range(0, len(items), cost.decode_batch):
        chunk = items[i:i + cost.decode_batch]
        prefill = 0.0
        for p, _ in chunk:
            prefill += p
        total += prefill * cost.flops_per_token / hw.flops + max(d for _, d in chunk) * step
    return cost.time_scale * total


class Uncached(Router):
    """Rebuilds every queue cost from the replica's lists on every query."""

    def _queued_cost(self, rep):
        return QueueCost.of(self.cost, rep.spec.hw, self._queued(rep))

    def _running_cost(self, rep):
        return QueueCost.of(self.cost, rep.spec.hw,
                            [v for k, v in rep.outstanding.items() if k in rep.running])


def queues(router: Router, rid: str) -> tuple[list, list]:
    rep = router._replicas[rid]
    running = [v for k, v in rep.outstanding.items() if k in rep.running]
    return running, [v for k, v in rep.outstanding.items() if k not in rep.running]


def finish_batch(routers: tuple[Router, ...], rid: str, ids: list[str], busy: float) -> None:
    """An engine batch on `rid` ends: the correction, then its completions, on every router."""
    for router in routers:
        router.on_batch(rid, ids, busy)
        for k in ids:
            router.on_finished(k)


def check_against_plain(router: Router, probe: RouteRequest) -> None:
    cost = router.cost
    for rid in router.replica_ids():
        rep = router._replicas[rid]
        running, queued = queues(router, rid)
        hw = rep.spec.hw
        wait = rep.scale * (plain_batch_s(cost, hw, running) + plain_batch_s(cost, hw, queued))
        assert router.wait_s(rid) == wait
        item = router._tokens(probe, rid)
        raw = plain_batch_s(cost, hw, [*queued, item]) - plain_batch_s(cost, hw, queued)
        assert router.service_s(probe, rid) == rep.scale * raw
        sharing = len(queued) % cost.decode_batch
        assert router._finish_s(probe, rid) == wait + (1 + sharing) * (rep.scale * raw)


@pytest.mark.parametrize("policy", ["affinity", "least_loaded", "round_robin"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_cached_router_equals_plain_sums_and_uncached_decisions(policy: str, seed: int):
    rng = random.Random(seed)
    cost = CostModel.for_model(7e9, decode_batch=4, kv_bytes_per_token=1e5, time_scale=1.3)
    specs = [ReplicaSpec(f"r{i}", H800 if i % 3 == 0 else H20) for i in range(6)]
    kw = dict(policy=policy, imbalance_threshold_s=0.05, prefix_cache=bool(seed % 2))
    cached, plain = Router(specs, cost, **kw), Uncached(specs, cost, **kw)
    live: dict[str, int] = {}  # episode -> next turn
    where: dict[str, str] = {}  # outstanding request -> replica
    n = 0
    for _ in range(400):
        op = rng.random()
        if op < 0.45 or not where:  # a new episode or an episode's next turn
            eid = rng.choice([*live, f"e{n}"]) if live and rng.random() < 0.6 else f"e{n}"
            n += eid == f"e{n}"
            turn = live.get(eid, 0)
            if any(k.startswith(f"{eid}/") for k in where):
                continue
            r = RouteRequest(f"{eid}/{turn}", eid, "t", new_tokens=rng.randint(1, 4000),
                             context_tokens=rng.randint(0, 9000) * (turn > 0),
                             decode_tokens=rng.choice([8.0, 128.0, 1000.0 * rng.random()]))
            a, b = cached.route(r), plain.route(r)
            assert a == b
            where[r.request_id], live[eid] = a.replica_id, turn + 1
        elif op < 0.65:  # an engine batch starts with the replica's first queued requests
            rid = rng.choice(cached.replica_ids())
            ids = [k for k, v in where.items() if v == rid][:rng.randint(1, 4)]
            cached.on_started(rid, ids)
            plain.on_started(rid, ids)
        elif op < 0.95:  # a batch ends: correction, then the completions
            rid = rng.choice(sorted(set(where.values())))
            ids = [k for k, v in where.items() if v == rid][:rng.randint(1, 4)]
            finish_batch((cached, plain), rid, ids, rng.uniform(0.1, 3.0))
            for k in ids:
                del where[k]
                if rng.random() < 0.3:
                    eid = k.split("/")[0]
                    cached.on_episode_end(eid)
                    plain.on_episode_end(eid)
                    live.pop(eid, None)
        elif len(cached.healthy()) > 2:  # a replica fails; its requests are re-routed later
            rid = rng.choice(cached.healthy())
            assert cached.on_failed(rid) == plain.on_failed(rid)
            where = {k: v for k, v in where.items() if v != rid}
            cached.on_recovered(rid)
            plain.on_recovered(rid)
        probe = RouteRequest("probe", rng.choice([*live, "fresh"]), "t",
                             new_tokens=rng.randint(1, 3000), context_tokens=rng.randint(0, 5000),
                             decode_tokens=rng.choice([8.0, 300.0]))
        check_against_plain(cached, probe)
        assert cached.metrics() == plain.metrics()


def test_queue_cost_appended_equals_rebuilt():
    rng = random.Random(7)
    cost = CostModel.for_model(3e9, decode_batch=3, time_scale=0.7)
    items: list[tuple[float, float]] = []
    q = QueueCost.of(cost, H20, items)
    for _ in range(20):
        item = (float(rng.randint(1, 5000)), rng.choice([8.0, 64.0, 512.0 * rng.random()]))
        assert q.with_item_s(cost, H20, item) == plain_batch_s(cost, H20, [*items, item])
        q = q.appended(cost, H20, item)
        items.append(item)
        assert q == QueueCost.of(cost, H20, items)
        assert q.total_s == plain_batch_s(cost, H20, items) == cost.batch_s(H20, items)
        assert q.count == len(items)


@pytest.mark.parametrize("seed", [0, 1])
def test_window_reuse_at_scale_equals_plain_sums_and_uncached_decisions(seed: int):
    """~300 outstanding per replica, decode_batch 8, completions mostly near the head of a
    queue (the windows a rebuild reuses) and sometimes anywhere, some batches started first."""
    rng = random.Random(seed)
    cost = CostModel.for_model(135e6, decode_batch=8, time_scale=1.7)
    specs = [ReplicaSpec(f"r{i}", H800 if i < 2 else H20) for i in range(4)]
    kw = dict(policy="affinity", imbalance_threshold_s=1e-3, prefix_cache=bool(seed % 2))
    cached, plain = Router(specs, cost, **kw), Uncached(specs, cost, **kw)
    where: dict[str, str] = {}  # outstanding request -> replica, in routing order
    turns: dict[str, int] = {}

    def route(eid: str) -> None:
        turn = turns.get(eid, 0)
        r = RouteRequest(f"{eid}/{turn}", eid, "t", new_tokens=rng.randint(1, 4000),
                         context_tokens=rng.randint(0, 20000) * (turn > 0),
                         decode_tokens=rng.choice([48.0, 900.0, 2000.0 * rng.random()]))
        a, b = cached.route(r), plain.route(r)
        assert a == b
        where[r.request_id], turns[eid] = a.replica_id, turn + 1

    for i in range(1200):
        route(f"e{i}")
    probe = RouteRequest("probe", "e3", "t", new_tokens=700, context_tokens=5000,
                         decode_tokens=300.0)
    check_against_plain(cached, probe)
    for step in range(400):
        rid = rng.choice(sorted(set(where.values())))
        ids = [k for k, v in where.items() if v == rid]
        head = ids[:rng.choice([8, 8, 8, 24, len(ids)])]
        if rng.random() < 0.15:  # an engine batch starts (the rest stays queued)
            started = head[:rng.randint(1, 8)]
            cached.on_started(rid, started)
            plain.on_started(rid, started)
        done = rng.sample(head, min(len(head), rng.randint(1, 2)))
        finish_batch((cached, plain), rid, done, rng.uniform(0.05, 0.5))
        for k in done:
            del where[k]
            eid = k.split("/")[0]
            if rng.random() < 0.1:
                cached.on_episode_end(eid)
                plain.on_episode_end(eid)
                eid = f"n{step}/{k}".replace("/", "_")
            route(eid)
        if step % 4 == 0:
            probe = RouteRequest("probe", rng.choice([*turns, "fresh"]), "t",
                                 new_tokens=rng.randint(1, 3000),
                                 context_tokens=rng.randint(0, 9000),
                                 decode_tokens=rng.choice([8.0, 300.0, 3000.0]))
            check_against_plain(cached, probe)
            assert cached.metrics() == plain.metrics()
    assert min(len(r.outstanding) for r in cached._replicas.values()) > 100


def test_queue_windows_equal_queue_cost_of_for_any_floats():
    """Windows are priced by QueueCost.of's own loop, so reuse is exact for any items (here
    fractional prefills and ties in decode), across appends, removals anywhere and clears."""
    rng = random.Random(3)
    cost = CostModel.for_model(7e9, decode_batch=8, kv_bytes_per_token=1e5, time_scale=0.9)
    q = QueueWindows(cost, H20)
    items: dict[str, tuple[float, float]] = {}
    for step in range(3000):
        op = rng.random()
        if op < 0.55 or not items:
            rid = f"x{step}"
            items[rid] = (rng.uniform(0.0, 5000.0), rng.choice([64.0, 64.0, 1e3 * rng.random()]))
            q.append(rid, items[rid])
        elif op < 0.999:
            ids = list(items)
            rid = ids[rng.randrange(min(len(ids), 10))] if op < 0.9 else rng.choice(ids)
            del items[rid]
            q.remove(rid)
        else:
            items.clear()
            q.clear()
        if step % 3 == 0:
            built = q.cost()
            assert built == QueueCost.of(cost, H20, list(items.values()))
            assert built.total_s == plain_batch_s(cost, H20, list(items.values()))
