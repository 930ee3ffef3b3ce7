"""Each stage's declared recipe sections (``SECTIONS``, its cache key) match what it reads.

``ctx.recipe`` refuses a section the stage did not declare (so nothing it reads can be
missing from its cache key) and records what was read. Running bootstrap and a whole
iteration of recipes/tiny.yaml then shows that every declared section is read too: a
declaration that lists too much would re-run a stage for changes it ignores.
"""

from __future__ import annotations

import pytest

from components import STAGES
from components.core.context import RecipeView, UndeclaredSection
from components.core.recipe import load_recipe, parse_recipe
from components.core.runner import config_digest, run_stage, stage_module
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
