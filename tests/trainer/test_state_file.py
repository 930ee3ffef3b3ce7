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


def _good() -> dict:
    optimizer, scheduler = _model_and_optimizer()
    return read_trainer_state(trainer_state_bytes(optimizer.state_dict(), scheduler.state_dict(),
                                                  DataPosition(iteration=2, steps_done=3, global_step=9)), "t")


@pytest.mark.parametrize(("data", "problem"), [
    (os.urandom(64), "is not a trainer state file ("),
    (_saved([1, 2]), "is not a trainer state file (it holds list, not a dict of optimizer, scheduler, rng, position)"),
    (_saved({"optimizer": {}, "scheduler": {}, "rng": {}}),
     "is not a trainer state file (it holds ['optimizer', 'rng', 'scheduler'], not a dict of optimizer, scheduler, rng, "
     "position)"),
    (_saved({"optimizer": {}, "scheduler": {}, "rng": {}, "position": {"iteration": "x", "steps_done": 0,
                                                                      "global_step": 0}}),
     "is not a trainer state file (its position's iteration is 'x', not a whole number)"),
    (_saved({"optimizer": {}, "scheduler": {}, "rng": {}, "position": {"iteration": 1, "steps_done": -1,
                                                                      "global_step": 0}}),
     "is not a trainer state file (its position's steps_done is '-1', not a whole number)"),
], ids=["random-bytes", "a-list", "no-position", "iteration-x", "negative-steps"])
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
