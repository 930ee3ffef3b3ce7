"""A trainer's checkpoint folder copied out of its run root with its manifest: every file
the manifest lists is checked when read, the carried ``trainer_state.pt`` too. Before, the
weights were checked (``load_policy``) but the expectations were not registered, so an
edited ``trainer_state.pt`` (a schedule position of -7: a negative learning rate) loaded
in the trainer; in its run root the same edit was refused."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

from components.core.errors import UserError
from components.core.manifest import MANIFEST, Manifest, OutputFile
from components.core.policy import load_policy, save_policy
from components.core.recipe import TrainerConfig
from components.core.storage import Store, forget
from components.trainer.state import (
    STATE_FILE,
    DataPosition,
    build_optimizer,
    build_scheduler,
    load_trainer_state,
    save_trainer_state,
)
from tests.rollout.helpers import tiny_policy

PREFIX = "demo/iter-000001/trainer"
CFG = TrainerConfig(learning_rate=5e-3)


def _trainer_folder(root: Path) -> Path:
    """``root/trainer/checkpoint`` and the manifest of ``demo/iter-000001/trainer`` beside it."""
    policy = tiny_policy(seed=1)
    save_policy(policy.model, policy.tokenizer, Store(str(root / "trainer"), "test"), "checkpoint")
    folder = root / "trainer" / "checkpoint"
    optimizer = build_optimizer(policy.model, CFG)
    save_trainer_state(Store(str(folder), "test"), "", optimizer, build_scheduler(optimizer, CFG), DataPosition(1, 0, 0))
    outputs = {}
    for file in sorted(folder.iterdir()):
        data = file.read_bytes()
        outputs[file.name] = OutputFile(path=f"{PREFIX}/checkpoint/{file.name}", rows=0,
                                        sha256=hashlib.sha256(data).hexdigest(), size=len(data))
    manifest = Manifest(stage="trainer", pipeline="demo", iteration=1, shard=None, inputs={}, config_digest="x",
                        code_version="x", outputs=outputs)
    assert manifest.prefix == PREFIX
    (root / "trainer" / MANIFEST).write_text(json.dumps(manifest.to_json()))
    return folder


def test_an_edited_trainer_state_of_a_copied_checkpoint_is_refused(tmp_path: Path) -> None:
    folder = _trainer_folder(tmp_path / "copied")
    uri = f"file://{folder}"
    try:
        policy = load_policy(uri)  # intact: loads
        optimizer = build_optimizer(policy.model, CFG)
        assert load_trainer_state(Store(uri, "policy"), "", optimizer, build_scheduler(optimizer, CFG), CFG,
                                  restore_rng=False) == DataPosition(1, 0, 0)
        state = torch.load(folder / STATE_FILE, weights_only=True)
        state["scheduler"]["last_epoch"] = -7
        torch.save(state, folder / STATE_FILE)
        policy = load_policy(uri)  # the trainer loads the policy first, then its state
        optimizer = build_optimizer(policy.model, CFG)
        with pytest.raises(UserError) as err:
            load_trainer_state(Store(uri, "policy"), "", optimizer, build_scheduler(optimizer, CFG), CFG,
                               restore_rng=False)
        assert (err.value.field, err.value.value) == ("file", f"{uri}/{STATE_FILE}")
        assert err.value.problem.startswith("manifested output of stage trainer has ")
        assert err.value.fix == (f"copy the checkpoint again with its {MANIFEST}, or delete "
                                 f"file://{tmp_path}/copied/trainer/{MANIFEST} if the files are what you want")
    finally:
        forget(uri)
