"""Running a run: the iteration driver and everything that drives one run end to end.

    driver         the one iteration loop (start, per-step plan, metrics merge, finish)
    stages         the stage bodies (collect, score, update, sync_weights, checkpoint, ...)
    spans          stage spans: where each stage's wall time went
    lifecycle      one run's lifecycle for both modes (lock, start checks, restarts, release)
    recovery       bringing lost engines back; restarting a run from its latest checkpoint
    local_loop     the in-process mode: the driver with plain calls and plain objects
    dask_services  the long-lived services as Dask actors pinned to their hardware classes
    progress       per-iteration progress (a log line, or a table in a terminal)
    metric_sinks   where metrics go besides metrics.jsonl (TensorBoard)

Rule (tests/unit/test_architecture.py): this package may import every other part of rollart;
none of the core packages (algo, config, engines, envs, models, rewards, rollout, routing,
services, sim, storage, train) nor the shared top-level modules imports it. The Prefect side
(`tasks/`, `flows/`) wraps it.
"""
