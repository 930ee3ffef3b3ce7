"""Optimizer, learning-rate schedule and the trainer state saved beside a checkpoint.

``trainer_state.pt`` sits in the checkpoint folder next to the Hugging Face files and
holds what an exact resume needs besides the weights: the AdamW state, the LR
scheduler's position, the Python/NumPy/torch RNG states and the data position
(iteration, optimizer steps done in it, global step). Saving and loading go through
the store, so ``file://`` and ``s3://`` checkpoints both carry it.

Two uses:

- exact resume: ``load_trainer_state(..., restore_rng=True)`` into a fresh model,
  optimizer and scheduler continues bit-identically to an uninterrupted run
  (``tests/trainer/test_resume.py``);
- carry-over between iterations: the trainer of iteration k loads the Adam moments and
  schedule position of the checkpoint it starts from (``trainer.carry_optimizer_state``)
  but keeps its own derived seed (``restore_rng=False``), so each iteration stays
  reproducible from (pipeline, iteration, stage).

Schedules (``trainer.lr_schedule``): linear warmup over ``warmup_steps`` (step k at (k + 1) / ``warmup_steps`` of the rate), then
``constant``, ``linear`` or ``cosine`` decay to ``min_lr_ratio * learning_rate`` over
``decay_steps``; steps count across iterations where the position is carried (full
training with ``carry_optimizer_state``; under LoRA, whose adapters are fresh each
iteration, the schedule's position is carried and the Adam moments are not; without
carry the schedule starts again each iteration). After loading, the recipe's current
learning rate and the code's betas (``BETAS``, not a recipe setting) win over the saved
ones, so a changed recipe takes effect.

The file always holds the full, unsharded AdamW state keyed by parameter index, whoever
wrote it: one process, DDP ranks (replicas) or FSDP2 ranks (gathered by
``components/trainer/distributed.py``), so any later run, 1 or N processes, can carry it.

What is loaded is checked first, whoever loads it (one process, DDP, FSDP): each saved
AdamW moment has its parameter's shape and dtype and is finite, the step counts are whole,
the position's numbers are whole and below ``MAX_POSITION`` (2**53), the scheduler's
``last_epoch`` is the position's ``global_step`` (its other keys, which differ between
torch versions, are not read); only the moments, step counts and that position are taken
(the groups' settings and the rates are the optimizer's own and the recipe's). Anything
else is a UserError naming the file, never a negative rate or a traceback at the first step.

Not covered: sharded optimizer state files (an FSDP run gathers the full state to rank 0
to save it), other optimizers than AdamW, and state files written by a model with the
same parameter shapes but other weights (they load; the manifest's digest of the file is
what ties it to its checkpoint).
"""

from __future__ import annotations

import io
import math
import random
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from components.core.errors import UserError, exc_line, value_text
from components.core.storage import Store

STATE_FILE = "trainer_state.pt"
BETAS = (0.9, 0.99)


def build_optimizer(model, cfg) -> torch.optim.Optimizer:
    """AdamW over the parameters that train (all of them, or only the adapters under LoRA)."""
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.learning_rate, betas=BETAS,
                             weight_decay=0.0)


def lr_factor(step: int, cfg) -> float:
    """Multiplier of ``cfg.learning_rate`` at optimizer step ``step`` (0-based, global)."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.lr_schedule == "constant":
        return 1.0
    progress = min(1.0, (step - cfg.warmup_steps) / cfg.decay_steps)
    shape = 1.0 - progress if cfg.lr_schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * shape


def build_scheduler(optimizer: torch.optim.Optimizer, cfg) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, cfg))


@dataclass(frozen=True)
class DataPosition:
    iteration: int  # the iteration whose batch was being trained on
    steps_done: int  # optimizer steps finished in that iteration
    global_step: int  # optimizer steps finished across all iterations (the schedule's position)


def _rng_state() -> dict:
    version, mt, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    return {"python": (version, list(mt), gauss), "numpy": (kind, torch.from_numpy(keys.copy()), pos, has_gauss, cached),
            "torch": torch.get_rng_state()}


def _set_rng_state(state: dict) -> None:
    version, mt, gauss = state["python"]
    random.setstate((version, tuple(mt), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy(), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])


def trainer_state_bytes(optimizer_state: dict, scheduler_state: dict, position: DataPosition) -> bytes:
    """The bytes of ``trainer_state.pt``: an optimizer's full (unsharded) ``state_dict()``
    keyed by parameter index, the scheduler's, this process's RNG states and the position."""
    buf = io.BytesIO()
    torch.save({"optimizer": optimizer_state, "scheduler": scheduler_state, "rng": _rng_state(),
                "position": {"iteration": position.iteration, "steps_done": position.steps_done,
                             "global_step": position.global_step}}, buf)
    return buf.getvalue()


def save_trainer_state(store: Store, rel_dir: str, optimizer, scheduler, position: DataPosition) -> str:
    """Write ``<rel_dir>/trainer_state.pt``; returns its sha256."""
    from components.core.storage import sha256_bytes

    data = trainer_state_bytes(optimizer.state_dict(), scheduler.state_dict(), position)
    store.write_bytes(f"{rel_dir}/{STATE_FILE}" if rel_dir else STATE_FILE, data)
    return sha256_bytes(data)


STATE_FIX = "re-run the trainer stage that wrote it, or set trainer.carry_optimizer_state: false"
MAX_POSITION = 2**53
"""The position's numbers are below this (exact as floats; far below what MLflow's SQL
store takes as a step, where a larger ``global_step`` raised a generic exception)."""


def read_trainer_state(data: bytes, where: str) -> dict:
    """The saved state from the bytes of a ``trainer_state.pt`` (``where`` names it in errors):
    a dict of the four parts ``trainer_state_bytes`` writes, else a UserError (bytes that
    are no torch file, or another object saved under that name with a digest to match)."""
    try:
        state = torch.load(io.BytesIO(data), weights_only=True)
    except Exception as exc:  # untrusted bytes: UnpicklingError, RuntimeError, EOFError, ...
        raise UserError("trainer_state", where, f"is not a trainer state file ({exc_line(exc)[:200]})", STATE_FIX) from None
    parts = ("optimizer", "scheduler", "rng", "position")
    if not isinstance(state, dict) or not all(isinstance(state.get(k), dict) for k in parts):
        got = sorted(map(str, state))[:8] if isinstance(state, dict) else type(state).__name__
        raise UserError("trainer_state", where, f"is not a trainer state file (it holds {got}, not a dict of "
                        f"{', '.join(parts)})", STATE_FIX)
    position = state["position"]
    for key in ("iteration", "steps_done", "global_step"):
        value = position.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < MAX_POSITION:
            raise UserError("trainer_state", where, f"is not a trainer state file (its position's {key} is "
                            f"{value_text(value, 40)!r}, not a whole number from 0 to 2**53 - 1)", STATE_FIX)
    return state


LOAD_FIX = ("start from a checkpoint of the same architecture, with the trainer.lora.rank of the run that saved "
            "the state (a LoRA run's holds only its adapters' moments), or set trainer.carry_optimizer_state: false")
ADAM_KEYS = {"step", "exp_avg", "exp_avg_sq"}
"""What AdamW (amsgrad off, as ``build_optimizer`` makes it) keeps per parameter."""


def _params(optimizer) -> list:
    return [p for group in optimizer.param_groups for p in group["params"]]


def _scheduler_state(saved: object, scheduler, global_step: int, where: str) -> dict:
    """The state to load into ``scheduler``: a fresh one's, at the saved position. The
    saved dict must hold ``last_epoch`` equal to the position's ``global_step`` (the
    trainer steps the schedule once per optimizer step, a skipped update included);
    nothing else of it is read or taken, so a state written under another torch version,
    whose ``LambdaLR`` keeps other keys (``verbose``, ``_is_initial``), loads."""
    fresh = scheduler.state_dict()
    if not isinstance(saved, dict):
        raise UserError("trainer_state", where, f"is not a trainer state file (its scheduler state is a "
                        f"{type(saved).__name__}, not a dict)", STATE_FIX)
    if "last_epoch" not in saved:
        raise UserError("trainer_state", where, "is not a trainer state file (its scheduler state lacks 'last_epoch')",
                        STATE_FIX)
    last = saved["last_epoch"]
    if isinstance(last, bool) or not isinstance(last, int) or last != global_step:
        raise UserError("trainer_state", where, f"is not a trainer state file (its scheduler's last_epoch is "
                        f"{value_text(last, 40)!r}, not its position's global_step {global_step})", STATE_FIX)
    return fresh | {"last_epoch": last, "_step_count": last + 1}


def _optimizer_state(saved: object, optimizer, where: str) -> dict:
    """The state to load into ``optimizer``: the saved AdamW moments and step counts, each
    checked against its parameter (shape, dtype, finite, ``exp_avg_sq`` >= 0, ``step`` a
    whole number >= 0), under the optimizer's own parameter groups (so a saved ``eps``,
    ``weight_decay`` or ``maximize`` is not taken). Not covered: moments of a model of the
    same parameter shapes but other weights (they load)."""
    params = _params(optimizer)

    def refuse(problem: str) -> UserError:
        return UserError("trainer_state", where, f"cannot load it into this model's optimizer ({problem})", LOAD_FIX)

    if not isinstance(saved, dict) or set(saved) != {"state", "param_groups"}:
        got = sorted(map(str, saved))[:10] if isinstance(saved, dict) else type(saved).__name__
        raise refuse(f"its optimizer state holds {got}, not ['param_groups', 'state']")
    groups, state = saved["param_groups"], saved["state"]
    if not isinstance(groups, list) or not all(isinstance(g, dict) and isinstance(g.get("params"), list) for g in groups):
        raise refuse("its param_groups are not a list of groups with params")
    indices = [i for g in groups for i in g["params"]]
    if indices != list(range(len(params))):
        raise refuse(f"it holds the state of {len(indices)} parameters in {len(groups)} groups, this model trains "
                     f"{len(params)} in {len(optimizer.param_groups)}")
    if not isinstance(state, dict):
        raise refuse(f"its optimizer state is a {type(state).__name__}, not a dict")
    for index, moments in state.items():
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < len(params):
            raise refuse(f"its state names parameter {value_text(index, 40)!r}, not one of 0 .. {len(params) - 1}")
        if not isinstance(moments, dict) or set(moments) != ADAM_KEYS:
            got = sorted(map(str, moments))[:10] if isinstance(moments, dict) else type(moments).__name__
            raise refuse(f"parameter {index}'s state holds {got}, not {sorted(ADAM_KEYS)}")
        param = params[index]
        for key in ("exp_avg", "exp_avg_sq"):
            value = moments[key]
            if not isinstance(value, torch.Tensor) or value.shape != param.shape or value.dtype != param.dtype:
                got = f"{tuple(value.shape)} {value.dtype}" if isinstance(value, torch.Tensor) else type(value).__name__
                raise refuse(f"parameter {index}'s {key} is {got}, the parameter is {tuple(param.shape)} {param.dtype}")
            if not torch.isfinite(value).all() or (key == "exp_avg_sq" and bool((value < 0).any())):
                raise refuse(f"parameter {index}'s {key} holds values that are not finite"
                             f"{' or are negative' if key == 'exp_avg_sq' else ''}")
        step = moments["step"]
        count = float(step) if isinstance(step, torch.Tensor) and step.numel() == 1 else \
            step if isinstance(step, (int, float)) and not isinstance(step, bool) else None
        if count is None or not math.isfinite(count) or count < 0 or count != int(count):
            raise refuse(f"parameter {index}'s step is {value_text(step, 40)!r}, not a whole number >= 0")
    return {"state": state, "param_groups": optimizer.state_dict()["param_groups"]}


def restore_trainer_state(state: dict, optimizer, scheduler, cfg, restore_rng: bool, where: str,
                          load_optimizer: Callable[[dict], None] | None = None) -> DataPosition:
    """Load a saved state into ``optimizer``/``scheduler``; ``load_optimizer`` replaces
    ``optimizer.load_state_dict`` (a sharded optimizer loads the full state its own way).
    Under LoRA (``cfg.lora.rank > 0``) only the schedule's position is loaded: each
    iteration trains fresh adapters, which the saved Adam moments do not belong to.

    What is loaded is checked first (``_optimizer_state``, ``_scheduler_state``): a state
    of another model's shapes, a schedule position other than the saved global step, or
    optimizer keys the trainer never writes are a UserError naming the file, on every path (one
    process, DDP, FSDP), never a traceback at the first step or a negative rate."""
    p = state["position"]
    position = DataPosition(iteration=int(p["iteration"]), steps_done=int(p["steps_done"]),
                            global_step=int(p["global_step"]))
    schedule = _scheduler_state(state["scheduler"], scheduler, position.global_step, where)
    try:
        if cfg.lora.rank == 0:
            (load_optimizer or optimizer.load_state_dict)(_optimizer_state(state["optimizer"], optimizer, where))
        scheduler.load_state_dict(schedule)
    except (KeyError, ValueError, RuntimeError, IndexError, TypeError) as exc:
        raise UserError("trainer_state", where, f"cannot load it into this model's optimizer ({exc_line(exc)[:200]})",
                        LOAD_FIX) from None
    # The recipe's hyperparameters win over the saved ones (identical when unchanged).
    scheduler.base_lrs = [cfg.learning_rate for _ in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["initial_lr"] = cfg.learning_rate
        group["betas"] = BETAS
        group["lr"] = cfg.learning_rate * lr_factor(scheduler.last_epoch, cfg)
    scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]
    if restore_rng:
        try:
            _set_rng_state(state["rng"])
        except (KeyError, TypeError, ValueError, RuntimeError, AttributeError) as exc:
            raise UserError("trainer_state", where, f"holds random-number states this trainer cannot set "
                            f"({exc_line(exc)[:200]})", STATE_FIX) from None
    return position


def load_trainer_state(store: Store, rel_dir: str, optimizer, scheduler, cfg, restore_rng: bool) -> DataPosition | None:
    """Load the state beside a checkpoint into ``optimizer``/``scheduler``; None when absent."""
    rel = f"{rel_dir}/{STATE_FILE}" if rel_dir else STATE_FILE
    if not store.exists(rel):
        return None
    state = read_trainer_state(store.read_bytes(rel), store.url(rel))
    return restore_trainer_state(state, optimizer, scheduler, cfg, restore_rng, store.url(rel))
