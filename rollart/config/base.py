"""The base of every config model, the one error type config problems raise, run ids, and
`--set key.path=value` overrides."""

from __future__ import annotations

import re
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict

# A run id names a directory in the store and appears in artifacts (markdown) and URLs: a safe
# alphabet, no leading dot (no "..", no hidden files), bounded length.
RUN_ID_RE = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,127}")


class ConfigError(ValueError):
    """A config problem, phrased as one line that names the key and how to fix it."""


def check_run_id(run_id: str, what: str = "run_id") -> str:
    """`run_id` if it is safe as a path component and in markdown; else ConfigError."""
    if not isinstance(run_id, str) or not RUN_ID_RE.fullmatch(run_id):
        raise ConfigError(f"{what} {str(run_id)[:80]!r} is not a valid run id: use 1-128 of "
                          "A-Z a-z 0-9 . _ - and do not start with a dot")
    return run_id


class _Strict(BaseModel):
    # allow_inf_nan=False: `train.lr=.inf` or a NaN penalty is refused, never trained with.
    # use_attribute_docstrings: the docstring under each field is its description (the docs'
    # config reference is generated from them; tests/unit/test_config_descriptions.py).
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False,
                              use_attribute_docstrings=True)


def _parse_value(text: str) -> Any:
    """`--set a.b=c` values are YAML scalars/lists: 3 -> int, 1e-3 -> float, [a,b] -> list."""
    return yaml.safe_load(text) if text != "" else ""


def _override_error(item: str, why: str) -> ConfigError:
    return ConfigError(f"override {item[:120]!r}: {why}")


def check_overrides(overrides: list[str]) -> None:
    """What can be checked without the config they will apply to (a deployment's): the
    `key.path=value` form, YAML values, and no nan/inf anywhere in a value."""
    import math

    def finite(v: Any) -> bool:
        if isinstance(v, float):
            return math.isfinite(v)
        if isinstance(v, list):
            return all(map(finite, v))
        if isinstance(v, dict):
            return all(map(finite, v.values()))
        return True

    for item in overrides:
        if not isinstance(item, str):
            raise ConfigError(f"override {item!r} must be a key.path=value string")
        apply_overrides({}, [item])  # form and YAML
        if not finite(_parse_value(item.partition("=")[2])):
            raise _override_error(item, "must be a finite number, not nan or inf (give a "
                                  "plain number, e.g. 0.001)")


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply `key.path=value` overrides; every problem is one ConfigError line (never an
    IndexError traceback): a list index must exist, a section must be a mapping."""
    for item in overrides:
        key, eq, raw = item.partition("=")
        parts = key.strip().split(".")
        if not eq or not all(parts):
            raise ConfigError(f"override {item[:120]!r} must look like key.path=value")
        try:
            value = _parse_value(raw)
        except yaml.YAMLError:
            raise _override_error(item, "the value is not valid YAML (quote strings with "
                                  "special characters)") from None
        node: Any = data
        for i, part in enumerate(parts):
            last = i == len(parts) - 1
            if isinstance(node, list):
                if not part.isdigit() or int(part) >= len(node):
                    raise _override_error(item, f"{'.'.join(parts[:i + 1])}: no list entry "
                                          f"{part!r} (the list has {len(node)}, from 0)")
                if last:
                    node[int(part)] = value
                else:
                    node = node[int(part)]
            elif isinstance(node, dict):
                if last:
                    node[part] = value
                else:
                    if node.get(part) is None:
                        node[part] = {}
                    node = node[part]
            else:
                raise _override_error(item, f"{'.'.join(parts[:i])} is not a section")
    return data
