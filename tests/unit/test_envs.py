"""rollart.envs: action parsing, the toy-text adapter and the registry (hand-checked values)."""

from __future__ import annotations

import random

import pytest

from rollart.config import TaskConfig
from rollart.envs import ENV_BUILDERS, Env, ToyTextEnv, make_env, parse_action, register_env

FL = ["Left", "Down", "Right", "Up"]
START = "PFFF\nFHFH\nFFFH\nHFFG\nP is at row 1, column 1."  # 4x4 map, agent on S
OPTIMAL = ["Down", "Down", "Right", "Right", "Down", "Right"]


def frozenlake(max_turns: int = 8, parser: str = "lenient", **kwargs: object) -> ToyTextEnv:
    env_kwargs = kwargs or {"map_name": "4x4", "is_slippery": False}
    return ToyTextEnv("FrozenLake-v1", env_kwargs, max_turns, -0.01, parser)


def answer(name: str) -> str:
    return f"<answer>{name}</answer>"


# -- parsing ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "mode", "expected"),
    [
        ("<answer>Left</answer>", "strict", ("Left", True)),
        ("  <answer>  Down \n</answer>\n", "strict", ("Down", True)),
        ("<think>go down then right</think>\n<answer>Right</answer>", "strict", ("Right", True)),
        ("<answer>up</answer>", "strict", ("Up", True)),  # action case does not matter
        ("<answer>UP</answer>", "lenient", ("Up", True)),
        ("<answer>Left</answer><answer>Up</answer>", "strict", (None, False)),
        ("<answer>Left</answer><answer>Up</answer>", "lenient", ("Left", False)),
        ("<think><answer>Up</answer></think><answer>Left</answer>", "strict", (None, False)),
        ("<ANSWER>Left</ANSWER>", "strict", (None, False)),
        ("Sure! <answer>Left</answer>", "strict", (None, False)),  # text outside the tags
        ("<answer>Left</answer> done", "strict", (None, False)),
        ("<answer>Left", "strict", (None, False)),
        ("<think>unclosed <answer>Left</answer>", "strict", (None, False)),
        ("<answer>Jump</answer>", "strict", (None, False)),
        ("I would go right, then up", "lenient", ("Right", False)),
        ("I would go right, then up", "strict", (None, False)),
        ("uplifting leftovers", "lenient", (None, False)),  # whole words only
        ("UP!", "lenient", ("Up", False)),
        ("<answer>Leftish</answer> down", "lenient", ("Down", False)),
        ("asdf qwer", "lenient", (None, False)),
        ("", "lenient", (None, False)),
        ("", "strict", (None, False)),
    ],
)
def test_parse_action(text: str, mode: str, expected: tuple[str | None, bool]) -> None:
    assert parse_action(text, FL, mode) == expected  # type: ignore[arg-type]


def test_parse_prefers_longer_names_and_odd_characters() -> None:
    names = ["Pick", "Pickup", "a+b"]
    assert parse_action("pickup now", names, "lenient") == ("Pickup", False)
    assert parse_action("then a+b", names, "lenient") == ("a+b", False)
    assert parse_action("<answer>A+B</answer>", names, "strict") == ("a+b", True)


def test_parse_never_raises_on_arbitrary_strings() -> None:
    rng = random.Random(0)
    alphabet = "<>/answerthinkLeftDownUp \n\t\x00é漢🙂\u200b\\[](){}*+?|^$."
    samples = ["", "\x00", "🙂" * 1000, "<answer>" * 5000, "a" * 10_000, "left " * 2000]
    samples += [
        "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 300))) for _ in range(200)
    ]
    samples.append("".join(chr(rng.randint(0, 0x10FFFF)) for _ in range(10_000)))  # surrogates too
    for text in samples:
        for mode in ("strict", "lenient"):
            name, ok = parse_action(text, FL, mode)  # type: ignore[arg-type]
            assert name is None or name in FL
            assert isinstance(ok, bool)
    assert parse_action("<answer>Left</answer>" + "x" * 10_000, FL, "lenient") == ("Left", False)


def test_parse_rejects_unknown_mode() -> None:
    with pytest.raises(ValueError, match="parser mode"):
        parse_action("Left", FL, "fuzzy")  # type: ignore[arg-type]


# -- FrozenLake -----------------------------------------------------------------------------------


def test_frozenlake_reset_text_and_prompt() -> None:
    env = frozenlake()
    assert isinstance(env, Env)
    assert env.action_names == FL
    obs, info = env.reset(seed=0)
    assert obs == f"Turn 1:\n{START}\n8 moves remaining."
    assert info["seed"] == 0
    for name in FL:
        assert answer(name) in env.system_prompt
    assert env.reset(seed=123)[0] == obs  # fixed map, deterministic start


def test_frozenlake_optimal_path_reaches_goal() -> None:
    env = frozenlake()
    env.reset(seed=0)
    for i, name in enumerate(OPTIMAL):
        obs, reward, terminated, truncated, info = env.step(answer(name))
        assert info["action"] == name and info["valid"] and info["format_ok"]
        assert info["format_penalty"] == 0.0
        if i < len(OPTIMAL) - 1:
            assert (reward, terminated, truncated, info["success"]) == (0.0, False, False, False)
    assert (reward, terminated, truncated) == (1.0, True, False)
    assert info["success"] is True and info["task_reward"] == 1.0
    assert "FFFH\nHFFP" in obs  # the agent stands on the goal cell
    with pytest.raises(RuntimeError):
        env.step(answer("Left"))  # the episode is over


def test_frozenlake_hole_terminates_without_success() -> None:
    env = frozenlake()
    env.reset(seed=0)
    env.step(answer("Right"))
    obs, reward, terminated, truncated, info = env.step(answer("Down"))  # (0,1) -> hole (1,1)
    assert (reward, terminated, truncated) == (0.0, True, False)
    assert info["success"] is False and info["valid"] is True
    assert "\nFPFH\n" in obs


def test_malformed_output_is_a_penalised_noop() -> None:
    env = frozenlake(parser="strict")
    env.reset(seed=0)
    env.step(answer("Down"))
    obs, reward, terminated, truncated, info = env.step("I think I should jump")
    assert reward == pytest.approx(-0.01) and info["format_penalty"] == pytest.approx(-0.01)
    assert env.step("<answer>jump</answer>")[1] == pytest.approx(-0.005)  # tags: 0.5 credit
    assert info["task_reward"] == 0.0
    assert (info["action"], info["valid"], info["format_ok"]) == (None, False, False)
    assert (terminated, truncated) == (False, False)
    # state unchanged
    assert obs == "Turn 3:\nSFFF\nPHFH\nFFFH\nHFFG\nP is at row 2, column 1.\n6 moves remaining."
    # strict mode ignores a bare action word, lenient mode executes it with graded credit (0.4)
    assert env.step("Down")[4]["valid"] is False
    lenient = frozenlake(parser="lenient")
    lenient.reset(seed=0)
    obs, reward, _, _, info = lenient.step("Down.")
    assert (info["action"], info["valid"], info["format_ok"]) == ("Down", True, False)
    assert reward == pytest.approx(-0.006)
    assert "\nPHFH\n" in obs


def test_truncation_exactly_at_max_turns_and_countdown() -> None:
    env = frozenlake(max_turns=4)
    obs, _ = env.reset(seed=0)
    assert obs.endswith("4 moves remaining.")
    # Left at the start bumps into the wall, so the episode can only end by truncation;
    # an invalid turn counts like any other.
    actions = [answer("Left"), "garbage", answer("Up"), answer("Left")]
    for turn, text in enumerate(actions, start=1):
        obs, _, terminated, truncated, info = env.step(text)
        assert info["turn"] == turn and not terminated
        assert obs.startswith(f"Turn {turn + 1}:\n")
        left = 4 - turn
        assert obs.endswith(f"{left} {'move' if left == 1 else 'moves'} remaining.")
        assert truncated is (turn == 4)
    with pytest.raises(RuntimeError):
        env.step(answer("Down"))


def test_goal_on_last_turn_is_terminated_not_truncated() -> None:
    env = frozenlake(max_turns=len(OPTIMAL))
    env.reset(seed=0)
    for name in OPTIMAL:
        _, reward, terminated, truncated, info = env.step(answer(name))
    assert (reward, terminated, truncated, info["success"]) == (1.0, True, False, True)


def test_random_maps_follow_the_seed() -> None:
    env = frozenlake(random_map=True, size=4, p=0.8, is_slippery=False)
    maps = [env.reset(seed=s)[0] for s in range(6)]
    assert env.reset(seed=3)[0] == maps[3]
    assert len(set(maps)) > 1
    for text in maps:
        grid = text.split("\n")[1:5]
        assert grid[0][0] == "P" and grid[3][3] == "G" and all(len(row) == 4 for row in grid)


def test_random_map_only_for_frozenlake() -> None:
    with pytest.raises(ValueError, match="random_map"):
        ToyTextEnv("Taxi-v4", {"random_map": True}, 8, -0.01, "lenient")


def test_corpus_texts_cover_prompt_observations_and_answers() -> None:
    env = frozenlake()
    env.reset(seed=0)
    env.step(answer("Down"))
    texts = env.corpus_texts(episodes=3, seed=0)
    assert texts[0] == env.system_prompt
    assert all(answer(name) in texts for name in FL)
    assert f"Turn 1:\n{START}\n8 moves remaining." in texts
    assert sum(t.startswith("Turn ") for t in texts) >= 3 * 2
    assert env.step(answer("Down"))[0].startswith("Turn 3:\nSFFF\nFHFH\nPFFH")  # own state kept


# -- other toy-text families ----------------------------------------------------------------------


def test_cliffwalking_smoke() -> None:
    env = ToyTextEnv("CliffWalking-v1", {}, 8, -0.01, "strict")
    assert env.action_names == ["Up", "Right", "Down", "Left"]
    obs, _ = env.reset(seed=0)
    assert "\nxCCCCCCCCCCT\n" in obs
    obs, reward, terminated, _, info = env.step(answer("Up"))
    assert (reward, terminated, info["valid"]) == (-1.0, False, True)
    assert "\nxooooooooooo\noCCCCCCCCCCT\n" in obs


def test_taxi_smoke() -> None:
    env = ToyTextEnv("Taxi-v4", {}, 8, -0.01, "strict")
    assert env.action_names == ["South", "North", "East", "West", "Pickup", "Dropoff"]
    obs, _ = env.reset(seed=0)  # seed 0: taxi at (3, 0), passenger at B, destination Y
    assert "\n|T| : | : |\n" in obs and "Passenger at B, destination Y." in obs
    obs, reward, _, _, info = env.step(answer("North"))
    assert (reward, info["valid"], info["action"]) == (-1.0, True, "North")
    assert "\n|T: : : : |\n" in obs
    _, reward, _, _, info = env.step(answer("Dropoff"))  # illegal dropoff
    assert (reward, info["success"]) == (-10.0, False)


def test_unknown_family_needs_action_names() -> None:
    with pytest.raises(ValueError, match="action_names"):
        ToyTextEnv("Blackjack-v1", {}, 8, -0.01, "lenient")
    with pytest.raises(ValueError, match="2 actions"):
        ToyTextEnv("Blackjack-v1", {}, 8, -0.01, "lenient", action_names=["A", "B", "C"])
    env = ToyTextEnv("Blackjack-v1", {}, 8, -0.01, "lenient", action_names=["Stick", "Hit"])
    obs, _ = env.reset(seed=3)
    assert obs.startswith("Turn 1:\n(") and env.step(answer("Stick"))[4]["valid"]


# -- registry -------------------------------------------------------------------------------------


def test_make_env_default_task() -> None:
    env = make_env(TaskConfig())
    assert isinstance(env, ToyTextEnv) and env.max_turns == 8 and env.parser == "lenient"
    assert env.reset(seed=0)[0] == f"Turn 1:\n{START}\n8 moves remaining."


def test_make_env_unknown_id() -> None:
    with pytest.raises(ValueError) as err:
        make_env(TaskConfig(env_id="NoSuchEnv-v0", env_kwargs={}))
    message = str(err.value)
    assert "'NoSuchEnv-v0'" in message and "FrozenLake-v1" in message and "Taxi-v4" in message


def test_register_env_prefix() -> None:
    @register_env("test-prefix/")
    def build(task: TaskConfig) -> Env:
        return ToyTextEnv("FrozenLake-v1", {"is_slippery": False}, task.max_turns, -0.01, "strict")

    try:
        env = make_env(TaskConfig(env_id="test-prefix/anything", max_turns=3))
        assert env.reset(seed=0)[0].endswith("3 moves remaining.")
    finally:
        del ENV_BUILDERS["test-prefix/"]


@pytest.mark.parametrize(
    "text, score",
    [
        ("<answer>Left</answer>", 1.0),
        ("<think>hmm</think> <answer>Up</answer>", 1.0),
        ("Left", 0.4),
        ("<answer>Left", 0.65),
        ("<answer>jump</answer>", 0.5),
        ("<answer>Left</answer><answer>Up</answer>", 0.9),  # two answers: not strict
        ("xyz", 0.0),
        ("", 0.0),
    ],
)
def test_format_score_graded_credit(text, score):
    from rollart.envs.parsing import format_score

    assert format_score(text, ["Left", "Down", "Right", "Up"]) == pytest.approx(score)


def test_action_format_credit_penalises_only_turns_without_action():
    env = make_env(TaskConfig(format_credit="action", format_penalty=-0.1))
    env.reset(seed=0)
    assert env.step("Down")[1] == pytest.approx(0.0)  # lenient action: no penalty
    assert env.step("<answer>jump</answer>")[1] == pytest.approx(-0.1)
    assert env.step("<answer>Down</answer>")[1] == pytest.approx(0.0)


def test_random_walk_success_the_default_config_cites() -> None:
    """configs/default.yaml chose 20 turns because a uniform random walk on the 4x4 map reaches
    G in 1.24 % of episodes, against 0.29 % in 8 turns: exact, by dynamic programming over the
    env's own transition table."""
    import gymnasium

    env = gymnasium.make("FrozenLake-v1", map_name="4x4", is_slippery=False).unwrapped
    nA = env.action_space.n

    def success(turns: int) -> float:
        p = {0: 1.0}  # state -> probability of being there, still walking
        won = 0.0
        for _ in range(turns):
            nxt: dict[int, float] = {}
            for s, ps in p.items():
                for a in range(nA):
                    ((_, s2, r, done),) = env.P[s][a]  # deterministic: one outcome
                    if done:
                        won += ps / nA * r
                    else:
                        nxt[s2] = nxt.get(s2, 0.0) + ps / nA
            p = nxt
        return won

    assert round(success(8), 4) == 0.0029
    assert round(success(20), 4) == 0.0124
