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


def note(message: str) -> None:
    """A one-off line for the terminal (where to watch, where checkpoints go)."""
    for r in _reporters:
        getattr(r, "note", lambda m: None)(message)


class TerminalTable:
    """Prints a header once, then one aligned row per iteration (works in CI logs too)."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.header_done = False

    def note(self, message: str) -> None:
        print(message, flush=True)

    def __call__(self, row: dict[str, Any]) -> None:
        cols = [k for k, _ in SUMMARY_KEYS]
        if not self.header_done:
            print("  ".join(f"{c:>8}" for c in cols), flush=True)
            self.header_done = True
        cells = []
        for c in cols:
            v = row.get(c, "")
            if c == "iter" and v != "":
                v = f"{int(v) + 1}/{self.total}"
            cells.append(f"{v:>8.3f}" if isinstance(v, float) else f"{v:>8}")
        print("  ".join(cells), flush=True)
