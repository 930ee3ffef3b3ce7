"""``trainer_state.pt`` read back: anything but the dict the trainer writes is one line.

A tampered file whose manifest digest was rewritten to match reaches these reads; each
case below was a traceback (UnpicklingError, KeyError, TypeError, ValueError) and exit 1,
retried as an outage.
"""

from __future__ import annotations

import io
import os

import pytest
import torch

from components.core.errors import UserError
from components.trainer.state import DataPosition, read_trainer_state, restore_trainer_state, trainer_state_bytes

FIX = "re-run the trainer stage that wrote it, or set trainer.carry_optimizer_state: false"


def _saved(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _model_and_optimizer():
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    return optimizer, scheduler


def _good(steps: int = 9) -> dict:
    """The state after ``steps`` optimizer steps of a Linear(2, 1) (the schedule steps with each)."""
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    for _ in range(steps):
        model(torch.ones(1, 2)).sum().backward()
        optimizer.step()
        scheduler.step()
    return read_trainer_state(trainer_state_bytes(optimizer.state_dict(), scheduler.state_dict(),
                                                  DataPosition(iteration=2, steps_done=3, global_step=steps)), "t")


@pytest.mark.parametrize(("data", "problem"), [
    (os.urandom(64), "is not a trainer state file ("),
    (_saved([1, 2]), "is not a trainer state file (it holds list, not a dict of optimizer, scheduler, rng, position)"),
    (_saved({"optimizer": {}, "scheduler": {}, "rng": {}}),
     "is not a trainer state file (it holds ['optimizer', 'rng', 'scheduler'], not a dict of optimizer, scheduler, rng, "
     "position)"),
    (_saved({"optimizer": {}, "scheduler": {}, "rng": {}, "position": {"iteration": "x", "steps_done": 0,
                                                                      "global_step": 0}}),
     "is not a trainer state file (its position's iteration is 'x', not a whole number from 0 to 2**53 - 1)"),
    (_saved({"optimizer": {}, "scheduler": {}, "rng": {}, "position": {"iteration": 1, "steps_done": -1,
                                                                      "global_step": 0}}),
     "is not a trainer state file (its position's steps_done is '-1', not a whole number from 0 to 2**53 - 1)"),
    # MLflow's SQL store cannot take a step this large: the trainer crashed logging its first step
    (_saved({"optimizer": {}, "scheduler": {"last_epoch": 2**63}, "rng": {},
             "position": {"iteration": 1, "steps_done": 0, "global_step": 2**63}}),
     "is not a trainer state file (its position's global_step is '9223372036854775808', not a whole number from 0 "
     "to 2**53 - 1)"),
    (_saved({"optimizer": {}, "scheduler": {}, "rng": {}, "position": {"iteration": 2**53, "steps_done": 0,
                                                                      "global_step": 0}}),
     "is not a trainer state file (its position's iteration is '9007199254740992', not a whole number from 0 "
     "to 2**53 - 1)"),
], ids=["random-bytes", "a-list", "no-position", "iteration-x", "negative-steps", "huge-global-step", "huge-iteration"])
def test_a_state_file_that_is_not_the_trainers_is_one_line(data: bytes, problem: str) -> None:
    with pytest.raises(UserError) as err:
        read_trainer_state(data, "file:///r/trainer_state.pt")
    assert (err.value.field, err.value.value, err.value.fix) == ("trainer_state", "file:///r/trainer_state.pt", FIX)
    assert err.value.problem.startswith(problem), err.value.problem


def test_the_trainers_own_state_restores_its_position() -> None:
    optimizer, scheduler = _model_and_optimizer()
    from components.core.recipe import TrainerConfig

    position = restore_trainer_state(_good(), optimizer, scheduler, TrainerConfig(learning_rate=1e-3),
                                     restore_rng=True, where="t")
    assert position == DataPosition(iteration=2, steps_done=3, global_step=9)


def test_random_states_the_trainer_cannot_set_are_one_line() -> None:
    from components.core.recipe import TrainerConfig

    state = _good() | {"rng": {"python": "not a state"}}
    optimizer, scheduler = _model_and_optimizer()
    with pytest.raises(UserError) as err:
        restore_trainer_state(state, optimizer, scheduler, TrainerConfig(learning_rate=1e-3), restore_rng=True,
                              where="t")
    assert err.value.problem.startswith("holds random-number states this trainer cannot set (")


LOAD_FIX = ("start from a checkpoint of the same architecture, with the trainer.lora.rank of the run that saved "
            "the state (a LoRA run's holds only its adapters' moments), or set trainer.carry_optimizer_state: false")


def _edited(change) -> dict:
    state = _good()
    change(state)
    return state


def _restore(state: dict, optimizer=None, scheduler=None, load=None) -> DataPosition:
    from components.core.recipe import TrainerConfig

    if optimizer is None:
        optimizer, scheduler = _model_and_optimizer()
    return restore_trainer_state(state, optimizer, scheduler, TrainerConfig(learning_rate=1e-3), restore_rng=False,
                                 where="file:///r/trainer_state.pt", load_optimizer=load)


@pytest.mark.parametrize(("change", "problem"), [
    (lambda s: s["scheduler"].update(last_epoch=-7),
     "is not a trainer state file (its scheduler's last_epoch is '-7', not its position's global_step 9)"),
    (lambda s: s["scheduler"].update(last_epoch="x"),
     "is not a trainer state file (its scheduler's last_epoch is 'x', not its position's global_step 9)"),
    (lambda s: s["scheduler"].update(last_epoch=10**30),
     "is not a trainer state file (its scheduler's last_epoch is '1000000000000000000000000000000', not its "
     "position's global_step 9)"),
    (lambda s: s["scheduler"].update(last_epoch=True),
     "is not a trainer state file (its scheduler's last_epoch is 'True', not its position's global_step 9)"),
    (lambda s: s["scheduler"].pop("last_epoch"), "is not a trainer state file (its scheduler state lacks 'last_epoch')"),
    (lambda s: s.update(scheduler=[9]), "is not a trainer state file (its scheduler state is a list, not a dict)"),
], ids=["negative-position", "text-position", "position-past-global-step", "bool-position", "no-position", "a-list"])
def test_a_schedule_other_than_the_saved_position_is_one_line(change, problem: str) -> None:
    """last_epoch -7 loaded and trained with a negative rate (gradient ascent); 'x' was a
    TypeError and an extra key an AttributeError, both at the first step."""
    optimizer, scheduler = _model_and_optimizer()
    with pytest.raises(UserError) as err:
        _restore(_edited(change), optimizer, scheduler)
    assert (err.value.field, err.value.value, err.value.problem, err.value.fix) == (
        "trainer_state", "file:///r/trainer_state.pt", problem, FIX)
    assert scheduler.last_epoch == 0 and optimizer.param_groups[0]["lr"] == 1e-3  # nothing was loaded


def test_a_schedule_saved_under_another_torch_version_loads() -> None:
    """LambdaLR's state_dict keys change between torch versions (torch <= 2.6 wrote
    ``verbose`` and no ``_is_initial``): such a state was refused as "not a trainer state
    file" after a torch upgrade. Only ``last_epoch`` is read; the other keys are this
    torch's own."""
    def older_torch(s: dict) -> None:
        s["scheduler"].pop("_is_initial", None)
        s["scheduler"].update(verbose=False, a_later_key=1)

    optimizer, scheduler = _model_and_optimizer()
    keys = set(scheduler.state_dict())
    assert _restore(_edited(older_torch), optimizer, scheduler).global_step == 9
    assert scheduler.last_epoch == 9 and scheduler.get_last_lr() == [1e-3] and optimizer.param_groups[0]["lr"] == 1e-3
    assert set(scheduler.state_dict()) == keys


def _moments(change):
    return lambda s: change(s["optimizer"]["state"][0])


@pytest.mark.parametrize(("change", "problem"), [
    (_moments(lambda m: m.update(exp_avg=torch.zeros(1, 4))),
     "parameter 0's exp_avg is (1, 4) torch.float32, the parameter is (1, 2) torch.float32"),
    (_moments(lambda m: m.update(exp_avg_sq=torch.zeros(1, 2, dtype=torch.float64))),
     "parameter 0's exp_avg_sq is (1, 2) torch.float64, the parameter is (1, 2) torch.float32"),
    (_moments(lambda m: m.update(exp_avg=torch.full((1, 2), float("nan")))),
     "parameter 0's exp_avg holds values that are not finite"),
    (_moments(lambda m: m.update(exp_avg_sq=-torch.ones(1, 2))),
     "parameter 0's exp_avg_sq holds values that are not finite or are negative"),
    (_moments(lambda m: m.update(step=torch.tensor(-3.0))), "parameter 0's step is 'tensor(-3.)', not a whole number >= 0"),
    (_moments(lambda m: m.update(max_exp_avg_sq=torch.zeros(1, 2))),
     "parameter 0's state holds ['exp_avg', 'exp_avg_sq', 'max_exp_avg_sq', 'step'], not "
     "['exp_avg', 'exp_avg_sq', 'step']"),
    (lambda s: s["optimizer"]["state"].update({7: {}}), "its state names parameter '7', not one of 0 .. 1"),
    (lambda s: s["optimizer"]["param_groups"][0].update(params=[0, 1, 2]),
     "it holds the state of 3 parameters in 1 groups, this model trains 2 in 1"),
    (lambda s: s["optimizer"].update(extra=1), "its optimizer state holds ['extra', 'param_groups', 'state'], not "
     "['param_groups', 'state']"),
], ids=["other-shape", "other-dtype", "nan-moment", "negative-second-moment", "negative-step", "amsgrad-key",
        "unknown-index", "more-parameters", "extra-key"])
def test_moments_that_are_not_this_models_are_one_line(change, problem: str) -> None:
    """Moments of another model's shapes loaded and failed at the first step (RuntimeError:
    "The size of tensor a (32) must match the size of tensor b (64)")."""
    with pytest.raises(UserError) as err:
        _restore(_edited(change))
    assert (err.value.field, err.value.value, err.value.fix) == ("trainer_state", "file:///r/trainer_state.pt", LOAD_FIX)
    assert err.value.problem == f"cannot load it into this model's optimizer ({problem})"


def test_saved_group_settings_are_not_taken() -> None:
    """A saved ``maximize: True`` (gradient ascent) or ``weight_decay`` stays in the file:
    only the moments and step counts load, under the optimizer's own groups."""
    state = _edited(lambda s: s["optimizer"]["param_groups"][0].update(maximize=True, weight_decay=5.0, eps=-1.0))
    optimizer, scheduler = _model_and_optimizer()
    assert _restore(state, optimizer, scheduler).global_step == 9
    group = optimizer.param_groups[0]
    assert (group["maximize"], group["weight_decay"], group["eps"]) == (False, 0.01, 1e-8)
    assert float(optimizer.state[group["params"][0]]["step"]) == 9.0
    assert scheduler.last_epoch == 9 and scheduler.get_last_lr() == [1e-3]


def test_under_fsdp_a_state_of_more_parameters_is_the_same_one_line() -> None:
    """The FSDP loader keys the saved indices by name: an index past this model's
    parameters was an IndexError, exit 1, retried as an outage."""
    from components.trainer.distributed import _load_optimizer

    small = torch.nn.Linear(2, 2, bias=False)
    problems = []
    for parallelism in ("fsdp", "ddp"):
        optimizer = torch.optim.AdamW(small.parameters(), lr=1e-3)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
        with pytest.raises(UserError) as err:
            _restore(_good(), optimizer, scheduler, _load_optimizer(small, optimizer, parallelism))
        problems.append(err.value.problem)
    assert problems == ["cannot load it into this model's optimizer (it holds the state of 2 parameters in 1 groups, "
                        "this model trains 1 in 1)"] * 2
