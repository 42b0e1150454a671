"""Text environments: the `Env` contract, action parsing, gymnasium toy-text adapters, registry."""

from rollart.envs.arith import ArithEnv  # registers env_id "arith"
from rollart.envs.base import Env, StepInfo, answer_format, turn_text
from rollart.envs.calculator import CalculatorEnv  # registers env_id "calculator"
from rollart.envs.guess import GuessEnv  # registers env_id "guess"
from rollart.envs.parsing import ParserMode, parse_action
from rollart.envs.registry import ENV_BUILDERS, find_builder, make_env, register_env
from rollart.envs.toytext import FAMILIES, ToyTextEnv

__all__ = [
    "ArithEnv",
    "CalculatorEnv",
    "ENV_BUILDERS",
    "FAMILIES",
    "Env",
    "GuessEnv",
    "ParserMode",
    "StepInfo",
    "ToyTextEnv",
    "answer_format",
    "find_builder",
    "make_env",
    "parse_action",
    "register_env",
    "turn_text",
]
