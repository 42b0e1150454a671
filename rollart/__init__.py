"""rollart: RL for LLM agents on disaggregated hardware. The core library; never imports Prefect.

Packages, by concept:

    config/    the typed run config (`from rollart.config import RunConfig, load_config`)
    runner/    running a run: the iteration driver, stage bodies, lifecycle, recovery, the
               in-process mode and the services as Dask actors
    services/  the long-lived services (engine replica, trainer, rollout-service actor)
    rollout/   scheduler, rollout service, env hosts, turn router, plan and ids
    routing/   hardware catalog, profiles, router;   sim/  discrete-event simulator
    models/ engines/ algo/ train/ envs/ rewards/ storage/

Top-level modules are the shared primitives that several packages (core and runner alike)
import, so they sit below every package rather than inside one of them:

    types.py, arrow_schema.py     data crossing processes, and its Parquet schema
    run.py                        RunSpec: typed config + run id, what every stage and service gets
    handles.py, service_protocols.py  actor-or-object calls and the typed seams they go through
    secrets.py                    which process gets which secret
    metrics.py                    namespaced metrics from trajectories
    answer_trie.py, action_grammar.py  constrained decoding (envs, engines, trainer, rollout)
    cpu_pinning.py                CPU cores per hardware class (config and the services)
"""
