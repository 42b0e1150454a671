"""One episode, turn by turn: its token bookkeeping and the routine every episode loop drives.

The conversation is built incrementally in token space so the loss mask is exact: system and user
turns and the chat-template glue are masked (0); every token the engine generated is unmasked (1)
and carries its behaviour log-prob and the weight version that produced it.

`EpisodeSteps` holds the per-turn logic and the failure policy and does no I/O itself: it hands
out the next `Action` (open the env, generate a turn, step the env) and is told how that went
(`advance(result)` or `fail(error)`). Three drivers perform the actions, so the rules below are
written once for blocking calls, awaited calls and batched calls alike:

    rollart/rollout/thread_runner.py   one thread per episode, blocking calls (`take`)
    rollart/rollout/aio_runner.py      one task per episode on an event loop, awaited calls
    env_manager.run_episodes           evaluation: every episode in lockstep, one batched
                                       `generate` call a turn

How an episode ends:
    the env says terminated or truncated (its own turn limit is a truncation), or the next
    observation leaves no room for a turn in `max_context` (truncated): done, no error;
    open fails: error "reset: <exception>", reason "env_error";
    step fails: error "step: <exception>", reason "env_error";
    generate fails: `EpisodeCancelled` ends it quietly (whoever cancelled it accounts for it);
        `NoReplicaLeft` ends it and goes to `on_fatal` (the run cannot go on); any other error
        is the engine's own: error "generate: <type>: <message>", reason "engine_error" (it
        costs this episode, never the replica). With `contain_errors`, an error in the
        episode's own bookkeeping during a turn is treated the same way;
    generate gives no completion (the service stops with no replica left) or the episode is
    cancelled meanwhile: it ends with no error.
Malformed output is the env's to judge: each step's info says `format_ok` and may carry a
`format_penalty`, and the trajectory sums them (`format_errors`, `format_penalty`). The limit on
failed episodes in a row (`rollout.max_consecutive_failures`) is the scheduler's: it counts the
episodes the service records as failed, by the reason given here.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from rollart.config import TaskConfig
from rollart.models.chat import ChatFormat
from rollart.rollout.batcher import EpisodeCancelled, LiveEpisode
from rollart.rollout.failover import NoReplicaLeft, is_replica_loss
from rollart.routing.router import NoHealthyReplica
from rollart.types import Completion, GenerationRequest, SamplingParams, Trajectory, Turn

# (observation, reward, terminated, truncated, info): an env's answer to one action
StepResult = tuple[str, float, bool, bool, dict]


@dataclass(frozen=True)
class EpisodeSpec:
    task: TaskConfig
    seed: int
    group_id: str
    sample_id: str
    iteration: int = 0


@dataclass
class _Episode:
    spec: EpisodeSpec
    traj: Trajectory
    observation: str = ""
    done: bool = False
    pending_prompt_tokens: int = 0
    timings: dict[str, float] = field(default_factory=lambda: {"generate_s": 0.0, "env_s": 0.0})
    # (tokens, mask, log-probs or None, version) of each `extend`: the trajectory's loss mask,
    # behaviour log-probs and versions are built from them once, by `finish_episode`. Growing
    # four lists a turn cost the rollout service's loop ~10 % of its time at 4,096 episodes
    # (benchmarks/rollout_scale.py): each is cold by the episode's next turn, and reallocs.
    segments: list[tuple[int, int, list[float] | None, int]] = field(default_factory=list)

    def extend(self, ids: list[int], mask: int, logprobs: list[float] | None = None,
               version: int = -1) -> None:
        self.traj.token_ids.extend(ids)  # every turn's request needs the whole context
        self.segments.append((len(ids), mask, logprobs, version))


# ---- the token bookkeeping ----------------------------------------------------------------

def constrain(traj: Trajectory, params: SamplingParams) -> None:
    """Record on `traj` the restriction its turns are sampled under (the trainer re-applies it
    per position, so recomputed log-probs are the engine's)."""
    traj.allowed_token_ids = params.allowed_token_ids
    traj.allowed_sequences = params.allowed_sequences
    traj.grammar = params.grammar


def new_episode(spec: EpisodeSpec) -> _Episode:
    """An episode with an empty trajectory and no env yet."""
    return _Episode(spec=spec, traj=Trajectory(
        sample_id=spec.sample_id, task=spec.task.name, env_id=spec.task.env_id,
        group_id=spec.group_id, seed=spec.seed, iteration=spec.iteration,
        token_ids=[], loss_mask=[], behaviour_logprobs=[], token_versions=[],
    ))


def finish_episode(ep: _Episode) -> Trajectory:
    """The episode's trajectory with its per-token lists filled (the loss mask, behaviour
    log-probs and versions of every token so far); call it before the trajectory leaves."""
    t = ep.traj
    mask, logprobs, versions = t.loss_mask, t.behaviour_logprobs, t.token_versions
    pos, added = len(mask), 0
    for seg in ep.segments:
        added += seg[0]
    # Grown once to their length, as for a prompt or glue segment (mask 0, no log-prob,
    # version -1); only the generated segments are written over. Most segments are prompt or
    # glue: appending every segment to the three lists cost ~1.4x this.
    mask += [0] * added
    logprobs += [0.0] * added
    versions += [-1] * added
    for n, m, lp, version in ep.segments:
        end = pos + n
        if m:
            mask[pos:end] = [m] * n
            versions[pos:end] = [version] * n
        if lp is not None:
            logprobs[pos:end] = lp  # n log-probs: one per generated token
        pos = end
    ep.segments = []
    return t


def begin_episode(ep: _Episode, chat: ChatFormat, system: str, observation: str,
                  prompt_ids: list[int] | None = None) -> None:
    """The env was reset: the system prompt, first observation and assistant header (their
    ids as given, when an env host tokenized them, else tokenized here)."""
    ep.observation = observation
    if prompt_ids is None:
        prompt_ids = chat.first_prompt(system, observation)
    ep.extend(prompt_ids, 0)
    ep.pending_prompt_tokens = len(ep.traj.token_ids)


def record_completion(ep: _Episode, comp: Completion, chat: ChatFormat) -> None:
    """Append the generated tokens (mask 1, their log-probs and version) and the turn's end."""
    ep.extend(comp.token_ids, 1, comp.logprobs, comp.weight_version)
    ep.extend(chat.end_after_eos() if comp.finish_reason == "eos" else chat.assistant_end(), 0)


def record_step(ep: _Episode, comp: Completion, result: StepResult, env_s: float,
                chat: ChatFormat, max_context: int, max_new_tokens: int) -> None:
    """The env answered the completion with `result`: record the turn, append the next
    observation (or end the episode: terminated, truncated, or context budget exhausted)."""
    obs, reward, terminated, truncated, info = result
    traj = ep.traj
    traj.turns.append(Turn(
        index=len(traj.turns), observation=ep.observation, response=comp.text,
        action=info.get("action"), format_ok=bool(info.get("format_ok", False)),
        env_reward=float(reward), prompt_tokens=ep.pending_prompt_tokens,
        completion_tokens=len(comp.token_ids), weight_version=comp.weight_version,
        generate_s=comp.generate_s, env_s=env_s,
    ))
    traj.env_return += float(reward)
    traj.task_return += float(info.get("task_reward", reward))
    traj.format_penalty += float(info.get("format_penalty", 0.0))
    traj.format_errors += 0 if info.get("format_ok", False) else 1
    traj.success = traj.success or bool(info.get("success", False))
    traj.terminated, traj.truncated = bool(terminated), bool(truncated)
    if terminated or truncated:
        ep.done = True
        return
    # An env host that tokenizes its observations (with the run's chat format) sends the ids
    # of `chat.next_prompt(obs)` as info["prompt_ids"]: one tokenization less here.
    next_ids = info.get("prompt_ids") or chat.next_prompt(obs)
    if len(traj.token_ids) + len(next_ids) + max_new_tokens > max_context:
        traj.truncated, ep.done = True, True  # context budget exhausted
        return
    ep.observation = obs
    ep.extend(next_ids, 0)
    ep.pending_prompt_tokens = len(next_ids)


def _error_line(err: BaseException) -> str:
    """The last line of `err` as a traceback prints it ("ValueError: bad move")."""
    return "".join(traceback.format_exception_only(err)).strip().splitlines()[-1]


# ---- the routine -----------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Open:
    """Build and reset the env; the result is (system prompt, first observation[, prompt ids
    or None])."""


@dataclass(frozen=True, slots=True)
class Generate:
    """Generate the next turn; the result is a Completion, or None when there is no replica to
    ask any more (the service is stopping)."""

    request: GenerationRequest
    new_tokens: int  # context tokens added since the last turn (what routing weighs)


@dataclass(frozen=True, slots=True)
class Step:
    """Step the env with the generated text; the result is a StepResult."""

    text: str


Action = Open | Generate | Step
OPEN = Open()
_A = TypeVar("_A", Open, Generate, Step)


def _never() -> bool:
    return False


class EpisodeSteps:
    """One episode as a state machine (see the module's docstring): `start()` gives the first
    action; after each one, `advance(result)` gives the next, or None once the episode is over,
    and `fail(error)` ends it. `finish()` is its trajectory, `reason` what a failure is recorded
    as, `timings` its generate / env seconds.

    `cancelled()` is asked before each turn and after each generation; `on_fatal(error)` hears
    of an error that ends the run; `on_turn(start, episode id, turn)` hears of every recorded
    turn (`start`: the perf_counter time its generation was asked for). Time spent on an action
    is measured from when it is handed out to when it is answered, unless `seconds` says (a
    batched driver answers many actions after one call)."""

    __slots__ = ("ep", "chat", "params", "max_context", "cancelled", "on_fatal", "on_turn",
                 "contain_errors", "reason", "action", "_t0", "_turn_t0", "_comp")

    def __init__(self, spec: EpisodeSpec, chat: ChatFormat, params: SamplingParams,
                 max_context: int, cancelled: Callable[[], bool] = _never,
                 on_fatal: Callable[[BaseException], None] | None = None,
                 on_turn: Callable[[float, str, int], None] | None = None,
                 contain_errors: bool = True) -> None:
        self.ep = new_episode(spec)
        constrain(self.ep.traj, params)
        self.chat, self.params, self.max_context = chat, params, max_context
        self.cancelled, self.on_fatal, self.on_turn = cancelled, on_fatal, on_turn
        self.contain_errors = contain_errors
        self.reason = "env_error"  # what a failed episode is recorded as
        self.action: Action | None = None  # the action under way
        self._t0 = 0.0  # when it was handed out
        self._turn_t0 = 0.0  # when this turn's generation was asked for
        self._comp: Completion | None = None  # this turn's completion, for its env step

    @property
    def traj(self) -> Trajectory:
        return self.ep.traj

    @property
    def timings(self) -> dict[str, float]:
        return self.ep.timings

    def finish(self) -> Trajectory:
        return finish_episode(self.ep)

    def start(self) -> Open:
        return self._hand(OPEN)

    def advance(self, result: Any, seconds: float | None = None) -> Action | None:
        """The action under way gave `result`: the next action, or None (the episode is over)."""
        elapsed = time.perf_counter() - self._t0 if seconds is None else seconds
        action, self.action = self.action, None
        kind = type(action)
        if kind is Open:
            self.ep.timings["env_s"] += elapsed
            # Outside the rule below, as the runners always had it: an `open` answer out of
            # the host protocol is a bug to surface, not one episode's failure.
            begin_episode(self.ep, self.chat, *result)
        try:
            if kind is Generate:
                return self._generated(result, elapsed)
            if kind is Step:
                return self._stepped(result, elapsed)
            return self._next()
        except Exception as err:  # the runners' rule: a turn that breaks costs this episode
            if not self.contain_errors:
                raise
            return self._generation_failed(err)

    def fail(self, err: Exception, seconds: float | None = None) -> None:
        """The action under way raised `err`: the episode is over (the policy: see the module's
        docstring)."""
        elapsed = time.perf_counter() - self._t0 if seconds is None else seconds
        action, self.action = self.action, None
        if type(action) is Generate:
            self._generation_failed(err)  # its time is not counted: it gave no turn
            return
        self.ep.timings["env_s"] += elapsed
        self.ep.traj.error = f"{'step' if type(action) is Step else 'reset'}: {_error_line(err)}"
        self.ep.done = True

    def _hand(self, action: _A) -> _A:
        self.action = action
        self._t0 = time.perf_counter()
        return action

    def _next(self) -> Generate | None:
        ep = self.ep
        if ep.done or self.cancelled():
            return None
        req = GenerationRequest(f"{ep.spec.sample_id}#t{ep.traj.num_turns}",
                                list(ep.traj.token_ids), self.params)
        action = self._hand(Generate(req, ep.pending_prompt_tokens))
        self._turn_t0 = self._t0
        return action

    def _generated(self, comp: Completion | None, elapsed: float) -> Step | None:
        self.ep.timings["generate_s"] += elapsed
        if comp is None or self.cancelled():
            return None  # stopping with no replica left / cancelled meanwhile
        record_completion(self.ep, comp, self.chat)
        self._comp = comp
        return self._hand(Step(comp.text))

    def _stepped(self, result: StepResult, elapsed: float) -> Generate | None:
        ep, comp = self.ep, self._comp
        assert comp is not None  # a Step is handed out with its completion
        self._comp = None
        ep.timings["env_s"] += elapsed
        record_step(ep, comp, result, elapsed, self.chat, self.max_context,
                    self.params.max_new_tokens)
        if self.on_turn is not None:
            self.on_turn(self._turn_t0, ep.spec.sample_id, len(ep.traj.turns) - 1)
        return self._next()

    def _generation_failed(self, err: Exception) -> None:
        if isinstance(err, EpisodeCancelled):
            if self.cancelled():
                return None  # whoever cancelled it accounts for it
            # Its batcher stopped under an episode nobody cancelled: ending quietly would
            # count it as finished with the turns it has (none, often); it fails instead.
            self.ep.traj.error = "generate: the engine's batcher stopped"
            self.reason = "engine_error"
            return None
        if isinstance(err, NoReplicaLeft):  # the run cannot go on: say why
            if self.on_fatal is not None:
                self.on_fatal(err)
            return None
        self.ep.traj.error = f"generate: {type(err).__name__}: {err}"
        self.reason = "engine_error"
        return None


# ---- a turn on a serving replica: both runners' `_generate` ---------------------------------

def route_turn(svc: Any, live: LiveEpisode, req: GenerationRequest, new_tokens: int
               ) -> int | None:
    """The replica to send `live`'s turn `req` to; None when the router has heard of a loss
    before the health flags did (the caller waits a little and looks again)."""
    try:
        return svc.routing.route(live.id, live.start.task, req, new_tokens, live.engine)
    except NoHealthyReplica:
        return None


def reissue_turn(svc: Any, engine: int, req: GenerationRequest, err: Exception) -> bool:
    """The call for turn `req` on replica `engine` raised `err`. True: the replica is lost
    (marked so; the same request goes to another one: the episode's tokens stop at its last
    completed turn, so nothing is generated twice). False: `err` stands, for the episode's
    policy (`EpisodeSteps.fail`): a cancel, or the engine's own error (the turn is abandoned)."""
    if isinstance(err, EpisodeCancelled):
        return False
    if not is_replica_loss(err):
        svc.routing.abandon(req.request_id)
        return False
    svc.engine_lost(engine, err)
    svc.totals.counters["turns_reissued"] += 1
    return True


def take(steps: EpisodeSteps, action: Action, perform: Callable[[Action], Any]
         ) -> Action | None:
    """Perform `action` with a blocking call and tell `steps` how it went: the next action."""
    try:
        result = perform(action)
    except Exception as err:  # what it costs is the steps' policy
        steps.fail(err)
        return None
    return steps.advance(result)


def open_env(env: Any, seed: int) -> tuple[str, str, list[int] | None]:
    """Reset an Env-interface object: what an `Open` action gives (with the prompt ids of an
    env host that tokenizes, rollart/rollout/env_host.py)."""
    observation, info = env.reset(seed=seed)
    return env.system_prompt, observation, (info or {}).get("prompt_ids")


def service_steps(svc: Any, live: LiveEpisode,
                  on_turn: Callable[[float, str, int], None] | None = None) -> EpisodeSteps:
    """The steps of the rollout service's episode `live`, under either runner: it stops when
    `live` is cancelled; an error that ends the run goes to the service (and cancels `live`)."""
    st = live.start

    def fatal(err: BaseException) -> None:
        svc.set_fatal(err)
        live.cancelled = True

    spec = EpisodeSpec(svc.tasks[st.task], st.seed, st.group_id, st.episode_id, st.iteration)
    return EpisodeSteps(spec, svc.chat, svc.params[st.task], svc.max_context,
                        cancelled=lambda: live.cancelled, on_fatal=fatal, on_turn=on_turn)
