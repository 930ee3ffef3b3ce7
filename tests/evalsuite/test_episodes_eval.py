"""The eval suite scores interactive tasks as greedy episodes, in their own multi_turn slices."""

from __future__ import annotations

import random

import pytest

from components.core.recipe import parse_recipe
from components.domains.terminal import Terminal
from components.evalsuite.episodes import MULTI_TURN, score_episodes
from components.evalsuite.report import slice_name, slices
from components.evalsuite.suite import run_suite, sampled_pass_at_k
from components.sandbox.executor import get_executor
from tests.domains.test_terminal_interactive import actor, interactive_task
from tests.rollout.helpers import tiny_policy
from tests.sandbox.helpers import bwrap_unavailable

pytestmark = pytest.mark.skipif(bool(bwrap_unavailable()), reason=f"needs bubblewrap sessions: {bwrap_unavailable()}")
RECIPE = parse_recipe({"pipeline": "e", "domains": ["terminal"], "sandbox": {"timeout_s": 5.0},
                       "evaluation": {"max_new_tokens": 8}, "rollout": {"observation_chars": 16}})


def test_only_the_reading_policy_passes_and_episodes_are_their_own_slice() -> None:
    tasks = [interactive_task("pick"), interactive_task("note")]
    with get_executor(RECIPE.sandbox) as executor:
        reads = score_episodes(actor(True), tasks, RECIPE, executor, "v1")
        blind = score_episodes(actor(False), tasks, RECIPE, executor, "v1")
    assert [(r.task_id, r.passed, r.score, r.context_bucket) for r in reads] == [
        (t.task_id, True, 1.0, MULTI_TURN) for t in tasks]
    assert [r.completion for r in reads] == [t.reference["solution"] for t in tasks]
    assert [r.passed for r in blind] == [False, False]
    assert [slice_name(row) for row in slices(reads)] == ["terminal/d3/multi_turn"]


def test_run_suite_plays_interactive_tasks_and_leaves_one_shot_tasks_alone() -> None:
    policy = tiny_policy()
    plain = Terminal().make_task(random.Random(3), "eval")
    played = interactive_task("note")
    with get_executor(RECIPE.sandbox) as executor:
        mixed = run_suite(policy, [played, plain], RECIPE, executor)
        alone = run_suite(policy, [plain], RECIPE, executor)
        assert sampled_pass_at_k(policy, [played], RECIPE, executor, 2, 1.0, 0) == {}
    assert [r.task_id for r in mixed] == [played.task_id, plain.task_id]
    assert mixed[1] == alone[0] and alone[0].context_bucket != MULTI_TURN
    assert mixed[0].context_bucket == MULTI_TURN and mixed[0].passed is False  # a random policy
    assert len(mixed[0].completion.split("\n")) <= RECIPE.rollout.max_turns


def test_a_sandbox_that_cannot_run_an_episodes_command_is_an_outage(monkeypatch) -> None:
    """A greedy eval episode whose command ended in ``infra_error`` went on with the host's
    error text as its observation; now the eval fails as an outage (retried)."""
    from components.core.errors import InfraError
    from components.core.jobs import JobResult
    from components.rollout import episode

    monkeypatch.setattr(episode.ReplaySession, "exec", lambda self, cmd, timeout_s=None: JobResult(
        "infra_error", -1, 0, "", "could not start bwrap: ENOMEM", 0.0, 0.0, 0.0, backend="bwrap"))
    with get_executor(RECIPE.sandbox) as executor, pytest.raises(InfraError) as caught:
        score_episodes(actor(True), [interactive_task("pick")], RECIPE, executor, "v1")
    assert (caught.value.what, caught.value.where) == ("sandbox session", "bwrap")
    assert caught.value.reason == "episode 0 (prompt 0) could not run 'grep -l ok *': could not start bwrap: ENOMEM"
