"""Recipes: every mistake is one UserError naming the field, the value and the fix."""

from __future__ import annotations

from pathlib import Path

import pytest

from components.core.errors import UserError
from components.core.recipe import load_recipe, parse_recipe
from components.core.runner import config_digest
from components.domains import registry
from tests.fixtures.home import TINY_RECIPE

# (case id, recipe text, substrings the one-line error must contain: field, value, problem, fix)
ERRORS = [
    ("bool-for-an-int", "pipeline: t\nrollout: {shards: true}\n",
     ["rollout.shards=True", "input should be a number, not true/false", "fix: set 'rollout.shards'"]),
    ("bool-for-a-float", "pipeline: t\ntrainer: {learning_rate: false}\n",
     ["trainer.learning_rate=False", "not true/false"]),
    ("huge-learning-rate", "pipeline: t\ntrainer: {learning_rate: 1e308}\n",
     ["trainer.learning_rate='1e308'", "fix: set 'trainer.learning_rate'", "at most 1"]),
    ("repeated-key", "pipeline: demo\nseed: 3\npipeline: other\n",
     ["the key 'pipeline' appears twice in one mapping (lines 1 and 3)", "fix: keep one of them"]),
    ("repeated-nested-key", "pipeline: t\nrollout:\n  group_size: 4\n  group_size: 8\n",
     ["the key 'group_size' appears twice in one mapping (lines 3 and 4)"]),
    ("unknown-key", "pipeline: t\nrollout: {group_sise: 4}\n",
     ["rollout.group_sise=4", "Extra inputs are not permitted", "fix: remove 'rollout.group_sise' or correct its spelling"]),
    ("wrong-type", "pipeline: t\nrollout: {group_size: many}\n",
     ["rollout.group_size='many'", "valid integer", "fix: set 'rollout.group_size' to a valid value"]),
    ("out-of-range", "pipeline: t\nrollout: {group_size: 1}\n",
     ["rollout.group_size=1", "fix: set 'rollout.group_size'", "at least 2"]),
    ("job-timeout-too-short", "pipeline: t\nsandbox: {timeout_s: 0.001}\n",
     ["sandbox.timeout_s=0.001", "fix: set 'sandbox.timeout_s'", "at least 0.1"]),
    ("negative-seed", "pipeline: t\nseed: -1\n", ["seed=-1", "fix: set 'seed'", "at least 0"]),
    ("above-one", "pipeline: t\nvalidation: {min_ok_fraction: 1.5}\n",
     ["validation.min_ok_fraction=1.5", "fix: set 'validation.min_ok_fraction'", "at most 1"]),
    ("bad-literal", "pipeline: t\nreward: {normalize: zscore}\n",
     ["reward.normalize='zscore'", "'none' or 'domain_zscore'", "fix: set 'reward.normalize'"]),
    ("bad-pipeline-name", "pipeline: Has Spaces\n", ["pipeline='Has Spaces'", "should match pattern", "fix: set 'pipeline'"]),
    ("missing-pipeline", "seed: 1\n", ["pipeline=", "Field required", "fix: add 'pipeline' to the recipe"]),
    ("unknown-domain", "pipeline: t\ndomains: [arithmetic, chess]\n",
     ["domains[1]='chess'", "unknown domain", "fix: use one of"]),
    ("unknown-engine", "pipeline: t\nrollout: {engine: vlm}\n",
     ["rollout.engine='vlm'", "unknown rollout engine", "fix: use one of ['hf', 'openai', 'vllm']"]),
    ("unknown-backend", "pipeline: t\nsandbox: {backend: docker}\n",
     ["sandbox.backend='docker'", "unknown sandbox backend", "fix: use one of ['bwrap', 'subprocess']"]),
    ("weight-for-absent-domain", "pipeline: t\ndomains: [arithmetic]\ntaskgen: {domain_weights: {code: 2}}\n",
     ["taskgen.domain_weights='code'", "not in 'domains'", "fix: add it to 'domains' or drop the weight"]),
    ("band-inverted", "pipeline: t\nbootstrap: {target_low: 0.9, target_high: 0.5}\n",
     ["bootstrap.target_low=0.9", "above bootstrap.target_high", "fix: make target_low <= target_high"]),
    ("invalid-yaml", "pipeline: t\nrollout: {group_size: 4\nseed: 1\n",
     ["--recipe=", "not valid YAML at line 3", "fix: fix the YAML syntax there"]),
    ("control-character", "pipeline: t\n\nseed: 7\x07\n",  # it said "not valid YAML at unknown position"
     ["--recipe=", "the character '\\x07' (U+0007) at line 3 is not allowed in YAML",
      "fix: remove it or write it as an escape in a double-quoted string"]),
    ("non-mapping", "- pipeline\n- t\n", ["recipe=", "must be a YAML mapping", "fix: write key: value pairs"]),
    ("empty-file", "", ["recipe=", "must be a YAML mapping", "fix: write key: value pairs"]),
]


@pytest.mark.parametrize(("text", "needles"), [(t, n) for _, t, n in ERRORS], ids=[c for c, _, _ in ERRORS])
def test_recipe_errors(text: str, needles: list[str], tmp_path: Path) -> None:
    path = tmp_path / "recipe.yaml"
    path.write_text(text)
    with pytest.raises(UserError) as info:
        load_recipe(path)
    line = info.value.line()
    assert str(path) in line  # which file
    for needle in needles:
        assert needle in line, f"{needle!r} not in {line!r}"
    assert "\n" not in line


def test_unknown_domain_lists_registered_domains(tmp_path: Path) -> None:
    path = tmp_path / "r.yaml"
    path.write_text("pipeline: t\ndomains: [arithmetic, chess]\n")
    with pytest.raises(UserError) as info:
        load_recipe(path)
    assert info.value.field.endswith("domains[1]")
    assert info.value.value == "chess"
    assert {"arithmetic", "code"} <= set(registry.names())
    assert info.value.fix == f"use one of {registry.names()}"


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(UserError) as info:
        load_recipe(tmp_path / "nope.yaml")
    assert info.value.line() == (f"--recipe='{tmp_path / 'nope.yaml'}': no such recipe file; "
                                 "fix: pass a YAML file such as recipes/demo.yaml")


def test_tiny_recipe_overrides_defaults() -> None:
    recipe = load_recipe(TINY_RECIPE)
    assert recipe.pipeline == "tiny"
    assert recipe.seed == 3
    assert recipe.domains == ["arithmetic", "code"]
    assert recipe.rollout.group_size == 4 and recipe.rollout.shards == 2
    assert recipe.rollout.policy == "champion"  # default kept
    assert recipe.taskgen.tasks_per_iteration == 8
    assert recipe.trainer.learning_rate == 1e-4  # default kept


def test_stage_digest_covers_only_its_sections() -> None:
    base = parse_recipe({"pipeline": "t"})
    more_tasks = parse_recipe({"pipeline": "t", "taskgen": {"tasks_per_iteration": 7}})
    assert config_digest(base, "taskgen") != config_digest(more_tasks, "taskgen")
    for stage in ("rollout", "sandbox", "reward", "validation", "evaluation", "bootstrap"):
        assert config_digest(base, stage) == config_digest(more_tasks, stage), stage
    # the trainer reads taskgen: dynamic sampling's steps per iteration follow tasks_per_iteration
    assert config_digest(base, "trainer") != config_digest(more_tasks, "trainer")
    other_seed = parse_recipe({"pipeline": "t", "seed": 1})
    assert all(config_digest(base, s) != config_digest(other_seed, s) for s in ("bootstrap", "taskgen", "trainer"))
    assert config_digest(base, "taskgen") == config_digest(parse_recipe({"pipeline": "t"}), "taskgen")  # deterministic
    assert len(config_digest(base, "taskgen")) == 64
    # evaluation scores with the rollout engine: a change of engine settings re-runs it
    wider = parse_recipe({"pipeline": "t", "rollout": {"batch_size": 7}})
    assert config_digest(base, "evaluation") != config_digest(wider, "evaluation")


def test_a_missing_file_uri_recipe_is_no_such_file(tmp_path: Path) -> None:
    """A ``file://`` recipe is a local file: it was told to "publish it first" as a store's would be."""
    with pytest.raises(UserError) as info:
        load_recipe(f"file://{tmp_path}/absent.yaml")
    assert info.value.line() == (f"--recipe='file://{tmp_path}/absent.yaml': no such recipe file; "
                                 "fix: pass a YAML file such as recipes/demo.yaml")


def test_a_list_position_is_named_in_brackets_as_the_recipes_own_checks_name_it() -> None:
    """pydantic says ``taskgen.curriculum.0.weights``; the recipe's own checks say ``domains[0]``."""
    from components.core.errors import UserError
    from components.core.recipe import parse_recipe

    with pytest.raises(UserError) as err:
        parse_recipe({"pipeline": "p", "domains": ["arithmetic"],
                      "taskgen": {"curriculum": [{"until": 1, "weights": {"arithmetic": "lots"}}]}}, "r.yaml")
    assert err.value.field == "r.yaml: taskgen.curriculum[0].weights.arithmetic"
    with pytest.raises(UserError) as err:
        parse_recipe({"pipeline": "p", "domains": ["arithmetic", 7]}, "r.yaml")
    assert (err.value.field, err.value.value) == ("r.yaml: domains[1]", 7)
