"""The rollout stage puts prompts to the policy in ``rollout.prompt_format``.

A tiny random policy whose character tokenizer carries a small chat template is saved
as a checkpoint and sampled by the stage as in a run; switching the format changes the
rollouts' prompt token ids to exactly the template's (or the raw) encoding. The same
policy without a template keeps raw prompts under ``auto``, and ``chat`` is a UserError.
"""

from __future__ import annotations

import pytest

from components.core.errors import UserError
from components.core.facts import StartingPolicy
from components.core.policy import save_policy
from components.core.recipe import parse_recipe
from components.core.records import Rollout, Task, from_table
from components.core.runner import make_context
from components.core.storage import Store
from tests.core.test_prompts import TEMPLATE
from tests.reward.builders import write_stage
from tests.rollout.helpers import tiny_policy
from tests.sandbox.helpers import bwrap_unavailable, sandbox_config

TASK = Task(task_id="math-t", domain="math", split="train", difficulty=1, prompt="hi", context_tokens=2,
            reference={"answer": "1"})


def rollouts(root, fmt: str, template: str | None) -> list[Rollout]:
    store = Store(str(root), "test")
    tiny = tiny_policy(seed=3)
    tiny.tokenizer.chat_template = template
    save_policy(tiny.model, tiny.tokenizer, store, "ckpt")
    recipe = parse_recipe({"pipeline": "p", "rollout": {"group_size": 2, "shards": 1, "max_new_tokens": 3,
                                                        "batch_size": 4, "prompt_format": fmt}})
    write_stage(store, "p", 1, "taskgen", None, {"tasks": ([TASK], Task)},
                StartingPolicy(policy_version="1", policy_uri=store.url("ckpt")))
    from components.rollout import stage

    ctx = make_context("rollout", recipe, store.uri, 1, "0/1")
    stage.inputs(ctx)
    stage.run(ctx)
    return from_table(Rollout, store.read_table(ctx.outputs["rollouts"].path))


def test_switching_the_prompt_format_changes_the_prompt_ids(tmp_path) -> None:
    chat = rollouts(tmp_path / "chat", "chat", TEMPLATE)
    raw = rollouts(tmp_path / "raw", "raw", TEMPLATE)
    auto = rollouts(tmp_path / "auto", "auto", TEMPLATE)
    assert [r.prompt_token_ids for r in chat] == [[1, 34, 81, 21, 22, 2, 1, 14, 81]] * 2  # <bos>u:hi<eos><bos>a:
    assert [r.prompt_tokens for r in chat] == [9, 9]
    assert [r.prompt_token_ids for r in raw] == [[1, 21, 22]] * 2  # <bos>hi
    assert [r.prompt_token_ids for r in auto] == [r.prompt_token_ids for r in chat]


def test_without_a_template_auto_is_raw_and_chat_is_a_user_error(tmp_path) -> None:
    assert [r.prompt_token_ids for r in rollouts(tmp_path / "auto", "auto", None)] == [[1, 21, 22]] * 2
    with pytest.raises(UserError) as err:
        rollouts(tmp_path / "chat", "chat", None)
    assert (err.value.field, err.value.value) == ("rollout.prompt_format", "chat")


def segments(ids: list[int], mask: list[int]) -> list[tuple[int, list[int]]]:
    """(mask value, ids) runs of an episode's completion."""
    out: list[tuple[int, list[int]]] = []
    for t, m in zip(ids, mask):
        if out and out[-1][0] == m:
            out[-1][1].append(t)
        else:
            out.append((m, [t]))
    return out


@pytest.mark.skipif(bool(bwrap_unavailable()), reason=f"needs bubblewrap sessions: {bwrap_unavailable()}")
def test_under_chat_each_observation_is_the_next_user_turn() -> None:
    from components.core import prompts
    from components.core.policy import Policy
    from components.rollout.episode import run_episodes
    from components.sandbox.session import SandboxSession
    from tests.rollout.test_episode import scripted

    tiny = tiny_policy()
    tiny.tokenizer.chat_template = TEMPLATE
    policy = Policy(model=tiny.model, tokenizer=tiny.tokenizer, uri="", prompt_format="chat")
    [ep] = run_episodes(policy, ["go"], lambda _: SandboxSession(sandbox_config(timeout_s=5.0)), max_steps=2,
                        max_action_tokens=4, seed=2, parse=scripted(1))
    assert ep.prompt_ids == [1, 34, 81, 20, 28, 2, 1, 14, 81]  # <bos>u:go<eos><bos>a:
    runs = segments(ep.completion_ids, ep.completion_mask)
    assert [m for m, _ in runs] == [1, 0, 1, 0]  # action, observation, action, observation
    for (_, action), (_, observed), turn in zip(runs[::2], runs[1::2], ep.turns):
        stopped = action[-1] == policy.eos_id
        assert observed == prompts.observation_ids(policy.tokenizer, turn.observation, "chat", stopped)
        assert observed[-3:] == [1, 14, 81] and observed[observed.index(1):][:3] == [1, 34, 81]  # <bos>u: ... <bos>a:
    assert ep.turns[0].observation == "\n[exit 0 ok]\n\n"


def test_serve_encodes_text_prompts_in_its_prompt_format() -> None:
    from components.core.policy import Policy
    from components.rollout.cli import add_parser
    from components.rollout.serve import complete

    tiny = tiny_policy()
    tiny.tokenizer.chat_template = TEMPLATE
    body = {"prompt": "hi", "max_tokens": 1, "temperature": 0}
    chat = complete(Policy(model=tiny.model, tokenizer=tiny.tokenizer, uri="", prompt_format="chat"), body)
    raw = complete(Policy(model=tiny.model, tokenizer=tiny.tokenizer, uri="", prompt_format="raw"), body)
    assert (chat["usage"]["prompt_tokens"], raw["usage"]["prompt_tokens"]) == (9, 3)
    ids = complete(Policy(model=tiny.model, tokenizer=tiny.tokenizer, uri="", prompt_format="chat"), {**body, "prompt": [1, 21]})
    assert ids["usage"]["prompt_tokens"] == 2  # token ids are used as they are

    import argparse

    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="command"))
    assert parser.parse_args(["serve", "--checkpoint", "c", "--prompt-format", "chat"]).prompt_format == "chat"
    assert parser.parse_args(["serve", "--checkpoint", "c"]).prompt_format == "auto"  # as rollout.prompt_format
