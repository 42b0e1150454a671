"""Format reward: does the response follow the `<tag>...</tag>` answer format?

Graded rather than 0/1 so that a random-init policy has a slope to climb: each required tag
pair that is present earns its share of 0.5, and only an exact match of the whole pattern earns
1.0 (extra text outside the tags costs the other half).
"""

from __future__ import annotations

import re
from typing import Any

from rollart.rewards.events import response_of

DEFAULT_TAGS = ("answer",)


def format_reward(event: dict[str, Any], context: Any = None) -> dict[str, Any]:
    """event: {"response" | "final_response": str, "tags": [str] (default ["answer"]),
    "pattern": optional full-match regex (default: the tags in order, whitespace between)}"""
    text = response_of(event).strip()
    tags = [str(t) for t in event.get("tags", DEFAULT_TAGS)]
    pattern = event.get("pattern") or r"\s*".join(
        rf"<{re.escape(t)}>(?:(?!<{re.escape(t)}>).)+?</{re.escape(t)}>" for t in tags
    )
    exact = re.fullmatch(pattern, text, flags=re.DOTALL) is not None
    present = sum(
        1 for t in tags if re.search(rf"<{re.escape(t)}>.+?</{re.escape(t)}>", text, re.DOTALL)
    )
    partial = 0.5 * present / max(len(tags), 1)
    return {
        "reward": 1.0 if exact else partial,
        "format_exact": float(exact),
        "tags_present": float(present),
    }
