"""Multi-turn agent episodes: policy -> sandbox session -> observation, until done.

``run_episodes(actor, prompts, session_factory, ...)`` plays ``group_size`` episodes per
prompt, all in lockstep. ``actor`` is a ``Policy`` (the default, model-driven path: each
turn is one batched ``HFEngine`` call over the episodes still running, and the first turn
goes through ``generate_groups`` so the G episodes of a prompt share its prefill) or any
function ``context text -> action text`` (a scripted policy: no model, no tokens). A turn is:

1. the actor writes an action from the whole context so far (prompt, its earlier
   actions and the observations); a policy stops on EOS or ``max_action_tokens``;
2. ``parse_action`` turns the action text into a tool call: its first non-empty line is
   one bash command; ``DONE`` (or an empty action) ends the episode. Otherwise the
   command runs in that episode's session (``session_factory(prompt_index)``: anything
   with ``exec(cmd) -> JobResult`` and ``close()``; ``TaskSession`` wraps a sandbox session
   with a task's ``Interactive`` declaration). The commands of one turn run at most
   ``concurrency`` at once;
3. the observation (exit status and the first ``observation_chars`` characters of the
   output, ``format_observation``) is tokenised and appended to the context: as its
   text under the ``raw`` prompt format; under ``chat`` (``Policy.prompt_format``) as the
   next user turn of the chat template, after the close of the assistant turn and
   followed by the generation prompt (``components.core.prompts.observation_ids``).

The episode ends on ``DONE``, after its ``max_steps`` actions (one limit for all, or one
per prompt), or when its context fills ``max_context_tokens`` (by default the model's
positions). Each action takes at most ``max_action_tokens`` and at most the positions
left below that limit (a ``rollout.max_new_tokens`` near the model's positions still
leaves a long prompt its turns, as one-shot completions are clamped); an observation's
tokens are cut to the positions left, so prompt plus completion never exceeds it (the
``Turn`` keeps the whole observation text; the episode's ``text`` is decoded from the
tokens kept). A command whose result is ``infra_error`` (the sandbox could not start or
run it) is an ``InfraError`` naming the episode, the command and the tail of its stderr:
that text is the host's, never an observation the policy trains on. Each episode
becomes one ``Episode``: the completion is every token after the prompt (actions and
observations), ``logprobs`` are the sampling logprobs of action tokens (0.0 for
observation tokens) and ``completion_mask`` is 1 on the policy's tokens and 0 on
observation tokens, so the trainer trains only on what the policy produced
(``grpo.Sample.mask``). Each action becomes a ``Turn`` record; ``Episode.commands`` are
the commands that ran, in order (the rollout stage stores them, one per line, as the
completion the sandbox stage replays).

Not covered: tool formats other than one bash command per action, observations that the
tokenizer cannot round-trip (characters outside the vocabulary become ``<unk>``), and
engines other than ``hf`` (contexts are token ids).
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol

from components.core.errors import InfraError, one_line, value_text
from components.core.jobs import never_starts
from components.core.policy import Policy
from components.core.prompts import observation_ids
from components.core.records import Turn
from components.domains.base import Interactive, action_command, observation_text
from components.rollout.engines import Generation, TokenPromptPolicy, sub_seed
from components.rollout.hf_engine import HFEngine

LONE_SURROGATE = re.compile("[\ud800-\udfff]")
log = logging.getLogger(__name__)
Actor = Callable[[str], str]
"""A scripted policy: the context text so far (prompt, actions, observations) -> the next action."""


class Session(Protocol):
    def exec(self, cmd, timeout_s: float | None = None): ...

    def close(self) -> None: ...


class TaskSession:
    """A sandbox session playing one interactive task: the first command lays out the
    task's files, every command runs under its ``step_prefix`` and per-action time limit."""

    def __init__(self, session, spec: Interactive) -> None:
        self.session = session
        self.spec = spec
        self._laid_out = False

    def exec(self, cmd: str, timeout_s: float | None = None):
        files = None if self._laid_out else dict(self.spec.files)
        argv = ["bash", "-c", self.spec.command(cmd)]
        # A command refused before it starts (a NUL) writes no file: the start files go with the next one.
        self._laid_out = self._laid_out or not never_starts(argv)
        return self.session.exec(argv, timeout_s=timeout_s or self.spec.step_timeout_s, files=files)

    def close(self) -> None:
        self.session.close()


class ReplaySession:
    """An episode's session that holds no sandbox between its commands. Each ``exec`` opens
    a session (``open_session()``: a reset worker from a ``SessionPool``), lays out the
    task's files, runs the episode's earlier commands again (their output dropped), then
    the new command, and closes the session (its worker goes back to the pool, reset).

    So the policy's thinking time holds no sandbox, and the episodes of a whole batch need
    no more sandboxes than run commands at once (``sandbox.concurrency``) instead of one
    started per episode. The observation is the one a live session would give when the
    commands are deterministic, which the sandbox stage's verdict already assumes (it
    replays the same commands from the same start). As in a live session and in that
    replay, an earlier command that timed out or killed the session does not stop the
    later ones (a killed session answers every later command as closed); only a sandbox
    failure (``infra_error``) while replaying is returned in place of the new command's
    result. Every command joins the history, as it joins the recorded completion. Not
    covered: commands whose output depends on the clock, randomness or how long earlier
    commands took (and an earlier command that times out costs its limit again on every
    later turn)."""

    def __init__(self, open_session: Callable[[], object], spec: Interactive) -> None:
        self.open_session = open_session
        self.spec = spec
        self.history: list[str] = []

    def exec(self, cmd: str, timeout_s: float | None = None):
        session = self.open_session()
        try:
            task = TaskSession(session, self.spec)
            for earlier in self.history:
                result = task.exec(earlier, timeout_s)
                if result.status == "infra_error":
                    return result
            return task.exec(cmd, timeout_s)
        finally:
            session.close()
            self.history.append(cmd)

    def close(self) -> None:
        self.history = []


def as_text(action: object) -> str:
    """A scripted actor's action as text a record can hold: a lone surrogate (which no
    UTF-8 file, command line or record can encode) becomes U+FFFD, as a model's decoded
    tokens would; anything but a ``str`` is a mistake in the actor (TypeError naming it)."""
    if not isinstance(action, str):
        raise TypeError(f"a scripted actor must return the action as str, got {type(action).__name__}: {action!r:.80}")
    return LONE_SURROGATE.sub("\ufffd", action)


def parse_action(text: str) -> tuple[str, str, bool]:
    """(tool, command, done) for an action text: ``DONE`` or nothing ends the episode,
    otherwise the first non-empty line is one bash command."""
    command = action_command(text)
    if not command:
        return "done", "", True
    return "bash", command, False


def format_observation(result, limit: int = 512) -> str:
    """What the policy sees after a command: exit status and the capped output."""
    return observation_text(result.exit_code, result.status, result.stdout + result.stderr, limit)


@dataclass
class Episode:
    prompt_ids: list[int]
    completion_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    completion_mask: list[int] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)
    finish_reason: str = "length"  # "stop": the policy said DONE; "length": step or context limit
    text: str = ""  # the decoded completion (actions and observations)
    commands: list[str] = field(default_factory=list)  # the commands that ran, in order


def run_episodes(actor: Policy | Actor, prompts: list[str], session_factory: Callable[[int], Session], *,
                 max_steps: int | Sequence[int], max_action_tokens: int = 24, temperature: float = 1.0, seed: int = 0,
                 batch_size: int = 64, max_context_tokens: int | None = None, greedy: bool = False,
                 parse: Callable[[str], tuple[str, str, bool]] = parse_action, group_size: int = 1,
                 observation_chars: int = 512, concurrency: int = 1,
                 progress: Callable[[int], None] | None = None, engine: HFEngine | None = None) -> list[Episode]:
    """Play ``group_size`` episodes per prompt (episode ``i * group_size + g`` is sample
    ``g`` of ``prompts[i]``); sessions are opened on an episode's first command and always
    closed, each one even when another's ``close()`` raises. A command ending in
    ``infra_error`` is an ``InfraError`` (the turn's other commands have run).
    ``progress`` is called with how many episodes just ended. ``engine``: the
    ``HFEngine`` a policy samples through (a default one when None)."""
    scripted = not isinstance(actor, Policy)
    engine = engine or HFEngine()
    n = len(prompts) * group_size
    owner = [k // group_size for k in range(n)]
    steps = [max_steps] * len(prompts) if isinstance(max_steps, int) else list(max_steps)
    if scripted:
        episodes = [Episode(prompt_ids=[]) for _ in range(n)]
        limit = 10**9
    else:
        policy: Policy = actor  # type: ignore[assignment]
        episodes = [Episode(prompt_ids=policy.encode_prompt(prompts[owner[k]])) for k in range(n)]
        limit = max_context_tokens or getattr(policy.model.config, "max_position_embeddings", 10**9)
    sessions: list[Session | None] = [None] * n
    active = list(range(n))

    def room(k: int) -> int:  # the tokens episode k's next action may take
        return max_action_tokens if scripted else min(max_action_tokens, limit - len(episodes[k].prompt_ids)
                                                       - len(episodes[k].completion_ids))

    finished = False
    try:
        with ThreadPoolExecutor(max_workers=max(1, concurrency)) as pool:
            for step in range(max(steps, default=0)):
                ended = [k for k in active if step >= steps[owner[k]] or room(k) < 1]
                active = [k for k in active if k not in set(ended)]
                if progress and ended:
                    progress(len(ended))
                if not active:
                    break
                if scripted:
                    texts = [as_text(actor(prompts[owner[k]] + episodes[k].text)) for k in active]  # type: ignore[operator]
                    samples = [Generation([], [], [], t, "stop") for t in texts]
                elif step == 0 and len(active) == n:
                    samples = engine.generate_groups(policy, prompts, group_size, max_action_tokens, temperature,
                                                         sub_seed(seed, "turn", step), batch_size, greedy=greedy)
                else:  # every turn samples from its own hashed seed (seed + 1000 * step met other task batches' seeds)
                    contexts = [episodes[k].prompt_ids + episodes[k].completion_ids for k in active]
                    samples = engine.generate(TokenPromptPolicy(policy), contexts, max_action_tokens,  # type: ignore[arg-type]
                                                  temperature, sub_seed(seed, "turn", step), batch_size, greedy=greedy)
                if not scripted:  # an engine gives at most the model's positions left: here, at most the limit's
                    samples = [_cut(policy, sample, room(k)) for k, sample in zip(active, samples)]
                running = []
                samples_by = dict(zip(active, samples))
                for k, sample in zip(active, samples):
                    ep = episodes[k]
                    ep.completion_ids += sample.completion_ids
                    ep.logprobs += sample.logprobs
                    ep.completion_mask += [1] * len(sample.completion_ids)
                    ep.text += sample.text
                    tool, command, done = parse(sample.text)
                    if done:
                        ep.turns.append(Turn(action=sample.text, observation="", tool_call=tool, duration_s=0.0))
                        ep.finish_reason = "stop"
                    else:
                        running.append((k, sample.text, tool, command))
                results = list(pool.map(lambda item: _run(sessions, session_factory, owner, item[0], item[3]), running))
                _refuse_outage([(k, owner[k], command) for k, _, _, command in running], [r for r, _ in results])
                for (k, text, tool, command), (result, seconds) in zip(running, results):
                    ep = episodes[k]
                    observation = format_observation(result, observation_chars)
                    ep.turns.append(Turn(action=text, observation=observation, tool_call=tool, duration_s=seconds))
                    ep.commands.append(command)
                    ep.text += observation
                    if not scripted:
                        stopped = bool(samples_by[k].completion_ids) and samples_by[k].completion_ids[-1] == policy.eos_id
                        obs_ids = observation_ids(policy.tokenizer, observation, policy.prompt_format, stopped)
                        # cut to the positions left: the stored episode never exceeds the limit (the next
                        # turn's check then ends an episode that has no room for another action)
                        obs_ids = obs_ids[:max(0, limit - len(ep.prompt_ids) - len(ep.completion_ids))]
                        ep.completion_ids += obs_ids
                        ep.logprobs += [0.0] * len(obs_ids)
                        ep.completion_mask += [0] * len(obs_ids)
                if progress and len(running) < len(active):
                    progress(len(active) - len(running))
                active = [k for k, *_ in running]
            if progress and active:
                progress(len(active))
        finished = True
    finally:
        _close_all(sessions, raise_first=finished)
    if not scripted:
        for ep in episodes:
            ep.text = policy.tokenizer.decode([t for t in ep.completion_ids if t != policy.eos_id],
                                              skip_special_tokens=True)
    return episodes


def _run(sessions: list[Session | None], factory: Callable[[int], Session], owner: list[int], k: int, command: str):
    """Run ``command`` in episode ``k``'s session (opened on first use); (result, seconds)."""
    started = time.perf_counter()
    if sessions[k] is None:
        sessions[k] = factory(owner[k])
    result = sessions[k].exec(command)  # type: ignore[union-attr]
    return result, time.perf_counter() - started


def _cut(policy: Policy, sample: Generation, tokens: int) -> Generation:
    """``sample`` cut to its first ``tokens`` tokens (unchanged when it has no more): its
    logprobs stay those the tokens were sampled with, its text is decoded again."""
    if len(sample.completion_ids) <= tokens:
        return sample
    ids = sample.completion_ids[:tokens]
    return Generation(sample.prompt_ids, ids, sample.logprobs[:tokens],
                      policy.tokenizer.decode(ids, skip_special_tokens=True), "length")


def _refuse_outage(ran: list[tuple[int, int, str]], results: list) -> None:
    """An ``InfraError`` for the first of one turn's commands (``(episode, prompt, command)``
    each) whose result is ``infra_error``: the sandbox session could not run it, so its
    output is the host's (a sandbox that did not start), not an observation to train on."""
    for (k, prompt, command), result in zip(ran, results):
        if result.status == "infra_error":
            where = " ".join(filter(None, [getattr(result, "backend", ""), getattr(result, "isolation", "")])) or "sandbox"
            raise InfraError("sandbox session", where, f"episode {k} (prompt {prompt}) could not run "
                             f"{value_text(command, 80)!r}: {one_line(value_text(result.stderr[-200:]))}")


def _close_all(sessions: Sequence[Session | None], raise_first: bool) -> None:
    """Close every opened session, even when one ``close()`` raises; the first such error
    is raised after all were closed when ``raise_first``, else logged (an error already on
    its way out is the one to report)."""
    failed: Exception | None = None
    for s in sessions:
        if s is not None:
            try:
                s.close()
            except Exception as exc:  # noqa: BLE001 - the others are closed first
                log.warning("posttrain: closing an episode's sandbox session failed: %s", one_line(exc))
                failed = failed or exc
    if failed is not None and raise_first:
        raise failed
