"""``reward.domain_weights`` reaches the update: rewards scored by the reward stage's
``score``, groups the trainer selects (without dynamic sampling unless a test says so), one
``grpo_step`` from the same init. A changed weight changes the parameters; weight 0 equals
leaving the domain out, with or without dynamic sampling (the same gradient and update);
under ``domain_zscore`` (which group-std scaling cancels) the weight still acts. Not
covered: several steps (weight 0 is checked on one step from a fresh optimizer)."""

from __future__ import annotations

import pytest
import torch

from components.core.policy import pad_batch, token_logprobs
from components.core.recipe import TrainerConfig, parse_recipe
from components.core.records import Reward, Rollout, Task
from components.domains.base import make_task
from components.reward.stage import score
from components.trainer.grpo import grpo_step
from components.trainer.sampling import collect_groups, select_groups
from components.trainer.state import build_optimizer
from tests.rollout.helpers import tiny_policy

GROUPS = [
    (make_task("math", "train", 1, "3*4-5=", {"answer": "7"}), ["7", "8", "70", "1"]),
    (make_task("math", "train", 1, "2+3*4=", {"answer": "14"}), ["14", "20", "14", "4"]),
    (make_task("arithmetic", "train", 1, "12+5=", {"answer": "17"}), ["17", "18", "7", "17"]),
    (make_task("arithmetic", "train", 1, "4+4=", {"answer": "8"}), ["8", "9", "88", "16"]),
]
TASKS: dict[str, Task] = {t.task_id: t for t, _ in GROUPS}


def build_groups(rollouts, rewards, dynamic: bool = False):
    """The groups the trainer stage trains on: without dynamic sampling those with signal;
    with it, every informative group of a domain weighted above 0 (one per step, as many
    steps as there are groups), in task order."""
    return select_groups(collect_groups(rollouts, rewards), dynamic=dynamic, prompts_per_step=1,
                         target_steps=len(GROUPS) if dynamic else 0, seed=0).groups


def rollouts() -> list[Rollout]:
    """Fixed completions with the tiny policy's own token ids and logprobs (every ratio 1)."""
    policy = tiny_policy()
    out = []
    for task, completions in GROUPS:
        prompt_ids = policy.encode_prompt(task.prompt)
        for i, text in enumerate(completions):
            comp = list(policy.tokenizer(text, add_special_tokens=False)["input_ids"]) + [policy.eos_id]
            ids, attn, _ = pad_batch([(prompt_ids, comp)], policy.pad_id)
            with torch.no_grad():
                logp, _ = token_logprobs(policy.model, ids, attn)
            start = len(prompt_ids) - 1
            out.append(Rollout(rollout_id=f"{task.task_id}-{i}", task_id=task.task_id, domain=task.domain, group_index=i,
                               policy_version="t", engine="test", prompt=task.prompt, completion=text,
                               prompt_token_ids=prompt_ids, completion_token_ids=comp,
                               logprobs=[float(x) for x in logp[0, start:start + len(comp)]], finish_reason="stop",
                               prompt_tokens=len(prompt_ids), completion_tokens=len(comp)))
    return out


ROLLOUTS = rollouts()
DOMAIN_OF = {tuple(r.prompt_token_ids): r.domain for r in ROLLOUTS}


def rewards(**reward) -> list[Reward]:
    cfg = parse_recipe({"pipeline": "w", "domains": ["math", "arithmetic"], "reward": reward}).reward
    return score(TASKS, ROLLOUTS, {}, cfg)


def trained(groups) -> dict[str, torch.Tensor]:
    """Parameters after one GRPO step from the same init on ``groups``."""
    policy = tiny_policy()
    optimizer = build_optimizer(policy.model, TrainerConfig(learning_rate=1e-2))
    samples = [s for g in groups for s in g]
    grpo_step(policy.model, optimizer, samples, pad_id=policy.pad_id, clip_eps=0.2, kl_coef=0.0, temperature=1.0,
              micro_batch_size=4, max_grad_norm=1.0)
    return {n: p.detach().clone() for n, p in policy.model.named_parameters()}


def gradient(groups) -> torch.Tensor:
    """The gradient of one GRPO step's loss on ``groups`` at the init (all parameters, flat)."""
    policy = tiny_policy()
    optimizer = torch.optim.SGD(policy.model.parameters(), lr=0.0)
    grpo_step(policy.model, optimizer, [s for g in groups for s in g], pad_id=policy.pad_id, clip_eps=0.2, kl_coef=0.0,
              temperature=1.0, micro_batch_size=4, max_grad_norm=1e6)
    return torch.cat([p.grad.flatten() for p in policy.model.parameters()])


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(a[n], b[n]) for n in a)


def advantages(groups) -> list[float]:
    return [s.advantage for g in groups for s in g]


def test_every_group_carries_signal():
    groups = build_groups(ROLLOUTS, rewards())
    assert len(groups) == 4 and all(len(g) == 4 for g in groups)


def test_a_domain_weight_changes_the_update():
    plain, doubled = build_groups(ROLLOUTS, rewards()), build_groups(ROLLOUTS, rewards(domain_weights={"math": 2.0}))
    expected = [s.advantage * (2.0 if DOMAIN_OF[tuple(s.prompt_ids)] == "math" else 1.0) for g in plain for s in g]
    assert advantages(doubled) == pytest.approx(expected)
    assert advantages(doubled) != pytest.approx(advantages(plain))
    assert not same(trained(plain), trained(doubled))
    assert same(trained(plain), trained(build_groups(ROLLOUTS, rewards())))  # the step itself is deterministic


@pytest.mark.parametrize("dynamic", [False, True])
def test_weight_zero_equals_training_without_the_domain(dynamic: bool):
    """Under dynamic sampling the arithmetic groups (rewards differ, weight 0) were kept as
    informative: their tokens entered the loss denominators and shrank math's gradient."""
    zero = build_groups(ROLLOUTS, rewards(domain_weights={"arithmetic": 0.0}), dynamic)
    without = build_groups([r for r in ROLLOUTS if r.domain != "arithmetic"], rewards(), dynamic)
    assert len(zero) == 2 and advantages(zero) == advantages(without)
    assert torch.equal(gradient(zero), gradient(without))
    assert same(trained(zero), trained(without))
    assert not same(trained(zero), trained(build_groups(ROLLOUTS, rewards(), dynamic)))


def test_the_weight_survives_domain_zscore():
    # Per-domain z-scoring is affine within a domain, so group-std scaling cancels it ...
    plain, zscored = build_groups(ROLLOUTS, rewards()), build_groups(ROLLOUTS, rewards(normalize="domain_zscore"))
    assert advantages(zscored) == pytest.approx(advantages(plain), abs=1e-4)
    # ... but the weight acts after that scaling, so it is not cancelled.
    weighted = build_groups(ROLLOUTS, rewards(normalize="domain_zscore", domain_weights={"math": 3.0}))
    assert advantages(weighted) == pytest.approx(
        [s.advantage * (3.0 if DOMAIN_OF[tuple(s.prompt_ids)] == "math" else 1.0) for g in zscored for s in g], abs=1e-4)
    assert not same(trained(zscored), trained(weighted))
