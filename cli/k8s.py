"""`rollart k8s render`: the Kubernetes objects of a run's cluster, checked, as files."""

from __future__ import annotations

from pathlib import Path

import typer

from infra.stack import PROJECT_ROOT
from rollart.config import ConfigError, load_config

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Kubernetes: render the DaskCluster and the Prefect work pool template.")


@app.command()
def render(
    config: Path = typer.Option(Path("configs/default.yaml"), "--config", "-c"),
    set_: list[str] = typer.Option([], "--set", help="Override: key.path=value (repeatable)"),
    out: Path = typer.Option(Path("k8s"), "--out", help="Directory to write the files to"),
    prefect_file: Path = typer.Option(PROJECT_ROOT / "prefect.yaml", "--prefect-file"),
) -> None:
    """Write dask-cluster.yaml (DaskCluster + one DaskWorkerGroup per class + DaskAutoscaler,
    for `kubectl apply -f`) and prefect-job-template.json (for `prefect work-pool create
    rollart-k8s --type kubernetes --base-job-template ...`), after checking them against the
    operator's CRDs. `cluster.manager` is taken as kubernetes."""
    from infra.k8s_check import ManifestError
    from infra.kubernetes import render as render_files

    try:
        cfg = load_config(config, ["cluster.manager=kubernetes", *set_])
        files = render_files(cfg.cluster, prefect_file)
    except (ConfigError, ManifestError) as err:
        typer.secho(f"error: {err}", fg="red", err=True)
        raise typer.Exit(2) from None
    out.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (out / name).write_text(text)
        typer.echo(f"wrote {out / name}")
