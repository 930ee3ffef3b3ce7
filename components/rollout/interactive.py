"""The rollout stage's interactive tasks: G multi-turn episodes per task, as Rollout records.

``interactive_specs(tasks)`` finds the tasks whose domain declares them interactive
(``Domain.interactive``). ``play(actor, tasks, specs, ...)`` plays ``group_size``
episodes of each (``episode.run_episodes``, in lockstep batches of at most
``rollout.batch_size`` episodes) against sandbox sessions from one session pool of the
recipe's backend (``components.core.sessions.SESSIONS``: the sandbox's limits, at most
``sandbox.concurrency`` commands at once, at most that many idle sessions kept warm).
Each command runs on a replay session (``episode.ReplaySession``: a reset pooled
worker re-runs the episode's earlier commands, then the new one), so no sandbox waits
on the policy and a batch never starts more sandboxes than run commands at once. On
seed 7's bootstrapped demo policy, 14 interactive tasks x 8 episodes took 4.9-5.3 s
this way against 7.3-8.0 s with one live session per episode (``replay=False``, which
the equivalence test ``tests/rollout/test_replay_sessions.py`` keeps as the reference;
its lockstep batches are also capped at ``MAX_LIVE_SESSIONS``).
Each episode takes at most min(the task's ``max_turns``, ``rollout.max_turns``) actions
and sees at most ``rollout.observation_chars`` characters of each command's output.

An episode's Rollout keeps every turn (``turns``), the tokens of actions and
observations with ``completion_mask`` 1 on the policy's and 0 on the observations', and
as ``completion`` the commands that ran, one per line. The final state is not judged
here: the sandbox stage replays that completion in a fresh session from the same setup
(``Interactive.replay``) and runs the task's final check there, so the verdict comes
from the same deterministic path as every session job, and nothing the episode's
commands did to their own session can reach the verifier. Not covered: engines other
than ``hf`` (a ``UserError``), and tasks whose outcome a replay does not reproduce.
"""

from __future__ import annotations

from collections.abc import Callable

from components.core.errors import UserError
from components.core.policy import Policy
from components.core.records import Rollout, Task
from components.core.sessions import SESSIONS
from components.domains.base import Interactive
from components.domains.registry import get as get_domain
from components.rollout.engines import sub_seed
from components.rollout.episode import Actor, Episode, ReplaySession, TaskSession, run_episodes
from components.rollout.hf_engine import HFEngine

SESSION_TIMEOUT_S = 3600.0
"""Longest an episode's session lives (the policy's generation time between commands counts)."""
MAX_LIVE_SESSIONS = 64
"""With live sessions (``replay=False``), the most episodes in one lockstep batch: each
holds a sandbox session (a sandboxed worker) from its first command to its end, so this
bounds the sandboxes alive at once."""


def interactive_specs(tasks: list[Task]) -> dict[str, Interactive]:
    """``{task_id: Interactive}`` for the tasks their domain plays as episodes."""
    domains, specs = {}, {}
    for task in tasks:
        if task.domain not in domains:
            domains[task.domain] = get_domain(task.domain)
        spec = domains[task.domain].interactive(task)
        if spec is not None:
            specs[task.task_id] = spec
    return specs


def check_engine(engine_name: str) -> None:
    """A UserError naming ``rollout.engine`` unless it is ``hf``, the engine episodes sample
    through (the rollout stage checks it before any sampling, ``play`` again)."""
    if engine_name != "hf":
        raise UserError("rollout.engine", engine_name, "multi-turn episodes sample through the in-process hf engine",
                        "set rollout.engine: hf, or leave interactive tasks out of the task mix")


def play(actor: Policy | Actor, tasks: list[Task], specs: dict[str, Interactive], rollout_cfg, sandbox_cfg, *,
         seed: int, iteration: int, engine: HFEngine | None = None, engine_name: str = "hf",
         progress: Callable[[int], None] | None = None, group_size: int | None = None, greedy: bool = False,
         max_action_tokens: int | None = None, replay: bool = True) -> list[Rollout]:
    """``rollout_cfg.group_size`` episode rollouts per task (or ``group_size``), grouped in
    the tasks' order. ``greedy`` and ``max_action_tokens`` serve the eval suite's greedy episodes;
    ``replay=False`` plays on one live session per episode (the reference path)."""
    check_engine(engine_name)
    g = group_size or rollout_cfg.group_size
    out: list[Rollout] = []
    with SESSIONS.load(sandbox_cfg.backend)(sandbox_cfg, int(sandbox_cfg.concurrency)) as pool:
        live = rollout_cfg.batch_size if replay else min(rollout_cfg.batch_size, MAX_LIVE_SESSIONS)
        per_batch = max(1, live // g)
        for start in range(0, len(tasks), per_batch):
            batch = tasks[start:start + per_batch]
            batch_specs = [specs[t.task_id] for t in batch]

            def session(i: int, batch_specs=batch_specs) -> TaskSession | ReplaySession:
                if replay:
                    return ReplaySession(lambda: pool.open(SESSION_TIMEOUT_S), batch_specs[i])
                return TaskSession(pool.open(SESSION_TIMEOUT_S), batch_specs[i])

            episodes = run_episodes(
                actor, [t.prompt for t in batch], session,
                max_steps=[min(s.max_turns, rollout_cfg.max_turns) for s in batch_specs],
                max_action_tokens=max_action_tokens or rollout_cfg.max_new_tokens, temperature=rollout_cfg.temperature,
                seed=sub_seed(seed, "tasks", start), batch_size=rollout_cfg.batch_size, group_size=g,
                observation_chars=rollout_cfg.observation_chars, concurrency=int(sandbox_cfg.concurrency),
                progress=progress, engine=engine, greedy=greedy)
            for k, ep in enumerate(episodes):
                out.append(to_rollout(batch[k // g], k % g, ep, iteration,
                                      getattr(actor, "version", "scripted"), engine_name))
    return out


def to_rollout(task: Task, g: int, ep: Episode, iteration: int, version: str, engine: str) -> Rollout:
    return Rollout(
        rollout_id=f"{task.task_id}-i{iteration}-g{g}", task_id=task.task_id, domain=task.domain, group_index=g,
        policy_version=version, engine=engine, prompt=task.prompt, completion="\n".join(ep.commands),
        prompt_token_ids=ep.prompt_ids, completion_token_ids=ep.completion_ids, logprobs=ep.logprobs,
        finish_reason=ep.finish_reason, prompt_tokens=len(ep.prompt_ids), completion_tokens=len(ep.completion_ids),
        turns=ep.turns, completion_mask=ep.completion_mask,
    )
