"""Exact resume: 3 steps straight == 1 step, save (weights + trainer_state.pt), reload
into fresh objects, 2 more steps — bit for bit. Plus the LR schedule's values."""

from __future__ import annotations

import math
import random

import pytest
import torch

from components.core.errors import UserError
from components.core.policy import load_policy, save_policy
from components.core.recipe import TrainerConfig
from components.core.seeds import configure_torch
from components.core.storage import Store
from components.trainer.grpo import grpo_step, step_batches
from components.trainer.state import (
    STATE_FILE,
    DataPosition,
    build_optimizer,
    build_scheduler,
    load_trainer_state,
    lr_factor,
    save_trainer_state,
)
from tests.rollout.helpers import tiny_policy
from tests.trainer.test_grpo_step import rollout_batch

CFG = TrainerConfig(learning_rate=5e-3, lr_schedule="cosine", warmup_steps=1, decay_steps=4, min_lr_ratio=0.1,
                    micro_batch_size=3, loss_aggregation="sequence_mean")


def train(model, optimizer, scheduler, batches, start: int, stop: int) -> list[float]:
    losses = []
    for batch in batches[start:stop]:
        # Stand-in for any randomness a step might draw (dropout, sampling): it must resume too.
        jitter = torch.rand(()).item() * 1e-6 + random.random() * 1e-6
        stats = grpo_step(model, optimizer, batch, pad_id=0, clip_eps=CFG.clip_eps, kl_coef=0.05 + jitter,
                          temperature=1.0, micro_batch_size=CFG.micro_batch_size, max_grad_norm=CFG.max_grad_norm,
                          loss_aggregation=CFG.loss_aggregation, scheduler=scheduler)
        losses.append(stats.loss)
    return losses


def fresh(policy):
    optimizer = build_optimizer(policy.model, CFG)
    return optimizer, build_scheduler(optimizer, CFG)


def test_resume_is_bit_identical(tmp_path) -> None:
    # As in the trainer stage: the configured intra-op thread count (one by default). With
    # several threads the embedding gradient's summation order, and so its last bits, vary.
    configure_torch()
    policy = tiny_policy()
    samples = rollout_batch(policy)
    batches = step_batches([samples[:4], samples[4:]], prompts_per_step=1, epochs=2, seed=1)  # 4 steps of one group
    store = Store(str(tmp_path), "test")

    torch.manual_seed(123)
    random.seed(123)
    straight = tiny_policy()
    opt, sched = fresh(straight)
    losses = train(straight.model, opt, sched, batches, 0, 3)
    straight_lr = opt.param_groups[0]["lr"]

    torch.manual_seed(123)
    random.seed(123)
    first = tiny_policy()
    opt, sched = fresh(first)
    losses_a = train(first.model, opt, sched, batches, 0, 1)
    save_policy(first.model, first.tokenizer, store, "ckpt")
    save_trainer_state(store, "ckpt", opt, sched, DataPosition(iteration=1, steps_done=1, global_step=1))
    torch.manual_seed(999)  # the "crash": whatever ran after the save must not matter
    random.seed(999)
    del first, opt, sched

    resumed = load_policy(store.url("ckpt"))
    opt, sched = fresh(resumed)
    position = load_trainer_state(store, "ckpt", opt, sched, CFG, restore_rng=True)
    assert position == DataPosition(iteration=1, steps_done=1, global_step=1)
    assert sched.last_epoch == 1 and opt.param_groups[0]["lr"] == CFG.learning_rate * lr_factor(1, CFG)
    losses_b = train(resumed.model, opt, sched, batches, position.steps_done, 3)

    assert losses_a + losses_b == losses
    for (name, a), (_, b) in zip(straight.model.named_parameters(), resumed.model.named_parameters()):
        assert torch.equal(a, b), name
    assert opt.state_dict()["state"][0]["step"] == torch.tensor(3.0)
    assert opt.param_groups[0]["lr"] == straight_lr == CFG.learning_rate * lr_factor(3, CFG)


def test_recipe_learning_rate_wins_and_rng_is_kept_when_carrying_over(tmp_path) -> None:
    policy = tiny_policy()
    store = Store(str(tmp_path), "test")
    opt, sched = fresh(policy)
    train(policy.model, opt, sched, [rollout_batch(policy)], 0, 1)
    save_trainer_state(store, "", opt, sched, DataPosition(iteration=1, steps_done=1, global_step=1))
    changed = CFG.model_copy(update={"learning_rate": 1e-3})
    opt2 = build_optimizer(policy.model, changed)
    sched2 = build_scheduler(opt2, changed)
    torch.manual_seed(7)
    expected_draw = torch.rand(3)
    torch.manual_seed(7)
    assert load_trainer_state(store, "", opt2, sched2, changed, restore_rng=False).global_step == 1
    assert torch.equal(torch.rand(3), expected_draw)  # the iteration's own seed still rules
    assert opt2.param_groups[0]["lr"] == pytest.approx(1e-3 * lr_factor(1, changed))
    assert len(opt2.state) == sum(1 for _ in policy.model.parameters())  # Adam moments came along
    assert load_trainer_state(Store(str(tmp_path / "empty"), "test"), "", opt2, sched2, changed, True) is None


def test_state_of_another_architecture_is_a_user_error(tmp_path) -> None:
    policy = tiny_policy()
    store = Store(str(tmp_path), "test")
    opt, sched = fresh(policy)
    save_trainer_state(store, "c", opt, sched, DataPosition(1, 0, 0))
    other = build_optimizer(torch.nn.Linear(2, 2), CFG)  # 2 parameters, not the policy's
    with pytest.raises(UserError, match=f"trainer_state=.*c/{STATE_FILE}.*carry_optimizer_state: false"):
        load_trainer_state(store, "c", other, build_scheduler(other, CFG), CFG, restore_rng=False)


@pytest.mark.parametrize("schedule,step,expected", [
    ("constant", 0, 0.5), ("constant", 1, 1.0), ("constant", 50, 1.0),  # warmup 2 steps, then flat
    ("linear", 2, 1.0), ("linear", 7, 0.1 + 0.9 * 0.5), ("linear", 12, 0.1), ("linear", 99, 0.1),
    ("cosine", 2, 1.0), ("cosine", 7, 0.1 + 0.9 * 0.5), ("cosine", 12, 0.1),
    ("cosine", 4, 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.2))),
])
def test_lr_schedule(schedule: str, step: int, expected: float) -> None:
    cfg = TrainerConfig(lr_schedule=schedule, warmup_steps=2, decay_steps=10, min_lr_ratio=0.1)
    assert lr_factor(step, cfg) == pytest.approx(expected)


def test_under_lora_the_schedule_position_is_carried_and_the_moments_are_not(tmp_path) -> None:
    """Each iteration trains fresh adapters: the saved Adam moments are not theirs, but the
    schedule goes on (before, every iteration warmed up again from step 0)."""
    from components.trainer.lora import apply_lora

    lora_cfg = CFG.model_copy(update={"lora": CFG.lora.model_copy(update={"rank": 4})})
    store = Store(str(tmp_path), "test")
    first = apply_lora(tiny_policy().model, lora_cfg.lora)
    opt = build_optimizer(first, lora_cfg)
    sched = build_scheduler(opt, lora_cfg)
    for _ in range(3):
        opt.zero_grad()
        sum(p.sum() for p in first.parameters() if p.requires_grad).backward()
        opt.step()
        sched.step()
    assert len(opt.state) > 0  # the first adapters' moments, saved with the state
    save_trainer_state(store, "", opt, sched, DataPosition(iteration=1, steps_done=3, global_step=3))

    second = apply_lora(tiny_policy(seed=1).model, lora_cfg.lora)  # the next iteration's fresh adapters
    opt2 = build_optimizer(second, lora_cfg)
    sched2 = build_scheduler(opt2, lora_cfg)
    position = load_trainer_state(store, "", opt2, sched2, lora_cfg, restore_rng=False)
    assert position.global_step == 3 and sched2.last_epoch == 3
    assert opt2.param_groups[0]["lr"] == pytest.approx(lora_cfg.learning_rate * lr_factor(3, lora_cfg))
    assert len(opt2.state) == 0  # no moments from the previous adapters


@pytest.mark.parametrize(("carry", "rank", "carried"), [(True, 0, True), (False, 0, False), (True, 4, True), (False, 4, False)])
def test_carry_optimizer_state_decides_what_the_trainer_takes_in(tmp_path, carry: bool, rank: int, carried: bool) -> None:
    """``trainer.carry_optimizer_state: false`` starts every iteration with fresh moments and
    schedule; under LoRA the state goes in too (``restore_trainer_state`` then takes only
    the schedule's position)."""
    from components.trainer.stage import _carried

    policy = tiny_policy()
    opt, sched = fresh(policy)
    save_trainer_state(Store(str(tmp_path), "test"), "", opt, sched, DataPosition(iteration=1, steps_done=2, global_step=2))
    cfg = CFG.model_copy(update={"carry_optimizer_state": carry, "lora": CFG.lora.model_copy(update={"rank": rank})})
    data = _carried(f"file://{tmp_path}", cfg)
    assert (data == (tmp_path / STATE_FILE).read_bytes()) if carried else data is None
    assert _carried(f"file://{tmp_path}/elsewhere", cfg) is None  # a checkpoint without a state: nothing
