def test_killed_engine_worker_fails_over_and_is_replaced(prefect_api, tmp_path):
    def kill(client, store, done):
        _after_first_row(store)
        victim = _engine_workers(client)[0]
        done["victim"] = victim
        try:  # the worker process exits abruptly (its nanny starts a fresh one)
            client.run(os._exit, 1, workers=[victim])
        except Exception:
            pass

    out, rows, done = _train_with(prefect_api, tmp_path, "engine-kill", kill)
    assert done.get("victim"), "no engine worker was killed"
    counters = out["rollout"]["counters"]
    assert counters.get("engines_lost") == 1, out["rollout"]["recent_errors"]
    assert counters.get("turns_reissued", 0) >= 1  # its turns in flight went to the other one
    assert "failed" not in counters and "engine_errors" not in counters  # no episode paid
    assert sum(r["perf/sync_skipped"] for r in rows) >= 1  # a sync went on without it
    # The replacement on the restarted worker: once it is built (seconds on an idle host,
    # minutes on a loaded one), the supervisor puts it in rotation with the current weights;
    # whether that happens before this short run ends depends on the host, so it is checked
    # in one process (tests/unit/test_engine_failover.py) and reported, not asserted, here.
    for e in out["rollout"]["engines_revived"]:
        assert e["how"] == "replacement" and out["rollout"]["engines_alive"] == [True, True]


