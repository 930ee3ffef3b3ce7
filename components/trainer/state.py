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

Not covered: sharded optimizer state files (an FSDP run gathers the full state to rank 0
to save it), other optimizers than AdamW, and
state files written by a model with a different parameter layout (loading one is a
UserError naming the file).
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
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise UserError("trainer_state", where, f"is not a trainer state file (its position's {key} is "
                            f"{value_text(value, 40)!r}, not a whole number)", STATE_FIX)
    return state


def restore_trainer_state(state: dict, optimizer, scheduler, cfg, restore_rng: bool, where: str,
                          load_optimizer: Callable[[dict], None] | None = None) -> DataPosition:
    """Load a saved state into ``optimizer``/``scheduler``; ``load_optimizer`` replaces
    ``optimizer.load_state_dict`` (a sharded optimizer loads the full state its own way).
    Under LoRA (``cfg.lora.rank > 0``) only the schedule's position is loaded: each
    iteration trains fresh adapters, which the saved Adam moments do not belong to."""
    try:
        if cfg.lora.rank == 0:
            (load_optimizer or optimizer.load_state_dict)(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
    except (KeyError, ValueError, RuntimeError) as exc:
        raise UserError("trainer_state", where, f"cannot load it into this model's optimizer ({exc})",
                        "start from a checkpoint of the same architecture, or set trainer.carry_optimizer_state: false") from None
    # The recipe's hyperparameters win over the saved ones (identical when unchanged).
    scheduler.base_lrs = [cfg.learning_rate for _ in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["initial_lr"] = cfg.learning_rate
        group["betas"] = BETAS
        group["lr"] = cfg.learning_rate * lr_factor(scheduler.last_epoch, cfg)
    if restore_rng:
        try:
            _set_rng_state(state["rng"])
        except (KeyError, TypeError, ValueError, RuntimeError, AttributeError) as exc:
            raise UserError("trainer_state", where, f"holds random-number states this trainer cannot set "
                            f"({exc_line(exc)[:200]})", STATE_FIX) from None
    p = state["position"]
    return DataPosition(iteration=int(p["iteration"]), steps_done=int(p["steps_done"]), global_step=int(p["global_step"]))


def load_trainer_state(store: Store, rel_dir: str, optimizer, scheduler, cfg, restore_rng: bool) -> DataPosition | None:
    """Load the state beside a checkpoint into ``optimizer``/``scheduler``; None when absent."""
    rel = f"{rel_dir}/{STATE_FILE}" if rel_dir else STATE_FILE
    if not store.exists(rel):
        return None
    state = read_trainer_state(store.read_bytes(rel), store.url(rel))
    return restore_trainer_state(state, optimizer, scheduler, cfg, restore_rng, store.url(rel))
