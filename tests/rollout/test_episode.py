"""Multi-turn episodes through a real sandbox session: observations persist across
turns, only the policy's tokens are masked in, and their logprobs match the trainer's."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest

from components.core.errors import InfraError
from components.core.policy import pad_batch
from components.core.prompts import observation_ids
from components.core.records import Rollout, Turn, from_table, to_table
from components.rollout.episode import format_observation, parse_action, run_episodes
from components.trainer.grpo import Sample, apply_sample_masks, token_weights
from tests.rollout.helpers import tiny_policy
from tests.rollout.test_hf_engine import TOLERANCE, recomputed
from tests.sandbox.helpers import bwrap_unavailable, sandbox_config

SCRIPT = ["echo hello > note.txt", "cat note.txt; echo more >> note.txt", "wc -l < note.txt"]


def scripted(episodes_per_turn: int):
    """A parse function that plays SCRIPT in order (the random tiny policy's own text is
    no command), then says DONE; the policy's text is still what the Turn records.
    Episodes run in lockstep, so call n belongs to turn (n - 1) // episodes_per_turn."""
    calls = []

    def parse(text: str) -> tuple[str, str, bool]:
        calls.append(text)
        index = (len(calls) - 1) // episodes_per_turn
        if index >= len(SCRIPT):
            return "done", "", True
        return "bash", SCRIPT[index], False

    return parse


@pytest.mark.skipif(bool(bwrap_unavailable()), reason=f"needs bubblewrap sessions: {bwrap_unavailable()}")
def test_episode_through_a_sandbox_session() -> None:
    from components.sandbox.session import SandboxSession

    policy = tiny_policy()
    opened = []

    def session():
        s = SandboxSession(sandbox_config(timeout_s=5.0))
        opened.append(s)
        return s

    episodes = run_episodes(policy, ["task A:", "task B, longer prompt:"], lambda _: session(), max_steps=6, max_action_tokens=4,
                            temperature=1.0, seed=2, parse=scripted(2))
    assert len(opened) == 2 and all(s.closed for s in opened)
    for ep in episodes:
        assert [t.tool_call for t in ep.turns] == ["bash", "bash", "bash", "done"]
        assert [t.observation for t in ep.turns] == [
            "\n[exit 0 ok]\n\n", "\n[exit 0 ok]\nhello\n\n", "\n[exit 0 ok]\n2\n\n", ""]
        assert ep.finish_reason == "stop"
        assert len(ep.completion_ids) == len(ep.logprobs) == len(ep.completion_mask)
        policy_tokens = sum(len(policy.tokenizer(t.action, add_special_tokens=False)["input_ids"]) for t in ep.turns)
        assert sum(ep.completion_mask) >= policy_tokens  # + EOS tokens of actions that stopped
        assert all(lp == 0.0 for lp, m in zip(ep.logprobs, ep.completion_mask) if m == 0)

    # The trainer's recomputed logprobs match on the policy's tokens (observations are context).
    for ep, ref in zip(episodes, recomputed(policy, episodes, 1.0)):
        diffs = [abs(a - b) for a, b, m in zip(ep.logprobs, ref, ep.completion_mask) if m]
        assert max(diffs) < TOLERANCE

    # Stored as a Rollout (turns + completion_mask) and read back unchanged.
    ep = episodes[0]
    ro = Rollout(rollout_id="t-i1-g0", task_id="t", domain="agent", group_index=0, policy_version="t", engine="hf",
                 prompt="task A:", completion=ep.text, prompt_token_ids=ep.prompt_ids,
                 completion_token_ids=ep.completion_ids, logprobs=ep.logprobs, finish_reason=ep.finish_reason,
                 prompt_tokens=len(ep.prompt_ids), completion_tokens=len(ep.completion_ids), turns=ep.turns,
                 completion_mask=ep.completion_mask)
    back = from_table(Rollout, to_table([ro]))[0]
    assert back == ro and all(type(t) is Turn for t in back.turns)

    # The trainer sees only the policy's tokens.
    sample = Sample(ep.prompt_ids, ep.completion_ids, ep.logprobs, 1.0, ep.completion_mask)
    _, _, mask = pad_batch([(sample.prompt_ids, sample.completion_ids)], policy.pad_id)
    masked = apply_sample_masks([sample], mask)
    assert int(masked.sum()) == sum(ep.completion_mask) == sample.trained_tokens
    assert token_weights([sample], "token_mean") == [1.0 / sum(ep.completion_mask)]


def test_parse_action_and_observation() -> None:
    from components.core.jobs import JobResult

    assert parse_action("  ls -la \n") == ("bash", "ls -la", False)
    assert parse_action("DONE") == ("done", "", True)
    assert parse_action("DONE now") == ("done", "", True)
    assert parse_action("   ") == ("done", "", True)
    r = JobResult(status="failed", exit_code=1, signal=0, stdout="out", stderr="err", duration_s=0.1, cpu_time_s=0.0,
                  peak_memory_mb=1.0)
    assert format_observation(r) == "\n[exit 1 failed]\nouterr\n"
    assert format_observation(r, limit=2) == "\n[exit 1 failed]\nou\n"


@pytest.mark.skipif(bool(bwrap_unavailable()), reason=f"needs bubblewrap sessions: {bwrap_unavailable()}")
def test_scripted_action_with_a_lone_surrogate_is_recorded() -> None:
    """A scripted actor's lone surrogate (no UTF-8 text holds one) becomes U+FFFD, as a
    model's decoded text would: the command runs and the episode's Rollout is written."""
    from components.sandbox.session import SandboxSession

    actions = iter(["echo a\ud800b\n", "DONE"])
    episodes = run_episodes(lambda _context: next(actions), ["task:"],
                            lambda _: SandboxSession(sandbox_config(timeout_s=5.0)), max_steps=3)
    ep = episodes[0]
    assert ep.commands == ["echo a\ufffdb"]
    assert [t.action for t in ep.turns] == ["echo a\ufffdb\n", "DONE"]
    assert ep.turns[0].observation == "\n[exit 0 ok]\na\ufffdb\n\n"
    ro = Rollout(rollout_id="t-i1-g0", task_id="t", domain="agent", group_index=0, policy_version="t", engine="scripted",
                 prompt="task:", completion=ep.text, prompt_token_ids=[], completion_token_ids=[], logprobs=[],
                 finish_reason=ep.finish_reason, prompt_tokens=0, completion_tokens=0, turns=ep.turns, completion_mask=[])
    assert from_table(Rollout, to_table([ro]))[0] == ro


def test_scripted_actor_that_returns_no_text_is_named() -> None:
    with pytest.raises(TypeError, match="scripted actor must return the action as str, got bytes"):
        run_episodes(lambda _context: b"ls", ["task:"], lambda _: None, max_steps=1)


class _Chatty:
    """A session whose every command prints 500 characters."""

    def exec(self, cmd: str, timeout_s: float | None = None) -> SimpleNamespace:
        return SimpleNamespace(exit_code=0, status="ok", stdout="y" * 500, stderr="")

    def close(self) -> None:
        pass


@pytest.mark.parametrize("max_context_tokens", [None, 40])
def test_an_observation_is_cut_to_the_positions_left(max_context_tokens: int | None) -> None:
    """The limit check reserved room for the next action only: the observation after it
    took the episode to 170 tokens on a 96-position model (and 88 against a limit of 40).
    Now it is cut to what fits; the next turn's check then ends the episode."""
    policy = tiny_policy()
    limit = max_context_tokens or policy.model.config.max_position_embeddings  # 96
    episodes = run_episodes(policy, ["task:"], lambda _: _Chatty(), max_steps=20, max_action_tokens=8, seed=0,
                            observation_chars=60, max_context_tokens=max_context_tokens, group_size=2,
                            parse=lambda _text: ("bash", "echo y", False))
    for ep in episodes:
        assert len(ep.prompt_ids) + len(ep.completion_ids) == limit and ep.finish_reason == "length"
        assert len(ep.completion_ids) == len(ep.logprobs) == len(ep.completion_mask)
        full = observation_ids(policy.tokenizer, ep.turns[0].observation, policy.prompt_format, False)
        assert len(full) == 74  # "\n[exit 0 ok]\n" and 60 characters of output, more than 40 positions hold
        observed = [len(list(run)) for masked, run in itertools.groupby(ep.completion_mask) if not masked]
        assert observed[:-1] == [len(full)] * (len(observed) - 1)  # whole, but the last, cut to what fits
        if ep.completion_mask[-1] == 0:
            assert ep.completion_ids[-observed[-1]:] == full[:observed[-1]]
    if max_context_tokens == 40:  # 6 prompt tokens, an 8-token action, then 26 of the observation's 74
        assert [[(m, len(list(r))) for m, r in itertools.groupby(ep.completion_mask)] for ep in episodes] == \
               [[(1, 8), (0, 26)]] * 2
        assert [len(ep.turns) for ep in episodes] == [1, 1]


class _Fixed:
    """A session whose every command ends with ``status`` and ``stderr``; ``close()`` is
    recorded, and raises ``fail_close`` when given."""

    def __init__(self, status: str = "ok", stderr: str = "", fail_close: Exception | None = None) -> None:
        self.status, self.stderr, self.fail_close, self.closed = status, stderr, fail_close, False

    def exec(self, cmd: str, timeout_s: float | None = None) -> SimpleNamespace:
        return SimpleNamespace(exit_code=-1 if self.status == "infra_error" else 0, status=self.status, stdout="",
                               stderr=self.stderr, backend="bwrap", isolation="full")

    def close(self) -> None:
        self.closed = True
        if self.fail_close is not None:
            raise self.fail_close


def test_a_sandbox_that_could_not_start_is_an_outage_not_an_observation() -> None:
    """An ``infra_error`` result was formatted into the policy's context ("[exit -1
    infra_error] could not start bwrap: ENOMEM") and the episode went on, training on the
    host's error text. Now it is an InfraError naming the session and its stderr's tail,
    and every session is still closed, the one whose close() raises included."""
    policy = tiny_policy()
    sessions = [_Fixed(fail_close=RuntimeError("close failed")), _Fixed("infra_error", "x" * 300 + "could not start "
                                                                        "bwrap: ENOMEM"), _Fixed()]
    with pytest.raises(InfraError) as caught:
        run_episodes(policy, ["a:", "b:", "c:"], lambda i: sessions[i], max_steps=3, max_action_tokens=4, seed=1,
                     parse=lambda _text: ("bash", "ls", False))
    assert (caught.value.what, caught.value.where) == ("sandbox session", "bwrap full")
    assert caught.value.reason == "episode 1 (prompt 1) could not run 'ls': " + "x" * 171 + \
        "could not start bwrap: ENOMEM"
    assert [s.closed for s in sessions] == [True, True, True]


def test_every_session_is_closed_when_one_close_raises() -> None:
    sessions = [_Fixed(fail_close=RuntimeError("first close failed")), _Fixed(), _Fixed()]
    with pytest.raises(RuntimeError, match="first close failed"):
        run_episodes(lambda _context: "ls", ["a:", "b:", "c:"], lambda i: sessions[i], max_steps=1)
    assert [s.closed for s in sessions] == [True, True, True]


def test_a_max_new_tokens_near_the_positions_still_gives_episodes_their_turns() -> None:
    """With 95 new tokens on a 96-position model an episode ended before its first action
    (6 prompt tokens + 95 > 96) while one-shot completions were clamped. Each action now
    takes at most the positions left, and the episode ends when none are."""
    policy = tiny_policy()
    episodes = run_episodes(policy, ["task:"], lambda _: _Fixed(), max_steps=4, max_action_tokens=95, seed=0,
                            group_size=2, parse=lambda _text: ("bash", "ls", False))
    for ep in episodes:
        assert len(ep.prompt_ids) == 6 and len(ep.prompt_ids) + len(ep.completion_ids) <= 96
        assert len(ep.turns) >= 1 and ep.commands[0] == "ls"
        actions = [len(list(run)) for masked, run in itertools.groupby(ep.completion_mask) if masked]
        assert actions[0] <= 90  # the positions the prompt left
    assert [len(ep.turns) for ep in episodes] == [1, 3]  # seed 0's draws (hashed turn seeds): one action of all 90
    assert [len(ep.prompt_ids) + len(ep.completion_ids) for ep in episodes] == [96, 96]


def test_an_action_is_cut_to_the_limit_left() -> None:
    """Under ``max_context_tokens`` below the model's positions an action is cut to what
    the limit leaves (the engine clamps only to the model's positions)."""
    policy = tiny_policy()
    episodes = run_episodes(policy, ["task:"], lambda _: _Fixed(), max_steps=4, max_action_tokens=30, seed=0,
                            max_context_tokens=20, parse=lambda _text: ("bash", "ls", False))
    ep = episodes[0]
    assert len(ep.prompt_ids) == 6 and len(ep.completion_ids) == 14 == len(ep.logprobs) == len(ep.completion_mask)
    assert ep.completion_mask[0] == 1 and ep.finish_reason == "length"


def test_special_token_text_in_program_output_is_plain_text_in_the_context() -> None:
    """Output printing ``<eos>`` became the EOS id in the observation tokens (6 EOS in two
    turns of "<eos><eos><eos>"); now it is those characters, and decodes back to them."""
    policy = tiny_policy()

    class Eos(_Fixed):
        def exec(self, cmd: str, timeout_s: float | None = None) -> SimpleNamespace:
            return SimpleNamespace(exit_code=0, status="ok", stdout="<eos>" * 3, stderr="")

    ep = run_episodes(policy, ["task:"], lambda _: Eos(), max_steps=2, max_action_tokens=4,
                      parse=lambda _text: ("bash", "cat f", False))[0]
    observed = [t for t, m in zip(ep.completion_ids, ep.completion_mask) if m == 0]
    assert policy.eos_id not in observed
    assert ep.turns[0].observation == "\n[exit 0 ok]\n<eos><eos><eos>\n"
    assert policy.tokenizer.decode(observed) == ep.turns[0].observation * 2
    assert ep.text.count("<eos><eos><eos>") == 2
