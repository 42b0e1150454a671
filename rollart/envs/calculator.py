"""Calculator tool use: multi-turn arithmetic whose operands make mental arithmetic hopeless.

`reset(seed)` draws a problem such as "Compute 347 * 268." (same seed, same problem). Each turn
the model either calls the `calculate` tool (Qwen convention, see rollart.envs.toolcall)::

    <tool_call>{"name": "calculate", "arguments": {"expression": "347 * 268"}}</tool_call>

and gets ``<tool_response>\\n92996\\n</tool_response>`` back, or ends the episode with
`<answer>N</answer>`: reward 1 if N is the exact result, else 0. No answer within `max_turns`
turns: reward 0 (truncated). Why: the smallest honest agentic loop (act, observe a tool result,
act on it) with a verifiable reward; a 3-digit product is out of reach for a 135M model's
mental arithmetic, so reward needs the tool.

Per turn, whichever comes first in the text is the action: a `<tool_call>` block or an
`<answer>` tag (a trailing `<|im_end|>` is ignored). Format penalty as in rollart.envs.guess: 0
for a strict turn (the block or tag alone); a lenient one (text around it, a second call, ...:
see toolcall's rules) is executed and pays half under `format_credit: graded`, nothing under
`action`; a malformed one (no block or tag, broken JSON, unknown tool, missing argument, an
answer that is not an integer) pays all of it, uses the turn, and the observation says what is
wrong and how a call looks. Parser "strict" executes strict turns only. A well-formed call with
an expression the tool refuses (`safe_eval`) is not a format error: the tool answers
"error: ...", as a real tool would.

Observations are the tool's `<tool_response>` block or the feedback text alone, without a turn
counter (a 135M model copies stray numbers: see rollart.envs.guess); the system prompt says how
many turns there are.

`env_kwargs` (all optional): `digits` (3, or one per operand e.g. [3, 2]), `ops` (["*"], drawn
per operator from "+", "-", "*"), `terms` (2).

Constrained decoding: SmolLM2-135M-Instruct never completes this task unconstrained (0 of 32
episodes at T=0.7 with `max_turns: 3`, 2 % of turns a call; also 0 of 16 when the feedback
spelled the call out for the problem: it chats about code), and 25 % of episodes under the
token grammar below (results/agentic_base_rate.json). The strict turns (a call with any
expression, or any integer) are too many to list as `action_names` for the answer trie, so
`action_names` is empty and `action_grammar` describes them as a segment grammar instead:
`constrained: true` samples under it (rollart.action_grammar; the HF engine walks it per token,
vLLM samples from its token bag). A run's `engine.stop` should hold `</tool_call>` beside
`</answer>`, so an unconstrained turn ends at its call (under the grammar, end of turn is the
only token after `</tool_call>` anyway).
"""

from __future__ import annotations

import ast
import operator
import random
import unicodedata
from collections.abc import Callable
from typing import Any

from rollart.action_grammar import Alternatives
from rollart.config import TaskConfig
from rollart.envs.guess import answer_tags, read_integer
from rollart.envs.parsing import ParserMode, check_turn_settings
from rollart.envs.registry import register_env
from rollart.envs.toolcall import (
    ToolSpec,
    format_tool_call,
    parse_tool_call,
    strip_end_tokens,
    tool_response,
    tools_prompt,
)

MAX_EXPR_CHARS = 200  # longer expressions are refused before parsing
MAX_LITERAL = 10**15  # largest number literal accepted
MAX_MAGNITUDE = 10**30  # largest |value| of any intermediate result
CALCULATE = ToolSpec(
    name="calculate",
    description="Evaluate an arithmetic expression with + - * / // % and parentheses; "
                "returns the exact result.",
    parameters={"type": "object",
                "properties": {"expression": {"type": "string",
                                              "description": "e.g. \"(12 + 3) * 45\""}},
                "required": ["expression"]},
)
TOOLS = {CALCULATE.name: CALCULATE}
OPS = ("+", "-", "*")
EXPR_CHARS = "0123456789+-*/() "  # the expression alphabet of the constrained grammar
_BINOPS: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
    ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
}
_SIGNS = str.maketrans("×÷−", "*/-")
_FORMAT_HINT = ("Call the calculator as " + format_tool_call("calculate", {"expression": "..."})
                + " or give the final answer as <answer>N</answer>.")


class ToolError(ValueError):
    """The calculator refused an expression (the message is shown to the model)."""


def safe_eval(expression: str) -> int | float:
    """Evaluate arithmetic without `eval`: `ast` nodes limited to number literals, + - * / // %,
    unary +/- and parentheses; bounded length, literals and intermediate magnitudes, so no
    input can run long or allocate much. Raises ToolError with a short reason."""
    if not isinstance(expression, str):
        raise ToolError("expression must be a string")
    if len(expression) > 4 * MAX_EXPR_CHARS:  # before any O(n) work on it
        raise ToolError(f"expression too long (over {MAX_EXPR_CHARS} characters)")
    # NFKC: full-width digits and operators become ASCII; then the usual math signs.
    text = unicodedata.normalize("NFKC", expression).translate(_SIGNS).strip().rstrip("=")
    text = text.strip()
    if not text:
        raise ToolError("empty expression")
    if len(text) > MAX_EXPR_CHARS:
        raise ToolError(f"expression too long (over {MAX_EXPR_CHARS} characters)")
    if "**" in text:
        raise ToolError("the ** operator is not supported")
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        raise ToolError("invalid expression") from None
    try:
        return _value(tree.body)
    except ZeroDivisionError:
        raise ToolError("division by zero") from None
    except RecursionError:
        raise ToolError("expression nested too deeply") from None


def _value(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant):
        value = node.value
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ToolError("only numbers and + - * / // % ( ) are allowed")
        if abs(value) > MAX_LITERAL or value != value:
            raise ToolError("number too large")
        return value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _value(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        value = _BINOPS[type(node.op)](_value(node.left), _value(node.right))
        if abs(value) > MAX_MAGNITUDE or value != value:
            raise ToolError("result too large")
        return value
    raise ToolError("only numbers and + - * / // % ( ) are allowed")


def calculate(expression: str) -> str:
    """The tool's reply: the exact result ("92996", "2.5"), or "error: <reason>"."""
    try:
        value = safe_eval(expression)
    except ToolError as err:
        return f"error: {err}"
    if isinstance(value, float):
        return str(int(value)) if value.is_integer() and abs(value) < MAX_LITERAL \
            else f"{value:.12g}"
    return str(value)


class CalculatorEnv:
    """One arithmetic problem per episode, a calculator tool, reward for the exact answer."""

    def __init__(self, digits: int | list[int] = 3, ops: list[str] | None = None, terms: int = 2,
                 max_turns: int = 4, format_penalty: float = -0.1,
                 parser: ParserMode = "lenient", format_credit: str = "graded") -> None:
        ops = list(ops or ["*"])
        if not ops or any(o not in OPS for o in ops):
            raise ValueError(f"calculator env_kwargs.ops must be a non-empty subset of {OPS}")
        widths = list(digits) if isinstance(digits, (list, tuple)) else [int(digits)] * terms
        if terms < 2 or len(widths) != terms or any(not 1 <= int(d) <= 6 for d in widths):
            raise ValueError("calculator needs terms >= 2 and 1..6 digits per operand "
                             f"(one entry per operand), got terms={terms}, digits={digits}")
        check_turn_settings(max_turns, parser, format_credit)
        self.widths, self.ops = [int(d) for d in widths], ops
        self.max_turns, self.format_penalty = max_turns, float(format_penalty)
        self.parser: ParserMode = parser
        self.format_credit = format_credit
        self.problem, self.answer = "", 0
        self._turn, self._done = 0, True

    # -- Env protocol -------------------------------------------------------------------
    @property
    def system_prompt(self) -> str:
        call = format_tool_call("calculate", {"expression": "12 * 34"})
        return ("You solve arithmetic problems with a calculator tool, then give the final "
                f"answer as <answer>N</answer>. You have {self.max_turns} turns.\n\n"
                f"{tools_prompt([CALCULATE])}\n\n"
                f"Example:\nuser: Compute 12 * 34.\nassistant: {call}\n"
                f"user: {tool_response('408')}\nassistant: <answer>408</answer>")

    @property
    def action_names(self) -> list[str]:
        return []  # free-form calls and answers: no finite action vocabulary

    @property
    def action_grammar(self) -> Alternatives:
        """Every strict turn as a segment grammar (rollart.action_grammar): the call with an
        expression of digits, operators, parentheses and spaces, or the integer answer (at
        most 40 and 12 characters), what `constrained: true` samples under."""
        call = format_tool_call("calculate", {"expression": "EXPR"}).split("EXPR")
        return [[call[0], (EXPR_CHARS, 1, 40), call[1]],
                ["<answer>", ("0123456789", 1, 12), "</answer>"]]

    def reset(self, seed: int) -> tuple[str, dict[str, Any]]:
        self.problem, self.answer = self.generate(int(seed))
        self._turn, self._done = 0, False
        return f"Compute {self.problem}.", {"seed": int(seed), "answer": str(self.answer),
                                            "max_turns": self.max_turns}

    def step(self, action_text: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        if self._done:
            raise RuntimeError("step() called before reset() or after the episode ended")
        self._turn += 1
        kind, value, strict, obs = self._act(action_text if isinstance(action_text, str) else "")
        if strict:
            penalty = 0.0
        elif kind is None:
            penalty = self.format_penalty
        else:
            penalty = 0.5 * self.format_penalty if self.format_credit == "graded" else 0.0
        success = kind == "answer" and value == self.answer
        terminated = kind == "answer"
        truncated = not terminated and self._turn >= self.max_turns
        self._done = terminated or truncated
        task_reward = 1.0 if success else 0.0
        # The action as stored in the trajectory's turns: the expression cut to 60 characters.
        action = None if kind is None else f"{kind}({str(value)[:60]})"
        info = {"action": action, "format_ok": strict,
                "valid": kind is not None, "success": success, "task_reward": task_reward,
                "format_penalty": penalty, "turn": self._turn, "answer": str(self.answer),
                "tool_call": kind == "calculate"}
        return ("" if self._done else obs), task_reward + penalty, terminated, truncated, info

    def close(self) -> None:
        self._done = True

    # -- helpers ------------------------------------------------------------------------
    def _act(self, text: str) -> tuple[str | None, Any, bool, str]:
        """(kind "calculate" / "answer" / None, its value, strict, observation)."""
        text = strip_end_tokens(text)
        call_at, tags = text.find("<tool_call>"), answer_tags(text)
        if call_at >= 0 and (not tags or call_at < tags[0][0]):
            parsed = parse_tool_call(text, TOOLS)
            if parsed.call is None or (self.parser == "strict" and not parsed.strict):
                why = parsed.error or "write the call alone, nothing around it"
                return None, None, False, f"Invalid tool call: {why}. {_FORMAT_HINT}"
            expression = str(parsed.call.arguments["expression"])
            return "calculate", expression, parsed.strict, tool_response(calculate(expression))
        if tags:
            start, end, content = tags[0]
            value = read_integer(content)
            strict = text.count("<answer>") == 1 and not text[:start].strip() \
                and not text[end:].strip()
            if value is None or (self.parser == "strict" and not strict):
                return None, None, False, ("The answer must be a whole number, alone: "
                                           "<answer>N</answer>.")
            return "answer", value, strict, ""
        return None, None, False, _FORMAT_HINT

    def generate(self, seed: int) -> tuple[str, int]:
        """(problem text, exact integer answer), deterministic in `seed`."""
        rng = random.Random(seed)
        nums = [rng.randint(10 ** (d - 1) if d > 1 else 0, 10**d - 1) for d in self.widths]
        ops = [rng.choice(self.ops) for _ in range(len(nums) - 1)]
        if len(nums) == 2 and ops[0] == "-" and nums[0] < nums[1]:
            nums = [nums[1], nums[0]]  # no negative results for a plain difference
        text = str(nums[0]) + "".join(f" {o} {n}" for o, n in zip(ops, nums[1:], strict=True))
        return text, int(safe_eval(text))

    def corpus_texts(self, episodes: int = 20, seed: int = 0) -> list[str]:
        """Texts for a locally trained tokenizer (tiny models): prompts, calls, responses."""
        texts = [self.system_prompt]
        for s in range(seed, seed + episodes):
            problem, answer = self.generate(s)
            texts += [f"Compute {problem}.", format_tool_call("calculate", {"expression": problem}),
                      tool_response(str(answer)), f"<answer>{answer}</answer>"]
        return texts


@register_env("calculator")
def build_calculator(task: TaskConfig) -> CalculatorEnv:
    """env_id "calculator" (or "calculator-..."); difficulty from `env_kwargs` (see the module
    docstring). Set `env_kwargs` explicitly (`{}` for the defaults): the task default is
    FrozenLake's."""
    known = {"digits", "ops", "terms"}
    unknown = sorted(set(task.env_kwargs) - known)
    if unknown:
        raise ValueError(f"calculator env_kwargs {unknown} unknown; known: {sorted(known)}")
    return CalculatorEnv(**task.env_kwargs, max_turns=task.max_turns,
                         format_penalty=task.format_penalty, parser=task.parser,
                         format_credit=task.format_credit)
