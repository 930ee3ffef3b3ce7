"""Multi-turn agent episodes: policy -> sandbox session -> observation, until done.

``run_episodes(policy, tasks_prompts, session_factory, ...)`` plays one episode per
prompt, all in lockstep (each turn is one batched ``HFEngine`` call over the episodes
still running). A turn is:

1. the policy generates an action from the whole context so far (prompt, its earlier
   actions and the observations), stopping on EOS or ``max_action_tokens``;
2. ``parse_action`` turns the action text into a tool call; ``DONE`` (or an empty
   action) ends the episode, otherwise the command runs in that episode's session
   (``SandboxSession.exec`` from ``components/sandbox/session.py``, or anything with the
   same ``exec(cmd) -> JobResult`` / ``close()`` shape);
3. the observation (exit status and capped output, ``format_observation``) is tokenised
   and appended to the context.

The episode ends on ``DONE``, after ``max_steps`` actions, or when the context would
exceed ``max_context_tokens``. Each episode becomes one ``Episode``: the completion is
every token after the prompt (actions and observations), ``logprobs`` are the sampling
logprobs of action tokens (0.0 for observation tokens) and ``completion_mask`` is 1 on
the policy's tokens and 0 on observation tokens, so the trainer trains only on what the
policy produced (``grpo.Sample.mask``). Each action becomes a ``Turn`` record.

Not covered: wiring into the rollout stage (no domain defines multi-turn tasks yet; a
domain would pass its tasks' prompts and a session factory), tool formats other than
one bash command per action, observations that the tokenizer cannot round-trip
(characters outside the vocabulary become ``<unk>``), and parallel sessions (the
commands of one turn run one after another).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from components.core.policy import Policy
from components.core.records import Turn
from components.rollout.engines import TokenPromptPolicy
from components.rollout.hf_engine import HFEngine

DONE = "DONE"


class Session(Protocol):
    def exec(self, cmd: str, timeout_s: float | None = None): ...

    def close(self) -> None: ...


def parse_action(text: str) -> tuple[str, str, bool]:
    """(tool, command, done) for an action text: ``DONE`` or nothing ends the episode,
    anything else is one bash command."""
    command = text.strip()
    if not command or command.split()[0] == DONE:
        return "done", "", True
    return "bash", command, False


def format_observation(result, limit: int = 512) -> str:
    """What the policy sees after a command: exit status and the capped output."""
    output = (result.stdout + result.stderr)[:limit]
    return f"\n[exit {result.exit_code} {result.status}]\n{output}\n"


@dataclass
class Episode:
    prompt_ids: list[int]
    completion_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    completion_mask: list[int] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)
    finish_reason: str = "length"  # "stop": the policy said DONE; "length": step or context limit
    text: str = ""  # the decoded completion (actions and observations)


def run_episodes(policy: Policy, prompts: list[str], session_factory: Callable[[], Session], *, max_steps: int,
                 max_action_tokens: int, temperature: float, seed: int, batch_size: int = 64,
                 max_context_tokens: int | None = None, greedy: bool = False,
                 parse: Callable[[str], tuple[str, str, bool]] = parse_action) -> list[Episode]:
    """Play one episode per prompt; sessions are opened per episode and always closed."""
    engine = HFEngine()
    limit = max_context_tokens or getattr(policy.model.config, "max_position_embeddings", 10**9)
    episodes = [Episode(prompt_ids=policy.encode_prompt(p)) for p in prompts]
    sessions: list[Session | None] = [None] * len(prompts)
    active = list(range(len(prompts)))
    try:
        for step in range(max_steps):
            active = [i for i in active if len(episodes[i].prompt_ids) + len(episodes[i].completion_ids)
                      + max_action_tokens <= limit]
            if not active:
                break
            contexts = [episodes[i].prompt_ids + episodes[i].completion_ids for i in active]
            samples = engine.generate(TokenPromptPolicy(policy), contexts, max_action_tokens, temperature,  # type: ignore[arg-type]
                                      seed + 1000 * step, batch_size, greedy=greedy)
            still = []
            for i, sample in zip(active, samples):
                ep = episodes[i]
                ep.completion_ids += sample.completion_ids
                ep.logprobs += sample.logprobs
                ep.completion_mask += [1] * len(sample.completion_ids)
                tool, command, done = parse(sample.text)
                if done:
                    ep.turns.append(Turn(action=sample.text, observation="", tool_call=tool, duration_s=0.0))
                    ep.finish_reason = "stop"
                    continue
                if sessions[i] is None:
                    sessions[i] = session_factory()
                started = time.perf_counter()
                result = sessions[i].exec(command)  # type: ignore[union-attr]
                observation = format_observation(result)
                ep.turns.append(Turn(action=sample.text, observation=observation, tool_call=tool,
                                     duration_s=time.perf_counter() - started))
                obs_ids = list(policy.tokenizer(observation, add_special_tokens=False)["input_ids"])
                ep.completion_ids += obs_ids
                ep.logprobs += [0.0] * len(obs_ids)
                ep.completion_mask += [0] * len(obs_ids)
                still.append(i)
            active = still
    finally:
        for s in sessions:
            if s is not None:
                s.close()
    for ep in episodes:
        ep.text = policy.tokenizer.decode([t for t in ep.completion_ids if t != policy.eos_id], skip_special_tokens=True)
    return episodes
