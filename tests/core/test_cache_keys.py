"""What a stage's cache key covers, and what a later stage keys on.

- Plug-in packages: each stage's code version names the distribution (and version) of
  every plug-in it can run (``runner.stage_code_version``), so upgrading a domain package
  re-runs the stages instead of reusing what the old verifier scored. The packages are
  real installed distributions: a ``.dist-info`` folder with ``entry_points.txt`` on
  ``sys.path``, at version 1.0 and then 2.0.
- ``content_digest`` (what a later stage keys on) covers a stage's inputs, outputs and
  facts, not its config digest: a re-run under another config that reproduces the same
  outputs invalidates nothing after it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import io
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from components.core import stages
from components.core.context import RecipeView, StageContext, read_output_records
from components.core.manifest import InputRef, Manifest, OutputFile, Shard
from components.core.plugins import BACKENDS, DOMAINS, ENGINES
from components.core.recipe import load_recipe, parse_recipe
from components.core.records import Reward
from components.core.runner import code_version, plugin_distributions, run_stage, stage_code_version
from components.core.storage import Store
from tests.fixtures.home import TINY_RECIPE, reset_tracking_clients, use_home

TINY = yaml.safe_load(TINY_RECIPE.read_text())


def install(site: Path, dist: str, version: str, entries: dict[str, dict[str, str]], modules: dict[str, str]) -> Path:
    """An installed distribution ``dist`` at ``version`` under ``site``: its modules and a
    ``.dist-info`` declaring ``entries`` ({group: {name: "module:attr"}})."""
    site.mkdir(parents=True, exist_ok=True)
    for name, text in modules.items():
        (site / f"{name}.py").write_text(text)
    info = site / f"{dist.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    (info / "entry_points.txt").write_text("".join(
        f"[{group}]\n" + "".join(f"{k} = {v}\n" for k, v in named.items()) for group, named in entries.items()))
    return site


def reread_plugins(mp: pytest.MonkeyPatch, modules: tuple[str, ...]) -> None:
    """The registries read the entry points again and forget what they loaded (as a new
    process would), and the plug-in modules are imported afresh."""
    importlib.invalidate_caches()
    for registry in (DOMAINS, ENGINES, BACKENDS):
        mp.setattr(registry, "_table", None)
        mp.setattr(registry, "_dists", {})
        mp.setattr(registry, "_loaded", {k: v for k, v in registry._loaded.items() if k in registry._builtins})
    for name in modules:
        mp.delitem(sys.modules, name, raising=False)
    stages.registered.cache_clear()


def use_site(mp: pytest.MonkeyPatch, site: Path, instead_of: Path | None = None) -> None:
    """``site`` on ``sys.path`` (in place of ``instead_of``): the packages installed there."""
    mp.setattr(sys, "path", [str(site)] + [p for p in sys.path if p != str(instead_of)])


# -- which plug-ins each stage's key names ------------------------------------------------

KSTAGE = '''
from components.core.stages import StageSpec

SECTIONS = ("reward",)
SPEC = StageSpec("kstage", "kp_stage_mod", upstream=("reward",))


def inputs(ctx):
    ctx.depend_on("reward")


def run(ctx):
    return {}
'''


@pytest.fixture
def plugin_packages(tmp_path: Path):
    """Four distributions, each providing one plug-in: a domain, an engine, a sandbox
    backend and a stage; a recipe naming the first three."""
    site = tmp_path / "site"
    install(site, "kp-domain", "1.0", {"posttrain.domains": {"kdom": "kp_domain_mod:KDom"}},
            {"kp_domain_mod": "from components.domains.arithmetic import Arithmetic\nclass KDom(Arithmetic):\n    pass\n"})
    install(site, "kp-engine", "1.0", {"posttrain.engines": {"keng": "kp_engine_mod:KEng"}},
            {"kp_engine_mod": "class KEng:\n    pass\n"})
    install(site, "kp-backend", "3.1", {"posttrain.sandbox_backends": {"kback": "kp_backend_mod:KBack"}},
            {"kp_backend_mod": "class KBack:\n    pass\n"})
    install(site, "kp-stage", "0.2", {"posttrain.stages": {"kstage": "kp_stage_mod:SPEC"}}, {"kp_stage_mod": KSTAGE})
    modules = ("kp_domain_mod", "kp_engine_mod", "kp_backend_mod", "kp_stage_mod")
    with pytest.MonkeyPatch.context() as mp:
        use_site(mp, site)
        reread_plugins(mp, modules)
        recipe = parse_recipe({"pipeline": "k", "domains": ["arithmetic", "kdom"], "rollout": {"engine": "keng"},
                               "sandbox": {"backend": "kback"}})
        yield mp, recipe, site, modules
    stages.registered.cache_clear()  # the stage registry without kstage again


def test_each_stage_keys_on_the_plugin_packages_it_can_run(plugin_packages) -> None:
    _, recipe, _, _ = plugin_packages
    domain, engine, backend = ("kp-domain", "1.0"), ("kp-engine", "1.0"), ("kp-backend", "3.1")
    assert plugin_distributions(recipe, "reward") == [domain]  # every stage may read `domains`
    assert plugin_distributions(recipe, "sandbox") == [backend, domain]  # declares `sandbox`, not `rollout`
    assert plugin_distributions(recipe, "rollout") == [backend, domain, engine]  # declares both
    assert plugin_distributions(recipe, "trainer") == [domain, engine]
    assert plugin_distributions(recipe, "kstage") == [domain, ("kp-stage", "0.2")]  # a plug-in stage: its own package
    assert stage_code_version(recipe, "reward") == f"{code_version()} with kp-domain==1.0"
    assert stage_code_version(recipe, "rollout") == f"{code_version()} with kp-backend==3.1, kp-domain==1.0, kp-engine==1.0"


def test_a_recipe_of_builtins_keeps_the_plain_code_version(plugin_packages) -> None:
    tiny = load_recipe(TINY_RECIPE)
    for stage in (s.id for s in stages.BUILTIN):
        assert plugin_distributions(tiny, stage) == [] and stage_code_version(tiny, stage) == code_version(), stage
    assert plugin_distributions(tiny, "kstage") == [("kp-stage", "0.2")]


def test_upgrading_a_plugin_package_changes_the_key_of_the_stages_that_run_it(plugin_packages, tmp_path) -> None:
    mp, recipe, site, modules = plugin_packages
    before = {s: stage_code_version(recipe, s) for s in ("reward", "sandbox", "trainer")}
    newer = tmp_path / "site-2"
    install(newer, "kp-engine", "1.1", {"posttrain.engines": {"keng": "kp_engine_mod:KEng"}},
            {"kp_engine_mod": "class KEng:\n    pass\n"})
    for other in site.iterdir():  # the other packages as they were
        if not other.name.startswith(("kp_engine", "kp-engine")):
            (newer / other.name).symlink_to(other)
    use_site(mp, newer, instead_of=site)
    reread_plugins(mp, modules)
    after = {s: stage_code_version(recipe, s) for s in before}
    assert after["reward"] == before["reward"] and after["sandbox"] == before["sandbox"]  # neither can run an engine
    assert after["trainer"] == f"{code_version()} with kp-domain==1.0, kp-engine==1.1" != before["trainer"]


# -- content_digest ------------------------------------------------------------------------

def _manifest(**changes) -> Manifest:
    fields = dict(stage="rollout", pipeline="p", iteration=1, shard="0/2",
                  inputs={"taskgen": InputRef("file:///r/p/iter-000001/taskgen/_MANIFEST.json", "d1")},
                  config_digest="c1", code_version="v1",
                  outputs={"rollouts": OutputFile("p/iter-000001/rollout/shard-00000-of-00002/rollouts.parquet", 4, "s1", 10)},
                  metrics={"rollout/tokens": 1.0}, info={}, timings={"start": 1.0}, mlflow_run_id="r1")
    return Manifest(**(fields | changes))


def test_content_digest_covers_inputs_outputs_and_facts_not_config() -> None:
    base = _manifest().content_digest
    # what a re-run under another config or code version that reproduced its outputs changes: not the digest
    assert _manifest(config_digest="c2", code_version="v2", metrics={"rollout/tokens": 2.0}, timings={"start": 2.0},
                     mlflow_run_id="r2").content_digest == base
    # what a later stage reads, or what the stage was made from: the digest
    assert _manifest(outputs={"rollouts": OutputFile("p/x.parquet", 4, "s2", 10)}).content_digest != base
    assert _manifest(info={"policy_version": "2"}).content_digest != base
    assert _manifest(inputs={"taskgen": InputRef("file:///r/p/iter-000001/taskgen/_MANIFEST.json", "d2")}).content_digest != base


# -- through the runner -----------------------------------------------------------------------

ITERATION = [("taskgen", None), ("rollout", "0/2"), ("rollout", "1/2"), ("sandbox", "0/2"), ("sandbox", "1/2"),
             ("reward", "0/2"), ("reward", "1/2"), ("validation", None), ("trainer", None)]


@dataclass
class Booted:
    root: str
    tmp: Path

    def recipe(self, name: str, **sections) -> Path:
        data = yaml.safe_load(TINY_RECIPE.read_text())
        for section, values in sections.items():
            data[section] = values if isinstance(values, list) else {**data.get(section, {}), **values}
        path = self.tmp / f"{name}.yaml"
        path.write_text(yaml.safe_dump(data))
        return path

    def run(self, recipe: Path, iteration: int, steps=ITERATION) -> dict[str, Manifest]:
        out = {}
        with contextlib.redirect_stdout(io.StringIO()):
            for stage, shard in steps:
                out[f"{stage}[{shard}]" if shard else stage] = run_stage(stage, recipe, self.root, iteration, shard)
        return out


@pytest.fixture(scope="module")
def booted(tmp_path_factory: pytest.TempPathFactory):
    base = tmp_path_factory.mktemp("cache-keys")
    with pytest.MonkeyPatch.context() as mp:
        use_home(mp, base / ".posttrain")
        root = f"file://{base / 'store'}"
        with contextlib.redirect_stdout(io.StringIO()):
            run_stage("bootstrap", TINY_RECIPE, root, 0)
        yield Booted(root=root, tmp=base)
        reset_tracking_clients()


def ran(before: dict[str, Manifest], after: dict[str, Manifest]) -> set[str]:
    """The stages of ``after`` that ran again (not a cache hit of ``before``)."""
    return {k for k, m in after.items() if m.timings["start"] != before[k].timings["start"]}


def test_an_evaluation_setting_reruns_evaluation_not_the_stages_before_it(booted: Booted) -> None:
    """``evaluation.bootstrap_resamples`` is read by the promotion decision only. Taskgen
    declares the ``evaluation`` section (for ``tasks_per_domain``) and re-runs, but its
    outputs and facts are the same, so rollout through trainer stay cache hits."""
    first = booted.run(TINY_RECIPE, 1)
    changed = booted.recipe("resamples", evaluation={"bootstrap_resamples": 500})
    second = booted.run(changed, 1)
    assert ran(first, second) == {"taskgen"}
    assert second["taskgen"].content_digest == first["taskgen"].content_digest
    assert second["taskgen"].config_digest != first["taskgen"].config_digest
    evaluation = booted.run(changed, 1, [("evaluation", None)])["evaluation"]
    assert evaluation.inputs["trainer"].digest == first["trainer"].content_digest


def test_a_rollout_rerun_with_the_same_records_keeps_its_content_digest(booted: Booted) -> None:
    """``sandbox.concurrency`` is in rollout's key (multi-turn episodes run in the sandbox):
    a change re-runs the rollout shards, which write the same records, so what a later
    stage keys on does not change."""
    steps = ITERATION[:3]
    first = booted.run(TINY_RECIPE, 2, steps)
    second = booted.run(booted.recipe("concurrency", sandbox={"concurrency": 1}), 2, steps)
    assert ran(first, second) == {"rollout[0/2]", "rollout[1/2]"}
    for shard in ("rollout[0/2]", "rollout[1/2]"):
        assert second[shard].config_digest != first[shard].config_digest
        assert second[shard].outputs == first[shard].outputs
        assert second[shard].content_digest == first[shard].content_digest


def test_a_sandbox_rerun_with_the_same_results_reruns_nothing_after_it(booted: Booted) -> None:
    """A sandbox re-run measures other durations, CPU times and memory, so its file's
    sha256 changes; the results it hands the reward stage do not, and the reward shards,
    validation and the trainer (the iteration's most expensive stage) stay cache hits."""
    first = booted.run(TINY_RECIPE, 3)
    second = booted.run(booted.recipe("concurrency", sandbox={"concurrency": 1}), 3)
    assert ran(first, second) == {"rollout[0/2]", "rollout[1/2]", "sandbox[0/2]", "sandbox[1/2]"}
    for shard in ("sandbox[0/2]", "sandbox[1/2]"):
        before, after = first[shard].outputs["executions"], second[shard].outputs["executions"]
        assert before.rows == after.rows > 0
        assert after.sha256 != before.sha256  # the measurements differ ...
        assert after.content == before.content  # ... what the reward stage reads does not
        assert second[shard].content_digest == first[shard].content_digest


def test_a_content_digest_leaves_only_the_measured_fields_out(tmp_path: Path) -> None:
    """Two writes of one Execution that differ in a measurement share a content digest;
    one that differs in what a verifier reads (stdout) does not, and an output written
    without ``measured`` keys on its sha256 as before."""
    from components.core.records import Execution
    from components.sandbox.stage import MEASURED

    recipe = load_recipe(TINY_RECIPE)
    ctx = StageContext(stage="sandbox", recipe=RecipeView(recipe, "sandbox", ("sandbox",)),
                       store=Store(f"file://{tmp_path}"), iteration=1, shard=Shard(0, 1))

    def written(**changes) -> OutputFile:
        record = Execution(rollout_id="r", task_id="t", domain="code", backend="bwrap", isolation="x", status="ok",
                           exit_code=0, signal=0, stdout="3\n", stderr="", duration_s=0.5, cpu_time_s=0.1,
                           peak_memory_mb=12.0, result={"passed": 2})
        ctx.write_records("executions", [dataclasses.replace(record, **changes)], Execution, measured=MEASURED)
        return ctx.outputs["executions"]

    base = written()
    assert written(duration_s=9.0, cpu_time_s=3.0, peak_memory_mb=99.0, isolation="y").content == base.content
    assert written(stdout="4\n").content != base.content
    assert written(result={"passed": 1}).content != base.content
    assert base.content != base.sha256
    plain = _manifest(outputs={"rollouts": OutputFile("p/x.parquet", 4, "s2", 10)})
    assert plain.content_digest == _manifest(outputs={"rollouts": OutputFile("p/x.parquet", 4, "s2", 10, None)}).content_digest


PAL = '''
from importlib.metadata import version

from components.domains.arithmetic import Arithmetic
from components.domains.base import Verdict

SCORE = {"1.0": 0.25, "2.0": 0.75}[version("palpkg")]


class Pal(Arithmetic):
    """Arithmetic whose verifier scores 0.25 in version 1.0 of its package, 0.75 in 2.0."""

    name = "pal"

    def verify(self, task, completion, result):
        verdict = super().verify(task, completion, result)
        return Verdict(score=SCORE, passed=verdict.passed, components=verdict.components)
'''

TO_REWARD = ITERATION[:7]


def test_upgrading_a_domain_package_reruns_its_stages(booted: Booted, tmp_path: Path) -> None:
    """The review's case: a verifier fixed in a new version of its package scores the same
    rollouts again, instead of the stored rewards of the old version being a cache hit."""
    one = install(tmp_path / "v1", "palpkg", "1.0", {"posttrain.domains": {"pal": "palpkg:Pal"}}, {"palpkg": PAL})
    two = install(tmp_path / "v2", "palpkg", "2.0", {"posttrain.domains": {"pal": "palpkg:Pal"}}, {"palpkg": PAL})
    store = Store(booted.root)

    def scores(manifests: dict[str, Manifest]) -> set[float]:
        return {r.raw_reward for k in ("reward[0/2]", "reward[1/2]")
                for r in read_output_records(store, manifests[k], "rewards", Reward) if r.status == "ok"}

    with pytest.MonkeyPatch.context() as mp:
        use_site(mp, one)
        reread_plugins(mp, ("palpkg",))
        recipe = booted.recipe("pal", domains=["pal"])
        first = booted.run(recipe, 3, TO_REWARD)
        assert first["reward[0/2]"].code_version == f"{code_version()} with palpkg==1.0"
        assert scores(first) == {0.25}
        assert ran(first, booted.run(recipe, 3, TO_REWARD)) == set()  # unchanged: every stage a hit

        use_site(mp, two, instead_of=one)  # pip install -U palpkg
        reread_plugins(mp, ("palpkg",))
        second = booted.run(recipe, 3, TO_REWARD)
    assert ran(first, second) == set(second)  # every stage can run the domain's code: none is a hit
    assert second["reward[0/2]"].code_version == f"{code_version()} with palpkg==2.0"
    assert scores(second) == {0.75}
