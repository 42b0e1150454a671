"""Prefect artifacts of a run: what the UI shows on the flow run's Artifacts tab.

- `{run_id}-progress`  progress artifact, updated every iteration;
- `{run_id}-metrics`   table artifact, one row per iteration (refreshed every `refresh_every`);
- `{run_id}-curves`    markdown artifact with the reward and success curves as an inline SVG
                       image (the Prefect 3.9 UI renders `![..](data:image/svg+xml;base64,..)`
                       in markdown artifacts; the same SVG is written to the store as
                       `curves.svg`);
- `{run_id}-checkpoints` markdown artifact listing checkpoints (links where the store has an
                       http endpoint, paths otherwise) and the command that evaluates one.

They are attached to the run a person started (the `train` flow run, parent of the
`iterations` subflow that creates them), so its Artifacts tab shows them. Keys hold only
lowercase letters, digits and dashes (Prefect's rule), so they also appear, versioned, on the
UI's Artifacts page.
"""

from __future__ import annotations

import base64
import html
import json
import math
from collections.abc import Sequence
from typing import Any
from uuid import UUID

from prefect.artifacts import update_progress_artifact

CURVES = (("reward/mean", "reward (mean)", "#2563eb"),
          ("rollout/success_rate", "success (train)", "#16a34a"),
          ("eval/success_rate", "success (greedy eval)", "#ea580c"))


def artifact_key(run_id: str, what: str) -> str:
    key = "".join(c if c.isalnum() else "-" for c in f"{run_id}-{what}".lower())
    while "--" in key:
        key = key.replace("--", "-")
    return key.strip("-")[:100]


# ---- chart -----------------------------------------------------------------------------------
def _panel(series: list[tuple[str, str, list[tuple[float, float]]]], x0: float, y0: float,
           w: float, h: float, xlim: tuple[float, float], ylim: tuple[float, float] | None,
           title: str) -> list[str]:
    pts = [p for _, _, s in series for p in s]
    if ylim is None:  # data range, padded, at least 0.2 wide
        lo, hi = min(y for _, y in pts), max(y for _, y in pts)
        pad = max(0.1 * (hi - lo), (0.2 - (hi - lo)) / 2, 0.0)
        lo, hi = lo - pad, hi + pad
    else:
        lo, hi = ylim
    xmin, xmax = xlim

    def sx(x: float) -> float:
        return x0 + w * ((x - xmin) / (xmax - xmin) if xmax > xmin else 0.5)

    def sy(y: float) -> float:
        return y0 + h - h * (y - lo) / (hi - lo)

    out = [f'<rect x="{x0}" y="{y0}" width="{w}" height="{h}" fill="#ffffff" stroke="#d4d4d8"/>',
           f'<text x="{x0 + 6}" y="{y0 + 14}" font-weight="bold">{html.escape(title)}</text>']
    ticks = sorted({xmin, xmax, *(round(xmin + f * (xmax - xmin)) for f in (0.25, 0.5, 0.75))})
    for t in ticks:
        out.append(f'<text x="{sx(t):.1f}" y="{y0 + h + 14}" text-anchor="middle">{t:g}</text>')
    for frac in (0.0, 0.5, 1.0):
        v = lo + frac * (hi - lo)
        y = sy(v)
        out.append(f'<line x1="{x0}" y1="{y:.1f}" x2="{x0 + w}" y2="{y:.1f}" stroke="#f4f4f5"/>')
        out.append(f'<text x="{x0 - 6}" y="{y + 4:.1f}" text-anchor="end">{v:.3g}</text>')
    for label, color, s in series:
        if not s:
            continue
        path = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in s)
        if len(s) > 1:
            out.append(f'<polyline fill="none" stroke="{color}" stroke-width="2" '
                       f'points="{path}"/>')
        out += [f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="3" fill="{color}">'
                f"<title>{html.escape(label)} @ {int(x)}: {y:.3f}</title></circle>"
                for x, y in s]
    return out


def curve_svg(history: Sequence[dict[str, Any]], title: str = "") -> str:
    """Two panels over iterations: mean reward (auto scale) and success rates in [0, 1]."""
    def series(key: str) -> list[tuple[float, float]]:
        return [(float(m.get("version", i + 1)), float(m[key])) for i, m in enumerate(history)
                if isinstance(m.get(key), int | float) and math.isfinite(m[key])]

    xs = [float(m.get("version", i + 1)) for i, m in enumerate(history)] or [1.0]
    xlim = (min(xs), max(xs))
    w, h, left, top = 640, 430, 56, 36
    pw, ph = w - left - 20, 140
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" '
             f'viewBox="0 0 {w} {h}" font-family="sans-serif" font-size="11" fill="#3f3f46">',
             f'<rect width="{w}" height="{h}" fill="#fafafa"/>',
             f'<text x="{left}" y="20" font-size="14" font-weight="bold">'
             f"{html.escape(title)}</text>"]
    (rk, rl, rc), *succ = CURVES
    if series(rk):
        parts += _panel([(rl, rc, series(rk))], left, top, pw, ph, xlim, None, "mean reward")
    parts += _panel([(lab, col, series(k)) for k, lab, col in succ], left, top + ph + 50,
                    pw, ph, xlim, (0.0, 1.0), "success rate")
    parts.append(f'<text x="{left + pw / 2}" y="{h - 8}" text-anchor="middle">'
                 "iteration (policy version)</text>")
    x = left
    for _, label, color in CURVES:  # legend
        parts.append(f'<rect x="{x}" y="{top + ph + 22}" width="10" height="10" '
                     f'fill="{color}"/><text x="{x + 14}" y="{top + ph + 31}">{label}</text>')
        x += 170
    parts.append("</svg>")
    return "".join(parts)


def curve_markdown(run_id: str, history: Sequence[dict[str, Any]]) -> str:
    svg = curve_svg(history, f"{run_id}: reward and success")
    data = base64.b64encode(svg.encode()).decode()
    last = history[-1] if history else {}
    cells = [f"{label} **{last[k]:.3f}**" for k, label, _ in CURVES
             if isinstance(last.get(k), int | float)]
    return (f"## Reward and success: `{run_id}`\n\n"
            f"![reward and success curves of {run_id}](data:image/svg+xml;base64,{data})\n\n"
            f"After {len(history)} iteration(s): {', '.join(cells) or 'no metrics yet'}.\n")


# ---- checkpoints -----------------------------------------------------------------------------
def _http_link(store_url: str, path: str, endpoint_url: str | None) -> str | None:
    """A browsable URL for a checkpoint in S3: the AWS console for AWS S3, the endpoint's URL
    for another S3 server (SeaweedFS, MinIO). Local paths get none (the UI links http only)."""
    if not store_url.startswith("s3://"):
        return None
    key = path.removeprefix("s3://").removeprefix("s3a://").strip("/")
    if endpoint_url:
        return f"{endpoint_url.rstrip('/')}/{key}/"
    bucket, _, prefix = key.partition("/")
    return f"https://s3.console.aws.amazon.com/s3/buckets/{bucket}?prefix={prefix}/"


def checkpoints_markdown(run_id: str, store_url: str, checkpoints: Sequence[dict[str, Any]],
                         extra: Sequence[tuple[str, str]] = (),
                         endpoint_url: str | None = None) -> str:
    lines = [f"## Checkpoints of `{run_id}`", "", f"Store: `{store_url}`", "",
             "| step | version | size | location |", "|---:|---:|---:|---|"]
    for c in checkpoints:
        path = str(c.get("path", ""))
        link = _http_link(store_url, path, endpoint_url)
        where = f"[{path}]({link})" if link else f"`{path}`"
        size = f"{c.get('bytes', 0) / 1e6:.2f} MB" if c.get("bytes") else ""
        lines.append(f"| {c.get('step', '')} | {c.get('version', '')} | {size} | {where} |")
    if not checkpoints:
        lines.append("| - | - | - | no checkpoint written |")
    lines += ["", *(f"- {name}: `{value}`" for name, value in extra)]
    if checkpoints:
        lines += ["", "Evaluate the latest one on held-out seeds:", "",
                  f"```\nrollart submit --deployment evaluate --param run_id={run_id} --wait\n```"]
    return "\n".join(lines) + "\n"


# ---- the run's artifacts ---------------------------------------------------------------------
def _finite(v: Any) -> Any:
    return None if isinstance(v, float) and not math.isfinite(v) else v


def create_artifact(kind: str, data: Any, key: str, description: str,
                    flow_run_id: str | UUID | None = None) -> UUID:
    """Create an artifact on `flow_run_id` (default: the current flow run)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import ArtifactCreate
    from prefect.runtime import flow_run

    if kind == "table":
        data = json.dumps([{k: _finite(v) for k, v in r.items()} for r in data])
    target = flow_run_id or flow_run.get_id()
    with get_client(sync_client=True) as client:
        art = client.create_artifact(ArtifactCreate(
            key=key, type=kind, description=description, data=data,
            flow_run_id=UUID(str(target)) if target else None))
    return art.id


def run_target() -> str | None:
    """The flow run to attach a run's artifacts to: the parent of a subflow, else this run."""
    from prefect.runtime import flow_run

    return flow_run.get_parent_flow_run_id() or flow_run.get_id()


class RunArtifacts:
    """Creates and refreshes the artifacts of one training run (call from inside a flow)."""

    def __init__(self, run_id: str, total: int, refresh_every: int = 10,
                 flow_run_id: str | None = None) -> None:
        self.run_id, self.total, self.refresh_every = run_id, max(total, 1), refresh_every
        self.target = flow_run_id or run_target()
        self.rows: list[dict[str, Any]] = []
        self.history: list[dict[str, Any]] = []
        self.checkpoints: list[dict[str, Any]] = []
        self.progress_id = self._create("progress", 0.0, "progress",
                                        f"Training progress of {run_id}")

    def _create(self, kind: str, data: Any, what: str, description: str) -> UUID:
        return create_artifact(kind, data, artifact_key(self.run_id, what), description,
                               self.target)

    def iteration(self, step: int, row: dict[str, Any], metrics: dict[str, Any],
                  checkpoint: dict[str, Any] | None = None) -> None:
        self.rows.append(row)
        self.history.append(dict(metrics))
        if checkpoint is not None:
            gone = set(checkpoint.get("removed") or [])
            self.checkpoints = [c for c in self.checkpoints if c["step"] not in gone]
            self.checkpoints.append({"step": step, "version": step, **checkpoint})
        update_progress_artifact(self.progress_id, min(100.0, 100.0 * step / self.total))
        if self.refresh_every and step % self.refresh_every == 0 and step < self.total:
            self.metrics_table()
            self.curves()

    def metrics_table(self) -> UUID:
        return self._create("table", self.rows, "metrics",
                            f"Per-iteration metrics of {self.run_id}")

    def curves(self, store: Any = None) -> UUID:
        if store is not None:  # the same chart as a file next to the run's metrics
            store.write_text("curves.svg", curve_svg(self.history, f"{self.run_id}"))
        return self._create("markdown", curve_markdown(self.run_id, self.history), "curves",
                            "Reward and success curves")

    def finish(self, store: Any) -> None:
        self.metrics_table()
        self.curves(store)
        extra = [("metrics", store.path("metrics.jsonl")), ("curves", store.path("curves.svg"))]
        endpoint = getattr(store.fs, "endpoint_url", None) if not store.local else None
        text = checkpoints_markdown(self.run_id, store.url, self.checkpoints, extra, endpoint)
        self._create("markdown", text, "checkpoints", "Checkpoints and metrics")
