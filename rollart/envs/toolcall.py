"""Qwen-style tool calls in model text: tool schemas for the prompt, a lenient robust parser.

A model calls a tool by writing (Qwen 2.5 / Hermes convention, which SmolLM2's instruct data
also uses)::

    <tool_call>{"name": "calculate", "arguments": {"expression": "123*45"}}</tool_call>

and the env answers with a user message ``<tool_response>\\n5535\\n</tool_response>``.

`parse_tool_call` is a pure function that never raises, whatever the text (policy samples are
adversarial by accident: cut-off JSON, tags inside tags, megabytes of digits, unknown tools).
It returns a `ParsedToolCall` with either a `ToolCall` or a short `error` meant to be fed back
to the model as the next observation, plus `strict` (the format was followed exactly: one
``<tool_call>`` block, only whitespace around it, the JSON object alone inside it).

Rules (each tested in tests/unit/test_toolcall_parsing.py):
- the *first* ``<tool_call>`` block is read; later ones are ignored (not strict), because a
  turn is one action and the engine's stop string (``</tool_call>``) ends it at the first one;
- text before or after the block, a missing ``</tool_call>`` at the end of the text, text after
  the JSON object inside the block, a ```` ```json ```` fence, ``"parameters"`` instead of
  ``"arguments"``, and arguments given as a JSON *string* are tolerated (not strict);
- extra keys at the top level or among the arguments are ignored, and arguments the schema
  does not declare are dropped (a call that says more than it must still says what it must);
- errors: no block; a ``<tool_call>`` nested inside the block; a block longer than `max_chars`
  (checked before any JSON parsing, so cost is bounded); not JSON; not an object; no string
  ``"name"``; an unknown tool; arguments that are not an object; a required argument missing
  or of the wrong JSON type.

Sampling only well-formed calls (`tasks[].constrained`) is the job of the token grammar in
rollart.action_grammar, fed by an env's `action_grammar` (rollart.envs.calculator).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
TOOL_RESPONSE_OPEN, TOOL_RESPONSE_CLOSE = "<tool_response>", "</tool_response>"
END_TOKENS = ("<|im_end|>", "<|endoftext|>")
MAX_CALL_CHARS = 1000  # a block longer than this is refused unparsed
MAX_NAME_ECHO = 40  # characters of an unknown tool name quoted back in the error
_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,), "integer": (int,), "number": (int, float), "boolean": (bool,),
    "object": (dict,), "array": (list,),
}


@dataclass(frozen=True)
class ToolSpec:
    """One tool as the model sees it: a name, what it does, a JSON schema for its arguments."""

    name: str
    description: str
    parameters: dict[str, Any] = field(default_factory=dict)

    def schema(self) -> dict[str, Any]:
        """The OpenAI/Qwen function schema: ``{"type": "function", "function": {...}}``."""
        return {"type": "function", "function": {
            "name": self.name, "description": self.description, "parameters": self.parameters}}


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class ParsedToolCall:
    """What `parse_tool_call` read: a call, or an error message for the model (never both)."""

    call: ToolCall | None
    error: str | None
    strict: bool = False  # exactly one block, the JSON object alone, nothing around it
    blocks: int = 0  # number of `<tool_call>` opening tags in the text

    @property
    def ok(self) -> bool:
        return self.call is not None


def strip_end_tokens(text: str) -> str:
    """`text` without trailing end-of-turn tokens (a completion that ended on eos carries
    `<|im_end|>` in its decoded text; that must not cost the strict format)."""
    text = text.rstrip()
    while text.endswith(END_TOKENS):
        text = text[: -len(next(t for t in END_TOKENS if text.endswith(t)))].rstrip()
    return text


def tools_prompt(tools: list[ToolSpec]) -> str:
    """The tool section of a system prompt in Qwen 2.5's chat-template wording, so a model
    trained on that template sees the convention it knows."""
    sigs = "\n".join(json.dumps(t.schema()) for t in tools)
    return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n"
            f"<tools>\n{sigs}\n</tools>\n\n"
            "For each function call, return a json object with function name and arguments "
            "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
            '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')


def format_tool_call(name: str, arguments: Mapping[str, Any]) -> str:
    """The strict text of one call (one-shot examples, tests, scripted policies)."""
    body = json.dumps({"name": name, "arguments": dict(arguments)})
    return f"{TOOL_CALL_OPEN}{body}{TOOL_CALL_CLOSE}"


def tool_response(content: str) -> str:
    """The observation that answers a call (Qwen's `<tool_response>` block)."""
    return f"{TOOL_RESPONSE_OPEN}\n{content}\n{TOOL_RESPONSE_CLOSE}"


def parse_tool_call(text: Any, tools: Mapping[str, ToolSpec],
                    max_chars: int = MAX_CALL_CHARS) -> ParsedToolCall:
    """Read the first tool call in `text` (rules in the module docstring). Never raises."""
    if not isinstance(text, str):
        return ParsedToolCall(None, "no <tool_call> found")
    text = strip_end_tokens(text)
    start = text.find(TOOL_CALL_OPEN)
    blocks = text.count(TOOL_CALL_OPEN)
    if start < 0:
        return ParsedToolCall(None, "no <tool_call> found")
    body_start = start + len(TOOL_CALL_OPEN)
    end = text.find(TOOL_CALL_CLOSE, body_start)
    body = text[body_start:end] if end >= 0 else text[body_start:]
    if TOOL_CALL_OPEN in body:
        return ParsedToolCall(None, "nested <tool_call> tags: write one call, then stop",
                              blocks=blocks)
    if len(body) > max_chars:
        return ParsedToolCall(None, f"tool call too long (over {max_chars} characters)",
                              blocks=blocks)
    obj, clean, error = _json_object(body)
    if error is not None:
        return ParsedToolCall(None, error, blocks=blocks)
    call, error, exact = _check_call(obj, tools)
    if call is None:
        return ParsedToolCall(None, error, blocks=blocks)
    after = text[end + len(TOOL_CALL_CLOSE):] if end >= 0 else ""
    strict = (clean and exact and end >= 0 and blocks == 1 and not text[:start].strip()
              and not after.strip())
    return ParsedToolCall(call, None, strict=strict, blocks=blocks)


def _json_object(body: str) -> tuple[Any, bool, str | None]:
    """(decoded JSON value, the body held the value alone, error message or None)."""
    stripped = body.strip()
    fenced = stripped.startswith("```")
    if fenced:  # ```json ... ``` around the object
        stripped = stripped.removeprefix("```json").removeprefix("```").removesuffix("```")
        stripped = stripped.strip()
    if not stripped.startswith("{"):
        return None, False, 'tool call must be a JSON object: {"name": ..., "arguments": {...}}'
    try:
        obj, used = json.JSONDecoder().raw_decode(stripped)
    except (ValueError, RecursionError):
        return None, False, "tool call is not valid JSON"
    return obj, not fenced and not stripped[used:].strip(), None


def _check_call(obj: Any, tools: Mapping[str, ToolSpec]) -> tuple[ToolCall | None, str, bool]:
    """(call or None, error message, the call used the exact field names and types)."""
    if not isinstance(obj, dict):
        return None, 'tool call must be a JSON object: {"name": ..., "arguments": {...}}', False
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return None, 'tool call needs a "name" string', False
    if name not in tools:
        shown = name[:MAX_NAME_ECHO] + ("..." if len(name) > MAX_NAME_ECHO else "")
        return None, f"unknown tool {shown!r}; available: {', '.join(sorted(tools))}", False
    exact = "arguments" in obj
    args = obj.get("arguments", obj.get("parameters"))
    if isinstance(args, str):  # OpenAI style: the arguments as a JSON string
        exact = False
        try:
            args = json.loads(args)
        except (ValueError, RecursionError):
            return None, f'"arguments" of {name} must be a JSON object', False
    if not isinstance(args, dict):
        return None, f'"arguments" of {name} must be a JSON object', False
    props = tools[name].parameters.get("properties", {})
    for key in tools[name].parameters.get("required", []):
        if key not in args:
            return None, f'{name} needs the argument "{key}"', False
    for key, value in args.items():
        kinds = _JSON_TYPES.get(str(props.get(key, {}).get("type", "")))
        if kinds is not None and (not isinstance(value, kinds) or
                                  (isinstance(value, bool) and bool not in kinds)):
            return None, f'argument "{key}" of {name} must be a {props[key]["type"]}', False
    if props:  # undeclared arguments are dropped: the tool never sees them
        args = {key: value for key, value in args.items() if key in props}
    return ToolCall(name, args), "", exact

