"""Per-iteration progress reporting: a plain log line by default, a rich table in a terminal.

The flow calls `report(row)`; the CLI installs a terminal reporter for runs it starts itself.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from rollart.metrics import SUMMARY_KEYS

Reporter = Callable[[dict[str, Any]], None]
_reporters: list[Reporter] = []
log = logging.getLogger("rollart")


def install(reporter: Reporter) -> None:
    _reporters.append(reporter)


def clear() -> None:
    _reporters.clear()


def format_row(row: dict[str, Any]) -> str:
    return "  ".join(f"{k}={row[k]}" for k, _ in SUMMARY_KEYS if row.get(k, "") != "")


def report(row: dict[str, Any]) -> None:
    for r in _reporters:
        r(row)


class TerminalTable:
    """Prints a header once, then one aligned row per iteration (works in CI logs too)."""

    def __init__(self, total: int) -> None:
        from rich.console import Console

        self.console = Console(highlight=False)
        self.total = total
        self.header_done = False

    def __call__(self, row: dict[str, Any]) -> None:
        cols = [k for k, _ in SUMMARY_KEYS]
        if not self.header_done:
            self.console.print("  ".join(f"{c:>8}" for c in cols), style="bold")
            self.header_done = True
        cells = []
        for c in cols:
            v = row.get(c, "")
            cells.append(f"{v:>8}" if not isinstance(v, float) else f"{v:>8.3f}")
        self.console.print("  ".join(cells))
