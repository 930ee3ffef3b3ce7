"""The stage registry: the built-in order, fan-out widths, and a plug-in stage spliced in."""

from __future__ import annotations

import pytest

from components import SHARDED_STAGES, STAGES
from components.core.errors import UserError
from components.core.recipe import parse_recipe
from components.core.stages import BUILTIN, StageSpec, _splice, shard_count, shard_list, spec, stage_ids
from tests.fixtures.home import TINY_RECIPE


def test_builtins_are_the_design_stages_in_run_order() -> None:
    assert stage_ids() == STAGES
    assert tuple(s.id for s in BUILTIN if s.sharded) == SHARDED_STAGES
    assert [s.upstream for s in BUILTIN] == [(), *[(a,) for a in STAGES[:-1]]]  # a chain
    assert spec("sandbox").pool == "posttrain_sandbox" and spec("trainer").timeout_s == 6 * 3600


def test_shard_lists_follow_the_recipe_and_sandbox_may_differ() -> None:
    same = parse_recipe({"pipeline": "t", "rollout": {"shards": 2}})
    wide = parse_recipe({"pipeline": "t", "rollout": {"shards": 2}, "sandbox": {"shards": 5}})
    assert shard_list(same, "sandbox") == ["0/2", "1/2"] == shard_list(same, "reward")
    assert shard_list(wide, "sandbox") == [f"{i}/5" for i in range(5)]
    assert shard_list(wide, "reward") == ["0/2", "1/2"] and shard_count(wide, "trainer") == 1
    assert shard_list(wide, "trainer") == [""]


def test_unknown_stage_lists_the_registered_ones() -> None:
    with pytest.raises(UserError) as info:
        spec("dedupe")
    assert info.value.line() == f"stage='dedupe': unknown stage; fix: use one of {list(STAGES)}"


def test_a_plugin_stage_is_spliced_between_reward_and_validation() -> None:
    dedup = StageSpec("dedup", "mypkg.dedup", ("reward",), before=("validation",))
    specs = _splice(list(BUILTIN), dedup)
    assert [s.id for s in specs] == ["bootstrap", "taskgen", "rollout", "sandbox", "reward", "dedup", "validation",
                                     "trainer", "evaluation"]
    assert next(s for s in specs if s.id == "validation").upstream == ("dedup",)
    with pytest.raises(UserError, match="stage id already registered"):
        _splice(specs, dedup)
    with pytest.raises(UserError, match=r"stage dedup2='rewards': names an unknown stage"):
        _splice(list(BUILTIN), StageSpec("dedup2", "mypkg.dedup", ("rewards",)))


@pytest.mark.parametrize(("args", "line"), [
    (["validation", "--shard", "1/2"], "--shard='1/2': stage validation is not sharded; fix: leave --shard out"),
    (["rollout"], "--shard='not given': the recipe shards this stage 2 ways; fix: pass --shard i/2, i from 0 to 1"),
    (["rollout", "--shard", "0/3"], "--shard='0/3': the recipe shards this stage 2 ways; fix: pass --shard i/2, i from 0 "
                                    "to 1"),
])
def test_a_shard_the_stage_does_not_have_is_one_line_before_the_store(args, line, tmp_path, capsys) -> None:
    """Before, ``--shard`` on a stage that is not sharded was ignored (a cache hit, exit 0),
    and a sharded stage without one was told about a '0/1' nobody passed."""
    from components.cli import main

    root = tmp_path / "root"
    code = main(["stage", *args, "--recipe", str(TINY_RECIPE), "--run-root", str(root), "--iteration", "1"])
    assert code == 2
    assert capsys.readouterr().err.strip() == f"posttrain: error: {line}"
    assert not root.exists()


@pytest.mark.parametrize("finished, line", [
    ((), "--iteration=3: iteration 2 has not finished in {root}/tiny (the last finished one is none); fix: pass "
         "--iteration 1, or let 'posttrain run' pick the next iteration"),
    ((1,), "--iteration=3: iteration 2 has not finished in {root}/tiny (the last finished one is 1); fix: pass "
           "--iteration 2, or let 'posttrain run' pick the next iteration"),
])
def test_stage_taskgen_cannot_open_a_gap_in_the_iterations(finished, line, tmp_path, capsys) -> None:
    """Before, ``posttrain stage taskgen --iteration 3`` ran with iteration 2 missing, and
    the iterations after it started from a policy no iteration 2 had judged."""
    import json

    from components.cli import main
    from components.core.manifest import MANIFEST, Manifest, stage_prefix

    root = tmp_path / "root"
    for k in finished:  # what the planner reads as finished: iteration k's evaluation manifest (the last one is read)
        done = root / stage_prefix("tiny", k, "evaluation") / MANIFEST
        done.parent.mkdir(parents=True)
        done.write_text(json.dumps(Manifest(stage="evaluation", pipeline="tiny", iteration=k, shard=None, inputs={},
                                            config_digest="c", code_version="v").to_json()))
    code = main(["stage", "taskgen", "--recipe", str(TINY_RECIPE), "--run-root", str(root), "--iteration", "3"])
    assert code == 2
    assert capsys.readouterr().err.strip() == "posttrain: error: " + line.format(root=f"file://{root}")
    assert not (root / "tiny" / "iter-3").exists()


@pytest.mark.parametrize("args", [
    ["evaluation", "--iteration", "3"],  # no upstream output: refused by the stage's inputs
    ["taskgen", "--iteration", "5"],  # refused by the in-order check
])
def test_a_refused_stage_leaves_no_run_root_it_made(args, tmp_path, capsys) -> None:
    """Before, the store's reachability probe made the run root and its parents, and the
    refusal that came after left them behind, empty."""
    from components.cli import main

    root = tmp_path / "typo" / "a" / "runs"
    assert main(["stage", *args, "--recipe", str(TINY_RECIPE), "--run-root", str(root)]) == 2
    assert capsys.readouterr().err.startswith("posttrain: error: ")
    assert list(tmp_path.iterdir()) == []


def test_a_plugin_stage_before_its_own_upstream_is_refused() -> None:
    """``_splice`` accepted it: a cycle, and the DAG failed to import with a bare KeyError."""
    cycle = StageSpec("cyc", "mypkg.cyc", ("reward",), before=("rollout",))
    with pytest.raises(UserError) as info:
        _splice(list(BUILTIN), cycle)
    assert info.value.line() == (
        "entry point posttrain.stages='cyc': its 'before' stage 'rollout' is upstream of its upstream 'reward': each "
        "would wait for the other (a cycle); fix: name in 'before' only stages that run after 'reward', or drop "
        "'rollout' from it")
    with pytest.raises(UserError, match="its 'before' stage 'reward' is its upstream too"):
        _splice(list(BUILTIN), StageSpec("cyc", "mypkg.cyc", ("reward",), before=("reward",)))


SHADOW = StageSpec("reward", "mypkg.shadow", ("sandbox",))
ELSEWHERE = StageSpec("other", "mypkg.dedup", ("reward",))


@pytest.fixture
def stage_plugins(monkeypatch):
    """Install ``posttrain.stages`` entry points (name -> value) for one test; the registry re-reads them."""
    from importlib.metadata import EntryPoint

    from components.core import stages

    def install(entries: dict[str, str]) -> None:
        eps = [EntryPoint(name, value, "posttrain.stages") for name, value in entries.items()]
        monkeypatch.setattr(stages, "entry_points", lambda group: eps if group == "posttrain.stages" else [])
        stages.registered.cache_clear()

    yield install
    monkeypatch.undo()
    stages.registered.cache_clear()


@pytest.mark.parametrize(("entries", "line"), [
    ({"reward": f"{__name__}:SHADOW"}, "entry point posttrain.stages='reward': stage id already registered; fix: give "
                                       "the plug-in stage another id"),
    ({"dedup": "posttrain_nosuch.mod:X"}, "entry point posttrain.stages='dedup': posttrain_nosuch.mod:X cannot be loaded "
     "(ModuleNotFoundError: No module named 'posttrain_nosuch'); fix: install or fix the package that provides "
     "posttrain_nosuch.mod:X, or remove it"),
    ({"dedup": f"{__name__}:ELSEWHERE"}, f"entry point posttrain.stages='dedup': {__name__}:ELSEWHERE is not a "
     "StageSpec with id 'dedup'; fix: point the entry point at a StageSpec whose id is the entry point's name"),
])
@pytest.mark.parametrize("argv", [["sandbox", "doctor", "--installed"], ["--help"], ["stage", "--help"]])
def test_a_bad_stage_plugin_is_one_line_and_exit_2_for_every_command(stage_plugins, entries, line, argv, capsys) -> None:
    """The parser lists the stages: a bad plug-in was a traceback (exit 1, retried) from
    every command, ``--help`` and ``sandbox doctor`` too."""
    from components.cli import main

    stage_plugins(entries)
    assert main(argv) == 2
    out = capsys.readouterr()
    assert out.err.splitlines() == [f"posttrain: error: {line}"] and out.out == ""
