"""Helpers for reading a reward event; imported by handler modules, which import nothing else
from rollart (a Lambda worker loads one handler module and what it needs, no more)."""

from __future__ import annotations

from typing import Any


def response_of(event: dict[str, Any]) -> str:
    """The text to score: `response`, else the episode's `final_response` (see reward_event)."""
    text = event.get("response")
    if text is None:
        text = event.get("final_response", "")
    return str(text)
