"""Each stage's declared recipe sections (``SECTIONS``, its cache key) match what it reads.

``ctx.recipe`` refuses a section the stage did not declare (so nothing it reads can be
missing from its cache key) and records what was read. Running bootstrap and a whole
iteration of recipes/tiny.yaml then shows that every declared section is read too: a
declaration that lists too much would re-run a stage for changes it ignores. Reads through
``ctx.recipe.whole``, which the view does not see, are found in the source: each is of a
declared section or a declared field (``FIELDS``), which is in the cache key too.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from components import STAGES
from components.core.context import RecipeView, UndeclaredSection
from components.core.recipe import COMMON_FIELDS, Recipe, load_recipe, parse_recipe
from components.core.runner import config_digest, keyed_config, run_stage, stage_module
from tests.fixtures.home import REPO_ROOT as REPO
from tests.fixtures.home import TINY_RECIPE, reset_tracking_clients, use_home

ITERATION = [("taskgen", None), ("rollout", "0/2"), ("rollout", "1/2"), ("sandbox", "0/2"), ("sandbox", "1/2"),
             ("reward", "0/2"), ("reward", "1/2"), ("validation", None), ("trainer", None), ("evaluation", None)]


def test_reading_an_undeclared_section_fails_and_names_the_fix() -> None:
    view = RecipeView(parse_recipe({"pipeline": "t"}), "trainer", ("trainer",))
    assert view.trainer.learning_rate == 1e-4 and view.pipeline == "t" and view.domains == ["arithmetic", "code"]
    with pytest.raises(UndeclaredSection, match=r"stage trainer read recipe section 'rollout' but declares only "
                                                r"\['trainer'\]; add 'rollout' to SECTIONS in components/trainer/stage.py"):
        _ = view.rollout
    assert view.read == {"trainer"}


def test_a_section_change_reruns_exactly_the_stages_that_declare_it() -> None:
    base = load_recipe(TINY_RECIPE)
    hotter = base.model_copy(update={"rollout": base.rollout.model_copy(update={"temperature": 0.7})})
    changed = {s for s in STAGES if config_digest(base, s) != config_digest(hotter, s)}
    assert changed == {s for s in STAGES if "rollout" in stage_module(s).SECTIONS}
    assert changed == {"bootstrap", "taskgen", "rollout", "validation", "trainer", "evaluation"}


@pytest.fixture(scope="module")
def reads(tmp_path_factory: pytest.TempPathFactory) -> dict[str, set[str]]:
    """Sections each stage read while bootstrap and one iteration of tiny ran."""
    base = tmp_path_factory.mktemp("sections")
    seen: list[RecipeView] = []
    original = RecipeView.__init__

    def spy(self, recipe, stage, sections):
        original(self, recipe, stage, sections)
        seen.append(self)

    with pytest.MonkeyPatch.context() as mp:
        use_home(mp, base / ".posttrain")
        mp.setattr(RecipeView, "__init__", spy)
        root = f"file://{base / 'store'}"
        run_stage("bootstrap", TINY_RECIPE, root, 0)
        for stage, shard in ITERATION:
            run_stage(stage, TINY_RECIPE, root, 1, shard)
        reset_tracking_clients()
    out: dict[str, set[str]] = {}
    for view in seen:
        out.setdefault(view._stage, set()).update(view.read)
    return out


@pytest.mark.parametrize("stage", STAGES)
def test_declared_sections_are_the_sections_read(stage: str, reads: dict[str, set[str]]) -> None:
    assert reads[stage] == set(stage_module(stage).SECTIONS)


def _whole_reads(path: Path) -> set[str]:
    """``section`` or ``section.field`` of each ``<x>.whole.<section>[.<field>]`` read in the
    file at ``path`` (a read through ``RecipeView.whole``, past the declared sections), for
    sections other than the common fields."""
    tree = ast.parse(path.read_text())
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    found = set()
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute) and node.value.attr == "whole"
                and node.attr in Recipe.model_fields and node.attr not in COMMON_FIELDS):
            above = parents.get(node)
            found.add(f"{node.attr}.{above.attr}" if isinstance(above, ast.Attribute) else node.attr)
    return found


def test_reads_past_the_declared_sections_are_declared_fields() -> None:
    """``ctx.recipe.whole`` is not checked as it is read: every ``whole.<section>.<field>``
    in the code is a section the stage declares or one of its ``FIELDS``, and a library
    (no stage's own module) reads none. The trainer's ``evaluation.max_new_tokens`` (the
    new version's serving default) is one such field."""
    modules = {Path(stage_module(s).__file__).resolve(): s for s in STAGES}
    undeclared = []
    for path in sorted((REPO / "components").rglob("*.py")):
        stage = modules.get(path.resolve())
        module = stage_module(stage) if stage else None
        for read in sorted(_whole_reads(path)):
            if module is None or not (read.split(".")[0] in module.SECTIONS or read in getattr(module, "FIELDS", ())):
                undeclared.append(f"{path.relative_to(REPO)}: {read}")
    assert undeclared == []
    assert _whole_reads(Path(stage_module("trainer").__file__)) == {"evaluation.max_new_tokens"}
    assert stage_module("trainer").FIELDS == ("evaluation.max_new_tokens",)


def test_each_declared_field_names_a_recipe_field_outside_the_declared_sections() -> None:
    for stage in STAGES:
        module = stage_module(stage)
        for dotted in getattr(module, "FIELDS", ()):
            section, field = dotted.split(".")
            assert section in Recipe.model_fields and section not in module.SECTIONS, (stage, dotted)
            assert field in type(getattr(parse_recipe({"pipeline": "t"}), section)).model_fields, (stage, dotted)


def test_a_declared_field_is_in_the_key_and_the_rest_of_its_section_is_not() -> None:
    base = load_recipe(TINY_RECIPE)

    def changed_by(**evaluation) -> set[str]:
        other = base.model_copy(update={"evaluation": base.evaluation.model_copy(update=evaluation)})
        return {s for s in STAGES if config_digest(base, s) != config_digest(other, s)}

    declaring = {s for s in STAGES if "evaluation" in stage_module(s).SECTIONS}
    assert changed_by(max_new_tokens=99) == declaring | {"trainer"}
    assert changed_by(bootstrap_resamples=500) == declaring == {"bootstrap", "taskgen", "evaluation"}
    # a stage without FIELDS keeps the digest of its sections, as manifests have recorded it
    assert config_digest(base, "reward") == base.digest(stage_module("reward").SECTIONS)
    assert keyed_config(base, "trainer")["evaluation"] == {"max_new_tokens": base.evaluation.max_new_tokens}
