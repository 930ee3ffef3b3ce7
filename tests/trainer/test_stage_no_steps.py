"""An iteration that trained nothing (every group dropped) says why, what its checkpoint
is and the fix, in one WARNING line; before, it printed ``0 steps on 0 groups (8
dropped, 0 unused)`` and nothing else. Its loss/kl/lr metrics still read 0: an existing
test (``test_grpo_step.py``) holds ``step_means`` of no kept step at 0."""

from __future__ import annotations

from types import SimpleNamespace

from components.core.facts import StartingPolicy
from components.core.recipe import parse_recipe
from components.trainer import stage
from components.trainer.sampling import Selection


def test_the_line_names_the_missing_signal_and_the_fix() -> None:
    selection = Selection([], kept={"code": 0, "math": 0}, dropped={"code": 3, "math": 5})
    assert stage.no_steps_warning(4, selection, 16, "3") == (
        "iter 4 | trainer | WARNING: 0 steps: none of the 8 groups had a learning signal (all rewards in each group "
        "equal); the new checkpoint holds the parent's weights (version 3); "
        "fix: raise rollout.group_size or rollout.temperature, or bootstrap further / check the verifier")


def test_groups_of_a_weight_zero_domain_are_named_apart_with_their_fix() -> None:
    """Informative groups of a domain whose loss weight is 0 (``zero_weight``) are not
    groups without signal: the line counts them apart and names the domain in the fix."""
    selection = Selection([], kept={"code": 0, "math": 0}, dropped={"code": 3, "math": 5}, zero_weight={"code": 2, "math": 0})
    assert stage.no_steps_warning(4, selection, 16, "3") == (
        "iter 4 | trainer | WARNING: 0 steps: none of the 8 groups had a learning signal (all rewards in each group "
        "equal), 2 informative groups in domains whose reward.domain_weights is 0; the new checkpoint holds the "
        "parent's weights (version 3); fix: give code a reward.domain_weights > 0, or raise rollout.group_size or "
        "rollout.temperature, or bootstrap further / check the verifier")
    assert selection.metrics()["groups_zero_weight"] == 2.0 and selection.metrics()["code/groups_zero_weight"] == 2.0


def test_too_few_informative_groups_for_a_whole_step_name_prompts_per_step() -> None:
    selection = Selection([], kept={"math": 0}, dropped={"math": 5}, unused=3)
    assert stage.no_steps_warning(2, selection, 4, "1") == (
        "iter 2 | trainer | WARNING: 0 steps: only 3 informative groups, fewer than trainer.prompts_per_step (4), and "
        "dynamic sampling trains whole steps only (5 groups had no learning signal); the new checkpoint holds the "
        "parent's weights (version 1); fix: raise taskgen.oversample or lower trainer.prompts_per_step")


class FakeTracking:
    def __init__(self) -> None:
        self.tags: dict[str, str] = {}

    def log_datasets(self, *args, **kwargs) -> None:
        pass

    def log_metrics(self, *args, **kwargs) -> None:
        raise AssertionError("no step ran, so no per-step metrics")

    def client(self):
        return SimpleNamespace(set_tag=lambda run_id, key, value: self.tags.__setitem__(key, value))


def test_the_stage_prints_the_line_when_no_step_ran(monkeypatch) -> None:
    """``run`` with its collaborators faked: the plan holds no batch, all 8 groups dropped."""
    recipe = parse_recipe({"pipeline": "nos", "domains": ["math"]})
    start = StartingPolicy(policy_uri="file:///nowhere/policy", policy_version="3", parent_run_id="")
    selection = Selection([], kept={"math": 0}, dropped={"math": 8})
    monkeypatch.setattr(stage, "plan", lambda ctx: stage.Plan(start, object(), selection, []))
    monkeypatch.setattr(stage, "tracking", FakeTracking())
    monkeypatch.setattr(stage, "_train_here", lambda *a: stage.Outcome([], {}, "d", 10, 0, False, True, 0.0))
    monkeypatch.setattr(stage, "models", SimpleNamespace(register_checkpoint=lambda *a, **k: "4",
                                                         set_alias=lambda *a, **k: None,
                                                         model_name=lambda pipeline: f"{pipeline}-policy"))
    ctx = SimpleNamespace(recipe=SimpleNamespace(trainer=recipe.trainer, rollout=recipe.rollout, whole=recipe),
                          mlflow_run_id="r1", upstream=lambda name: [], prefix="nos/iter-000004/trainer", iteration=4,
                          pipeline="nos", add_checkpoint=lambda *a, **k: None, add_output=lambda *a, **k: None,
                          store=SimpleNamespace(url=lambda rel: f"file:///store/{rel}", uri="file:///store"))
    said: list[str] = []
    monkeypatch.setattr(stage, "say", said.append)  # the lines themselves, not a shared stdout read back
    metrics = stage.run(ctx)
    assert metrics["steps"] == 0.0 and metrics["groups_dropped"] == 8.0
    assert (metrics["loss"], metrics["kl"], metrics["lr"]) == (0.0, 0.0, 0.0)  # kept: see the module docstring
    warnings = [line for line in said if "WARNING" in line]
    assert warnings == [stage.no_steps_warning(4, selection, recipe.trainer.prompts_per_step, "3")]
    assert "none of the 8 groups had a learning signal" in warnings[0]
