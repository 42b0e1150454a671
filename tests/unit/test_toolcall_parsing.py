"""Tool-call parsing (rollart.envs.toolcall): strict and lenient calls, every malformed and
adversarial shape a policy may emit, and the Qwen-style tool schema for the prompt."""

import json
import random
import time

import pytest

from rollart.envs.calculator import CALCULATE, TOOLS
from rollart.envs.toolcall import (
    MAX_CALL_CHARS,
    ToolCall,
    ToolSpec,
    format_tool_call,
    parse_tool_call,
    tool_response,
    tools_prompt,
)

CALL = '{"name": "calculate", "arguments": {"expression": "123*45"}}'
EXPECTED = ToolCall("calculate", {"expression": "123*45"})


def parse(text):
    return parse_tool_call(text, TOOLS)


@pytest.mark.parametrize("text", [
    f"<tool_call>{CALL}</tool_call>",
    f"<tool_call>\n{CALL}\n</tool_call>",  # Qwen's template puts the JSON on its own line
    f"  <tool_call>{CALL}</tool_call>\n<|im_end|>",
    '<tool_call>{"arguments": {"expression": "123*45"}, "name": "calculate"}</tool_call>',
    '<tool_call>{"name": "calculate", "arguments": {"expression": "123*45"}, "id": 7}</tool_call>',
    '<tool_call>{"name": "calculate", "arguments": {"expression": "123*45", "x": 1}}</tool_call>',
])
def test_strict_calls(text):
    parsed = parse(text)
    assert parsed.ok and parsed.call == EXPECTED and parsed.strict and parsed.error is None


@pytest.mark.parametrize("text", [
    f"Let me compute. <tool_call>{CALL}</tool_call>",  # text before
    f"<tool_call>{CALL}</tool_call> The result will follow.",  # text after
    f"<tool_call>{CALL}</tool_call><tool_call>{CALL.replace('123', '9')}</tool_call>",  # 2 calls
    f"<tool_call>{CALL}",  # cut before the closing tag
    f"<tool_call>{CALL} trailing words</tool_call>",  # text after the JSON inside the block
    f"<tool_call>```json\n{CALL}\n```</tool_call>",  # a code fence
    '<tool_call>{"name": "calculate", "parameters": {"expression": "123*45"}}</tool_call>',
    '<tool_call>{"name": "calculate", "arguments": "{\\"expression\\": \\"123*45\\"}"}'
    "</tool_call>",  # OpenAI style: arguments as a JSON string
])
def test_lenient_calls_are_read_but_not_strict(text):
    parsed = parse(text)
    assert parsed.call == EXPECTED and not parsed.strict and parsed.error is None


def test_multiple_calls_take_the_first():
    second = CALL.replace("123*45", "1+1")
    parsed = parse(f"<tool_call>{CALL}</tool_call>\n<tool_call>{second}</tool_call>")
    assert parsed.call == EXPECTED and parsed.blocks == 2 and not parsed.strict


@pytest.mark.parametrize("text, error", [
    ("", "no <tool_call> found"),
    ("The answer is 5535.", "no <tool_call> found"),
    (CALL, "no <tool_call> found"),  # JSON without the tags
    ("<tool_call></tool_call>", "tool call must be a JSON object"),
    ("<tool_call>calculate(123*45)</tool_call>", "tool call must be a JSON object"),
    ('<tool_call>{"name": "calculate", "arguments": {"expression": "1"</tool_call>',
     "tool call is not valid JSON"),
    ("<tool_call>{'name': 'calculate'}</tool_call>", "tool call is not valid JSON"),
    ('<tool_call>["calculate", "1+1"]</tool_call>', "tool call must be a JSON object"),
    ('<tool_call>{"arguments": {"expression": "1"}}</tool_call>', 'tool call needs a "name"'),
    ('<tool_call>{"name": 3, "arguments": {}}</tool_call>', 'tool call needs a "name"'),
    ('<tool_call>{"name": "python", "arguments": {"code": "1"}}</tool_call>',
     "unknown tool 'python'; available: calculate"),
    ('<tool_call>{"name": "calculate"}</tool_call>', '"arguments" of calculate must be'),
    ('<tool_call>{"name": "calculate", "arguments": [1]}</tool_call>', '"arguments" of calculate'),
    ('<tool_call>{"name": "calculate", "arguments": "1+1"}</tool_call>', '"arguments" of calcu'),
    ('<tool_call>{"name": "calculate", "arguments": {}}</tool_call>',
     'calculate needs the argument "expression"'),
    ('<tool_call>{"name": "calculate", "arguments": {"expr": "1"}}</tool_call>',
     'calculate needs the argument "expression"'),
    ('<tool_call>{"name": "calculate", "arguments": {"expression": 5535}}</tool_call>',
     'argument "expression" of calculate must be a string'),
    ('<tool_call>{"name": "calculate", "arguments": {"expression": true}}</tool_call>',
     'argument "expression" of calculate must be a string'),
    (f"<tool_call><tool_call>{CALL}</tool_call></tool_call>", "nested <tool_call> tags"),
    (f"<tool_call>{{\"a\": <tool_call>{CALL}</tool_call>}}</tool_call>", "nested <tool_call>"),
])
def test_malformed_calls_give_a_short_error(text, error):
    parsed = parse(text)
    assert parsed.call is None and not parsed.strict and not parsed.ok
    assert parsed.error.startswith(error) and len(parsed.error) < 120


def test_unicode_is_kept_or_refused_never_crashes():
    parsed = parse('<tool_call>{"name": "calculate", "arguments": {"expression": "３４×２"}}'
                   "</tool_call>")
    assert parsed.call == ToolCall("calculate", {"expression": "３４×２"}) and parsed.strict
    assert parse('<tool_call>{"name": "calculaté", "arguments": {}}</tool_call>').error \
        == "unknown tool 'calculaté'; available: calculate"
    assert parse("<tool_call>{\"name\": \"\\ud800\"}</tool_call>").error.startswith("unknown")
    assert parse("<tool_call>\x00\ufeff</tool_call>").error.startswith("tool call must be")


def test_huge_and_deep_inputs_are_refused_quickly():
    huge = '<tool_call>{"name": "calculate", "arguments": {"expression": "' + "9" * 5_000_000
    nested = "<tool_call>" + "[" * 100_000 + "</tool_call>"
    long_name = '<tool_call>{"name": "' + "x" * 500 + '", "arguments": {}}</tool_call>'
    deep = "<tool_call>" + '{"a": ' * (MAX_CALL_CHARS // 6) + "1" + "}" * (MAX_CALL_CHARS // 6) \
        + "</tool_call>"
    many_opens = "<tool_call>" * 200_000
    t0 = time.perf_counter()
    assert parse(huge).error == f"tool call too long (over {MAX_CALL_CHARS} characters)"
    assert parse(nested).error.startswith("tool call too long")
    assert parse(long_name).error == f"unknown tool '{'x' * 40}...'; available: calculate"
    assert parse(deep).error is not None  # too long, or not a call: never a RecursionError
    assert parse(many_opens).error.startswith("nested <tool_call>")
    assert time.perf_counter() - t0 < 1.0
    # With the length cap lifted, JSON nested past the interpreter's recursion limit is an
    # error message too, not a RecursionError.
    deeper = "<tool_call>" + '{"a": [' * 100_000 + "</tool_call>"
    assert parse_tool_call(deeper, TOOLS, max_chars=10**7).error == "tool call is not valid JSON"


def test_never_raises_on_random_text():
    pieces = ["<tool_call>", "</tool_call>", "{", "}", "[", "]", '"name"', '"arguments"', ":",
              ",", '"calculate"', '"expression"', '"1+2"', "\\", '"', " ", "\n", "é", "\x00",
              "<answer>", "<|im_end|>", "null", "true", "1e999", "-"]
    rng = random.Random(0)
    for _ in range(3000):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 30)))
        parsed = parse(text)
        assert (parsed.call is None) != (parsed.error is None)
    for junk in [None, 42, b"<tool_call>", ["<tool_call>"]]:
        assert parse(junk).error == "no <tool_call> found"


def test_schema_prompt_and_round_trip():
    schema = CALCULATE.schema()
    assert schema["type"] == "function" and schema["function"]["name"] == "calculate"
    assert schema["function"]["parameters"]["required"] == ["expression"]
    prompt = tools_prompt([CALCULATE])
    assert f"<tools>\n{json.dumps(schema)}\n</tools>" in prompt
    assert "<tool_call></tool_call> XML tags" in prompt
    text = format_tool_call("calculate", {"expression": "2 * (3 + 4)"})
    assert text == ('<tool_call>{"name": "calculate", "arguments": {"expression": "2 * (3 + 4)"}}'
                    "</tool_call>")
    assert parse(text).call == ToolCall("calculate", {"expression": "2 * (3 + 4)"})
    assert tool_response("14") == "<tool_response>\n14\n</tool_response>"


def test_other_tool_schemas_validate_their_own_types():
    tools = {"move": ToolSpec("move", "Move on a grid.", {
        "type": "object", "required": ["steps"],
        "properties": {"steps": {"type": "integer"}, "fast": {"type": "boolean"}}})}
    ok = parse_tool_call('<tool_call>{"name": "move", "arguments": {"steps": 3}}</tool_call>',
                         tools)
    assert ok.call == ToolCall("move", {"steps": 3}) and ok.strict
    for args, error in [('{"steps": "3"}', "must be a integer"),
                        ('{"steps": true}', "must be a integer"),
                        ('{"steps": 1, "fast": 1}', "must be a boolean")]:
        bad = parse_tool_call(f'<tool_call>{{"name": "move", "arguments": {args}}}</tool_call>',
                              tools)
        assert bad.call is None and error in bad.error

