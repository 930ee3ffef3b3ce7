"""The rollout stage plays interactive tasks as episodes and leaves one-shot tasks as they were.

A tiny random policy (saved as a checkpoint, loaded by the stage as in a run) meets a
taskgen output holding one one-shot terminal task and one interactive terminal task;
the stage runs as the runner runs it, against real bwrap sessions.
"""

from __future__ import annotations

import random

import pytest

from components.core.facts import StartingPolicy
from components.core.policy import save_policy
from components.core.recipe import parse_recipe
from components.core.records import Rollout, Task
from components.core.runner import make_context
from components.core.storage import Store
from components.domains.base import judge
from components.domains.execute import execute
from components.domains.terminal import Terminal
from components.sandbox.executor import get_executor
from tests.reward.builders import write_stage
from tests.rollout.helpers import TINY, tiny_policy
from tests.sandbox.helpers import bwrap_unavailable

pytestmark = pytest.mark.skipif(bool(bwrap_unavailable()), reason=f"needs bubblewrap sessions: {bwrap_unavailable()}")
TERMINAL = Terminal()
G = 2


def one_shot_task() -> Task:
    for seed in range(50):
        task = TERMINAL.make_task(random.Random(seed), "train")
        if task.difficulty == 1:
            return task
    raise AssertionError("no difficulty-1 task")


def rollout_stage(root, tasks: list[Task], **rollout) -> tuple[dict, list[Rollout], object]:
    store = Store(str(root), "test")
    if not store.exists("ckpt/config.json"):
        tiny = tiny_policy(seed=3)
        save_policy(tiny.model, tiny.tokenizer, store, "ckpt")
    recipe = parse_recipe({"pipeline": "p", "rollout": {"group_size": G, "shards": 1, "max_new_tokens": 6,
                                                        "observation_chars": 16, "batch_size": 8, **rollout},
                           "sandbox": {"timeout_s": 5.0}})
    write_stage(store, "p", 1, "taskgen", None, {"tasks": (tasks, Task)},
                StartingPolicy(policy_version="1", policy_uri=store.url("ckpt")))
    from components.rollout import stage

    ctx = make_context("rollout", recipe, store.uri, 1, "0/1")
    stage.inputs(ctx)
    metrics = stage.run(ctx)
    return metrics, _written(store, ctx), recipe


def _written(store: Store, ctx) -> list[Rollout]:
    from components.core.records import from_table

    return from_table(Rollout, store.read_table(ctx.outputs["rollouts"].path))


def test_interactive_tasks_become_episodes_and_one_shot_tasks_do_not_change(tmp_path) -> None:
    plain = one_shot_task()
    played = TERMINAL.make_interactive_task(random.Random(1), "train")
    metrics, rollouts, recipe = rollout_stage(tmp_path, [plain, played], max_turns=2)
    alone_metrics, alone, _ = rollout_stage(tmp_path / "alone", [plain], max_turns=2)

    assert [r.task_id for r in rollouts] == [plain.task_id] * G + [played.task_id] * G
    assert [r.group_index for r in rollouts] == [0, 1, 0, 1]
    # The one-shot task went through today's path: the same samples as a run without the episode.
    assert rollouts[:G] == alone and all(not r.turns and not r.completion_mask for r in alone)
    assert alone_metrics["episodes"] == 0 and alone_metrics["turns_mean"] == 0.0

    episodes = rollouts[G:]
    assert metrics["episodes"] == G
    commands = [[t.action for t in r.turns if t.tool_call == "bash"] for r in episodes]
    assert metrics["turns_mean"] == sum(len(c) for c in commands) / G
    for r, cmds in zip(episodes, commands):
        assert r.turns and len(cmds) <= 2
        assert r.completion == "\n".join(c.strip().split("\n")[0].strip() for c in cmds)
        assert len(r.completion_token_ids) == len(r.logprobs) == len(r.completion_mask) == r.completion_tokens
        assert set(r.completion_mask) <= {0, 1} and 1 in r.completion_mask
        assert all(lp == 0.0 for lp, m in zip(r.logprobs, r.completion_mask) if m == 0)
        observed = sum(len(t.observation) for t in r.turns)  # one token per character (character tokenizer)
        # the last observation is cut to the model's positions (this prompt takes 41 of them)
        room = TINY.max_positions - len(r.prompt_token_ids) - r.completion_mask.count(1)
        assert r.completion_mask.count(0) == min(observed, room)
        assert len(r.prompt_token_ids) + len(r.completion_token_ids) <= TINY.max_positions
        for t in r.turns:
            if t.tool_call == "bash":  # the output the policy saw is capped at rollout.observation_chars
                assert len(t.observation.split("]\n", 1)[1]) <= 16 + 1

    # The sandbox stage's path replays each episode's commands and the verifier reads the state.
    with get_executor(recipe.sandbox) as executor:
        results = execute([(r.rollout_id, played, r.completion) for r in episodes], executor, 2)
    verdicts = [judge(TERMINAL, played, r.completion, results[r.rollout_id]) for r in episodes]
    assert all(v.status == "ok" and v.components["ran"] == 1.0 for v in verdicts)
    assert [v.components["steps"] for v in verdicts] == [float(len(c)) for c in commands]


def test_max_turns_caps_the_episode(tmp_path) -> None:
    played = TERMINAL.make_interactive_task(random.Random(1), "train")
    _, one, _ = rollout_stage(tmp_path, [played], max_turns=1)
    assert all(len(r.turns) == 1 for r in one)
    assert all(r.finish_reason == ("stop" if r.turns[0].tool_call == "done" else "length") for r in one)


def test_an_iteration_trains_on_interactive_tasks_from_a_task_file(tmp_path, monkeypatch) -> None:
    """bootstrap -> taskgen (a task file of interactive terminal tasks) -> rollout -> sandbox ->
    reward -> validation -> trainer, as ``posttrain run`` runs the stages."""
    import json

    import yaml

    from components.core.records import Reward
    from components.core.runner import run_stage
    from tests.fixtures.home import TINY_RECIPE, reset_tracking_clients, use_home

    tasks = {}
    for seed in range(40):
        t = TERMINAL.make_interactive_task(random.Random(seed), "train")
        tasks[t.task_id] = t
    file = tmp_path / "tasks.jsonl"
    file.write_text("".join(json.dumps({"domain": t.domain, "prompt": t.prompt, "reference": t.reference,
                                        "difficulty": t.difficulty, "metadata": t.metadata}) + "\n"
                            for t in tasks.values()))
    recipe = yaml.safe_load(TINY_RECIPE.read_text())
    recipe.update(domains=["terminal"], taskgen={"tasks_per_iteration": 4, "task_file": str(file)},
                  rollout={**recipe["rollout"], "shards": 1, "max_turns": 2, "observation_chars": 16})
    recipe["model"]["max_positions"] = 128
    recipe["bootstrap"].update(max_steps=2, eval_every=2)
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    use_home(monkeypatch, tmp_path / ".posttrain")
    root = f"file://{tmp_path / 'store'}"
    try:
        run_stage("bootstrap", path, root, 0)
        for stage, shard in [("taskgen", None), ("rollout", "0/1"), ("sandbox", "0/1"), ("reward", "0/1"),
                             ("validation", None), ("trainer", None)]:
            run_stage(stage, path, root, 1, shard)
    finally:
        reset_tracking_clients()
    store = Store(root, "test")
    rollouts = _read(store, "tiny/iter-000001/rollout/shard-00000-of-00001/rollouts.parquet", Rollout)
    rewards = _read(store, "tiny/iter-000001/reward/shard-00000-of-00001/rewards.parquet", Reward)
    assert len(rollouts) == 4 * 4 and all(r.task_id in tasks and r.turns and r.completion_mask for r in rollouts)
    assert {r.rollout_id for r in rewards} == {r.rollout_id for r in rollouts}
    assert all(r.status == "ok" and "state_match" in r.components for r in rewards)
    assert store.exists("tiny/iter-000001/trainer/_MANIFEST.json")
    metrics = store.read_json("tiny/iter-000001/rollout/shard-00000-of-00001/_MANIFEST.json")["metrics"]
    assert metrics["rollout/episodes"] == 16
    assert metrics["rollout/turns_mean"] == sum(sum(t.tool_call == "bash" for t in r.turns) for r in rollouts) / 16


def _read(store: Store, rel: str, cls):
    from components.core.records import from_table

    return from_table(cls, store.read_table(rel))


def test_episodes_need_the_hf_engine_and_a_backend_with_sessions() -> None:
    from components.core.errors import UserError
    from components.rollout.interactive import interactive_specs, play

    played = TERMINAL.make_interactive_task(random.Random(1), "train")
    recipe = parse_recipe({"pipeline": "p", "sandbox": {"backend": "subprocess", "allow_weak_isolation": True}})
    specs = interactive_specs([played])
    with pytest.raises(UserError) as info:
        play(lambda context: "ls", [played], specs, recipe.rollout, recipe.sandbox, seed=0, iteration=1)
    assert (info.value.field, info.value.value) == ("sandbox.backend", "subprocess")
    assert "['bwrap']" in str(info.value)
    with pytest.raises(UserError) as info:
        play(lambda context: "ls", [played], specs, recipe.rollout, recipe.sandbox, seed=0, iteration=1,
             engine_name="openai")
    assert (info.value.field, info.value.value) == ("rollout.engine", "openai")


def test_an_engine_episodes_cannot_use_is_refused_before_any_sampling(tmp_path, monkeypatch) -> None:
    """With ``rollout.engine: openai`` the stage sampled every one-shot task's G samples
    and only then refused the interactive task; it now refuses before any generation."""
    from components.core.errors import UserError
    from components.rollout import openai_engine

    sent: list[str] = []
    monkeypatch.setattr(openai_engine.OpenAIEngine, "generate",
                        lambda self, policy, prompts, *args, **kwargs: sent.extend(prompts) or [])
    played = TERMINAL.make_interactive_task(random.Random(1), "train")
    with pytest.raises(UserError) as info:
        rollout_stage(tmp_path, [one_shot_task(), played], engine="openai")
    assert (info.value.field, info.value.value) == ("rollout.engine", "openai")
    assert sent == []
