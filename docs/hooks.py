"""mkdocs hook: pages generated from the code and the committed results, so they cannot drift.

A page holds a placeholder comment that `on_page_markdown` replaces at build time:

    <!-- generated: config -->       every field of the config models (rollart.config.RunConfig,
                                     walked recursively): key, type, default, description
    <!-- generated: cli -->          the help of every `rollart` command and subcommand (typer)
    <!-- generated: benchmarks -->   one row per benchmark from results/*.json

Also usable without mkdocs: `python docs/hooks.py config|cli|benchmarks` prints that part.
"""

from __future__ import annotations

import json
import logging
import re
import sys
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

# A sibling module: mkdocs puts the hook's directory on sys.path while it loads the hook.
from benchmark_rows import BENCHMARKS, committed_date, load

ROOT = Path(__file__).resolve().parent.parent
log = logging.getLogger("mkdocs.plugins.rollart")
PLACEHOLDER = re.compile(r"<!-- generated: (\w+) -->")


# ---------------------------------------------------------------------------- config reference

def _type_name(annotation: Any) -> str:
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Literal:
        return " | ".join(json.dumps(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in args)
    if origin is not None:
        name = getattr(origin, "__name__", str(origin))
        return f"{name}[{', '.join(_type_name(a) for a in args)}]"
    if annotation is type(None):
        return "None"
    return getattr(annotation, "__name__", str(annotation))


def _models(annotation: Any) -> list[tuple[str, type]]:
    """(key suffix, model) for each pydantic model inside an annotation: `X` -> ("", X),
    `dict[str, X]` -> (".<name>", X), `list[X]` -> (".<i>", X)."""
    from pydantic import BaseModel

    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [("", annotation)]
    origin = typing.get_origin(annotation)
    out: list[tuple[str, type]] = []
    for arg in typing.get_args(annotation):
        for suffix, model in _models(arg):
            if origin is dict:
                out.append((".<name>" + suffix, model))
            elif origin is list:
                out.append((".<i>" + suffix, model))
            else:
                out.append((suffix, model))
    return out


def _default(field: Any) -> str:
    from pydantic import BaseModel
    from pydantic_core import PydanticUndefined

    if field.default_factory is not None:
        try:
            value = field.default_factory()
        except TypeError:
            return "(computed)"
    elif field.default is PydanticUndefined:
        return "required"
    else:
        value = field.default
    if isinstance(value, BaseModel):
        return "(section)"
    if isinstance(value, list) and value and isinstance(value[0], BaseModel):
        return "(see below)"
    if isinstance(value, dict) and value and isinstance(next(iter(value.values())), BaseModel):
        return ", ".join(sorted(value)) + " (see below)"
    text = json.dumps(value) if not isinstance(value, str) else json.dumps(value)
    return f"`{text}`"


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def config_reference() -> str:
    from rollart.config import RunConfig

    sections: list[tuple[str, type, list[str]]] = []
    seen: set[tuple[str, type]] = set()

    def walk(model: type, path: str) -> None:
        if (path, model) in seen:
            return
        seen.add((path, model))
        rows = []
        nested: list[tuple[str, type]] = []
        for name, field in model.model_fields.items():
            key = f"{path}.{name}" if path else name
            rows.append(f"| `{key}` | {_cell(_type_name(field.annotation))} | "
                        f"{_cell(_default(field))} | {_cell(field.description or '')} |")
            nested += [(key + suffix, sub) for suffix, sub in _models(field.annotation)]
        sections.append((path, model, rows))
        for key, sub in nested:
            walk(sub, key)

    walk(RunConfig, "")
    out = []
    for path, model, rows in sections:
        title = f"`{path}`" if path else "Top level"
        doc = " ".join((model.__doc__ or "").split()) if model.__doc__ and \
            "Usage docs" not in model.__doc__ else ""
        out.append(f"## {title}\n")
        out.append(f"Model `{model.__module__}.{model.__name__}`. {doc}\n".rstrip() + "\n")
        out.append("| key | type | default | description |\n|---|---|---|---|")
        out.extend(rows)
        out.append("")
    return "\n".join(out)


# --------------------------------------------------------------------------------- CLI reference

def cli_reference() -> str:
    import typer.main

    from cli.main import app

    # typer may carry its own copy of click: use the classes of the command it returns.
    root = typer.main.get_command(app)
    context_class = root.context_class
    out: list[str] = []

    def walk(cmd: Any, ctx: Any, depth: int) -> None:
        cmd.rich_markup_mode = None  # plain click help, no rich boxes
        help_text = cmd.get_help(ctx)
        out.append(f"{'#' * min(depth + 2, 5)} `{ctx.command_path}`\n")
        out.append("```text\n" + help_text.rstrip() + "\n```\n")
        if hasattr(cmd, "list_commands"):
            for name in cmd.list_commands(ctx):
                sub = cmd.get_command(ctx, name)
                if sub is None or getattr(sub, "hidden", False):
                    continue
                walk(sub, context_class(sub, info_name=name, parent=ctx, terminal_width=100,
                                        max_content_width=100), depth + 1)

    walk(root, context_class(root, info_name="rollart", terminal_width=100,
                             max_content_width=100), 0)
    return "\n".join(out)


# ---------------------------------------------------------------------------- benchmarks table

def benchmarks_table() -> str:
    rows = ["| benchmark | command | headline (spread) | results file | date |",
            "|---|---|---|---|---|"]
    for title, command, name, extract in BENCHMARKS:
        data = load(name)
        try:
            headline = extract(data)
        except (KeyError, IndexError, TypeError, ValueError, StopIteration) as e:
            # A results file whose format changed: the build says so (fails under --strict).
            log.warning("benchmarks table: results/%s: cannot read the headline (%r)", name, e)
            headline = "(results file unreadable)"
        rows.append(f"| {title} | `{command}` | {_cell(headline)} | `results/{name}` | "
                    f"{committed_date(name, data)} |")
    return "\n".join(rows)


GENERATORS: dict[str, Callable[[], str]] = {
    "config": config_reference, "cli": cli_reference, "benchmarks": benchmarks_table,
}


def on_page_markdown(markdown: str, page: Any = None, config: Any = None, files: Any = None,
                     **_: Any) -> str:
    def replace(match: re.Match) -> str:
        name = match.group(1)
        if name not in GENERATORS:
            log.warning("unknown generated section %r in %s", name, getattr(page, "file", page))
            return match.group(0)
        return GENERATORS[name]()

    return PLACEHOLDER.sub(replace, markdown)



def on_files(files: Any, config: Any, **_: Any) -> Any:
    """The committed plots under results/ (pages show them as `../results/NAME.png`)."""
    from mkdocs.structure.files import File

    for png in sorted((ROOT / "results").glob("sim_cluster_*.png")):
        files.append(File.generated(config, f"results/{png.name}", abs_src_path=str(png)))
    return files


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    print(GENERATORS[sys.argv[1]]())
