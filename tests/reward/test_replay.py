"""``posttrain replay``: re-score stored rollouts with a new verifier/config, originals untouched."""

from __future__ import annotations

import json

import pytest

from components.cli import main
from components.core.context import StageContext
from components.core.facts import StartingPolicy
from components.core.manifest import Shard
from components.core.recipe import parse_recipe
from components.core.records import Execution, Reward, Rollout, Task, from_table
from components.core.storage import Store
from components.domains import registry
from components.domains.base import Verdict, make_task
from components.reward.normalize import STATS_OUTPUT
from components.reward.replay import print_report, replay
from components.reward.stage import control_seed
from tests.reward.builders import math_task, rollout, run_reward, write_iteration, write_stage

A = math_task("3*4-5=", "7")
B = math_task("2+3*4=", "14")
RECIPE = {"pipeline": "rep", "domains": ["math"], "rollout": {"shards": 2}}


@pytest.fixture
def stored(tmp_path):
    """Iteration 1 with two reward shards; returns (store, {path: bytes} of the original reward files)."""
    store = Store(str(tmp_path / "store"))
    write_iteration(store, "rep", 1, [[rollout(A, i, c) for i, c in enumerate(["7", "8", "7", "7"])],
                                      [rollout(B, i, c) for i, c in enumerate(["20", "20", "14", "x"])]], [A, B])
    r = parse_recipe(RECIPE)
    run_reward(r, store, 1, "0/2")
    run_reward(r, store, 1, "1/2")
    originals = {p: store.read_bytes(p) for p in store.glob("rep/iter-000001/reward/shard-*/*")}
    assert len(originals) == 6  # rewards, norm_stats, manifest per shard
    return store, originals


def test_changed_verifier_changes_exactly_the_expected_rewards(stored, monkeypatch):
    store, originals = stored
    math_cls = type(registry.get("math"))
    real = math_cls.verify

    def lenient(self, task, completion, result):  # a "new verifier" that accepts left-to-right answers
        if completion == "20":
            return Verdict(1.0, True, components={"exact": 1.0, "well_formed": 1.0})
        return real(self, task, completion, result)

    monkeypatch.setattr(math_cls, "verify", lenient)
    report = replay(parse_recipe(RECIPE), store, 1)
    assert [c["rollout_id"] for c in report["changed"]] == [f"{B.task_id}-0", f"{B.task_id}-1"]
    assert all((c["raw_before"], c["raw_after"]) == (0.0, 1.0) for c in report["changed"])
    assert report["domains"]["math"]["before"]["mean"] == 0.5 and report["domains"]["math"]["after"]["mean"] == 0.75
    assert report["advantage_changed"] == 4  # group B's advantages all move; group A's do not
    new = from_table(Reward, store.read_table(report["rewards"]["path"]))
    assert len(new) == 8 and report["rewards"]["path"].startswith("rep/iter-000001/reward/replay-")
    assert {p: store.read_bytes(p) for p in originals} == originals  # byte-identical
    assert store.glob("rep/iter-000001/reward/shard-*/*") == sorted(originals)  # nothing added beside them


def test_cli_replay_with_another_config_writes_a_versioned_folder(stored, tmp_path, capsys):
    store, originals = stored
    other = tmp_path / "other.yaml"
    other.write_text(json.dumps({**RECIPE, "reward": {"scale_by_std": False}}))
    code = main(["replay", "--iteration", "1", "--recipe", str(other), "--run-root", store.uri])
    out = capsys.readouterr().out
    assert code == 0
    assert "0 rollouts changed" in out and "replay written to" in out
    folders = [d for d in store.listdir("rep/iter-000001/reward") if d.startswith("replay-")]
    assert len(folders) == 1
    report = store.read_json(f"rep/iter-000001/reward/{folders[0]}/report.json")
    assert report["changed"] == [] and report["reward_config"]["scale_by_std"] is False
    assert report["advantage_changed"] == 8  # centred-only advantages differ from the std-scaled ones
    assert {p: store.read_bytes(p) for p in originals} == originals


def test_upgrading_a_plugin_domain_package_gives_a_replay_its_own_folder(stored, monkeypatch):
    """A replay's folder names everything its result depends on: the version of a plug-in
    package whose verifier it ran too (``stage_code_version``), not only posttrain's, so
    a replay after ``pip install -U`` of a fixed verifier is not taken for the earlier one."""
    from components.core import runner

    store, _ = stored
    versions = iter([[("mydomains", "1.0")], [("mydomains", "2.0")], [("mydomains", "2.0")]])
    monkeypatch.setattr(runner, "plugin_distributions", lambda recipe, stage: next(versions))
    first, second, again = (replay(parse_recipe(RECIPE), store, 1) for _ in range(3))
    assert first["code_version"].endswith(" with mydomains==1.0")
    assert second["code_version"].endswith(" with mydomains==2.0")
    assert first["replay_digest"] != second["replay_digest"] == again["replay_digest"]


@pytest.mark.parametrize(("recipe", "iteration", "message"), [
    ({**RECIPE, "domains": ["nosuch"]}, 1, "unknown domain"),
    (RECIPE, 7, "iteration 7 has not started in"),
    (RECIPE, 0, "iterations count from 1"),
])
def test_user_mistakes_exit_2(stored, tmp_path, capsys, recipe, iteration, message):
    store, _ = stored
    path = tmp_path / "r.yaml"
    path.write_text(json.dumps(recipe))
    code = main(["replay", "--iteration", str(iteration), "--recipe", str(path), "--run-root", store.uri])
    err = capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err


@pytest.mark.parametrize("case", ["no-bucket", "bad-key", "no-server", "no-scheme"])
def test_an_s3_run_root_it_cannot_use_is_one_line(case, s3_env, tmp_path, capsys, monkeypatch) -> None:
    """Against the real S3 server: a missing bucket and a wrong key are exit 2, a closed
    port exit 1, each one line (they were tracebacks, or "no manifested output")."""
    from tests.fixtures.runs import TINY

    root = f"s3://{s3_env.bucket}/runs"
    if case == "no-bucket":
        root = "s3://no-such-bucket-here/runs"
    elif case == "bad-key":
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-key")
    elif case == "no-scheme":
        monkeypatch.setenv("AWS_ENDPOINT_URL", "127.0.0.1:9000")
    else:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()  # a cached client keeps the key it was made with (one CLI process makes one)
    code = main(["replay", "--iteration", "1", "--recipe", str(TINY), "--run-root", root])
    [line] = capsys.readouterr().err.strip().splitlines()
    if case == "no-scheme":
        assert (code, line) == (2, "posttrain: error: AWS_ENDPOINT_URL='127.0.0.1:9000': an S3 endpoint needs its scheme; "
                                   "fix: write http://127.0.0.1:9000 or https://127.0.0.1:9000")
    elif case == "no-server":
        assert code == 1 and line.startswith(f"posttrain: unreachable: store unreachable at '{root}'")
    else:
        assert code == 2 and line.startswith(f"posttrain: error: --run-root='{root}': store is not reachable or not "
                                             "writable")
        fix = {"no-bucket": "fix: create the bucket, or name an existing one in the run root",
               "bad-key": "fix: check AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE)"}[case]
        assert fix in line, line


def test_a_run_root_that_is_none_is_named(stored, tmp_path, capsys):
    """It was 'stage reward: no manifested output ...; fix: run posttrain stage reward'."""
    path = tmp_path / "r.yaml"
    path.write_text(json.dumps(RECIPE))
    (tmp_path / "afile").write_text("x")
    for root, problem in ((tmp_path / "afile", "is not a folder"), (tmp_path / "missing", "does not exist"),
                          (tmp_path, "holds no run of pipeline 'rep' (no folder rep/ in it)")):
        code = main(["replay", "--iteration", "1", "--recipe", str(path), "--run-root", str(root)])
        [line] = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and line.startswith(f"posttrain: error: --run-root='file://{root}': {problem}; fix: "), line
    assert not (tmp_path / "missing").exists()


def test_a_folder_in_the_reports_place_is_refused_before_anything_is_written(stored, tmp_path, capsys):
    store, _ = stored
    base = replay(parse_recipe(RECIPE), store, 1)["rewards"]["path"].rsplit("/", 1)[0]  # the folder this replay writes
    store.delete(f"{base}/report.json")
    store.delete(f"{base}/rewards.parquet")
    store.write_bytes(f"{base}/report.json/x", b"x")  # a folder where the report goes
    with pytest.raises(Exception, match="is a folder where posttrain writes the replay's report"):
        replay(parse_recipe(RECIPE), store, 1)
    assert not store.exists(f"{base}/rewards.parquet")


def test_a_replay_cut_short_never_leaves_an_old_report_beside_new_rewards(stored, monkeypatch):
    """The report is what says a replay finished: an earlier one's goes before new rewards
    are written, so a failure in between leaves the folder unfinished, not mismatched."""
    from components.core.errors import InfraError

    store, _ = stored
    first = replay(parse_recipe(RECIPE), store, 1)
    report = f"{first['rewards']['path'].rsplit('/', 1)[0]}/report.json"
    assert store.exists(report)

    def down(self, rel, obj):
        raise InfraError("store", self.uri, "gone")

    monkeypatch.setattr(Store, "write_json", down)
    with pytest.raises(InfraError):
        replay(parse_recipe(RECIPE), store, 1)
    assert store.exists(first["rewards"]["path"]) and not store.exists(report)


def code_task(name: str) -> Task:
    return make_task("code", "train", 1, f"{name}(x) = x + 1", {"inputs": [1, 2], "expected": [2, 3],
                                                                "solution": "x + 1"})


def execution(r: Rollout, right: bool) -> Execution:
    values = [{"ok": True, "value": x + 1 if right else x} for x in (1, 2)]
    return Execution(rollout_id=r.rollout_id, task_id=r.task_id, domain="code", backend="subprocess",
                     isolation="process", status="ok", exit_code=0, signal=0, stdout="", stderr="", duration_s=0.0,
                     cpu_time_s=0.0, peak_memory_mb=0.0, result={"values": values})


@pytest.mark.parametrize("sandbox_shards", [4, 2, 1])
def test_a_replay_reads_the_sandbox_shards_the_stage_read(sandbox_shards, tmp_path):
    """With ``sandbox.shards`` unlike ``rollout.shards`` replay looked for sandbox shard "0/2"
    among "0/4".."3/4", found no executions and reported every code rollout as changed from
    ok to excluded. Rollout shard i holds task i's group; the sandbox's shards hold the
    executions the way the stage writes them (shard i of 2 task i's, else spread)."""
    store = Store(str(tmp_path / "store"))
    tasks = [code_task("f"), code_task("g")]
    write_stage(store, "rep", 1, "taskgen", None, {"tasks": (tasks, Task)},
                StartingPolicy(policy_version="1", policy_uri="file:///no/checkpoint"))
    groups = [[rollout(t, i, "x") for i in range(4)] for t in tasks]
    for i, group in enumerate(groups):
        write_stage(store, "rep", 1, "rollout", Shard(i, 2), {"rollouts": (group, Rollout)})
    runs = [execution(r, right=(i + j) % 2 == 0) for j, group in enumerate(groups) for i, r in enumerate(group)]
    for i in range(sandbox_shards):
        mine = [e for n, e in enumerate(runs) if (n // 4 if sandbox_shards == 2 else n % sandbox_shards) == i]
        write_stage(store, "rep", 1, "sandbox", Shard(i, sandbox_shards), {"executions": (mine, Execution)})
    recipe = parse_recipe({"pipeline": "rep", "domains": ["code"], "rollout": {"shards": 2},
                           "sandbox": {"shards": sandbox_shards}})
    run_reward(recipe, store, 1, "0/2")
    run_reward(recipe, store, 1, "1/2")
    report = replay(recipe, store, 1)
    assert report["domains"]["code"]["before"] == {"rewards": 8.0, "excluded": 0.0, "mean": 0.5, "pass_rate": 0.5}
    assert report["changed"] == [] and report["advantage_changed"] == 0
    assert report["domains"]["code"]["after"] == report["domains"]["code"]["before"]


SHUFFLED = {"pipeline": "rep", "domains": ["math"], "rollout": {"shards": 1}, "reward": {"control": "shuffled"},
            "seed": 3}


@pytest.fixture
def shuffled(tmp_path):
    """Iteration 1 of a shuffled control under seed 3: both math groups in one reward shard."""
    store = Store(str(tmp_path / "store"))
    write_iteration(store, "rep", 1, [[rollout(A, i, c) for i, c in enumerate(["7", "8", "7", "7"])]
                                      + [rollout(B, i, c) for i, c in enumerate(["20", "20", "14", "x"])]], [A, B])
    return store


def test_a_shuffled_control_replays_with_the_seed_its_run_recorded_whatever_the_recipes(shuffled):
    """Replay permuted with the replay recipe's ``seed``: another seed moved 8 advantages,
    and its report went into the same folder as the faithful one."""
    run_reward(parse_recipe(SHUFFLED), shuffled, 1, "0/1")
    same, other = (replay(parse_recipe({**SHUFFLED, "seed": seed}), shuffled, 1) for seed in (3, 4))
    for report in (same, other):
        assert report["changed"] == [] and report["advantage_changed"] == 0
        assert report["control_seeds"] == {"0/1": {"seed": control_seed(3, "rep", 1, 0), "recorded": True}}
    assert other["uri"] == same["uri"]  # the same result, so the same folder
    # the permutation does matter: scored without the control, these advantages move
    plain = replay(parse_recipe({**SHUFFLED, "reward": {}}), shuffled, 1)
    assert plain["advantage_changed"] > 0 and plain["uri"] != same["uri"]


def test_outputs_that_recorded_no_seed_replay_with_the_recipes_and_each_seed_gets_its_folder(shuffled, monkeypatch,
                                                                                              capsys):
    """A reward shard written before the seed was recorded: the replay recipe's ``seed``
    derives it (the report says so), and two seeds never share a folder."""
    real = StageContext.write_json

    def as_before(self, name, obj):
        return real(self, name, {k: v for k, v in obj.items() if k != "control_seed"} if name == STATS_OUTPUT else obj)

    monkeypatch.setattr(StageContext, "write_json", as_before)
    run_reward(parse_recipe(SHUFFLED), shuffled, 1, "0/1")
    monkeypatch.undo()
    three, four = (replay(parse_recipe({**SHUFFLED, "seed": seed}), shuffled, 1) for seed in (3, 4))
    assert three["advantage_changed"] == 0
    assert four["advantage_changed"] > 0
    assert three["control_seeds"] == {"0/1": {"seed": control_seed(3, "rep", 1, 0), "recorded": False}}
    assert four["control_seeds"] == {"0/1": {"seed": control_seed(4, "rep", 1, 0), "recorded": False}}
    assert three["uri"] != four["uri"]
    for report in (three, four):  # neither overwrote the other
        folder = report["rewards"]["path"].rsplit("/", 1)[0]
        assert shuffled.read_json(f"{folder}/report.json")["control_seeds"] == report["control_seeds"]
    print_report(four)
    assert "reward shard(s) 0/1 recorded no seed" in " ".join(capsys.readouterr().out.split())


def test_a_re_run_iteration_replays_into_another_folder(stored):
    """The folder's digest covers the manifests read, not only the config: a replay of the
    re-run iteration leaves the earlier replay's report as it was."""
    store, _ = stored
    first = replay(parse_recipe(RECIPE), store, 1)
    write_iteration(store, "rep", 1, [[rollout(A, i, "7") for i in range(4)], [rollout(B, i, "14") for i in range(4)]],
                    [A, B])
    run_reward(parse_recipe(RECIPE), store, 1, "0/2")
    run_reward(parse_recipe(RECIPE), store, 1, "1/2")
    second = replay(parse_recipe(RECIPE), store, 1)
    assert second["uri"] != first["uri"] and second["inputs"] != first["inputs"]
    folder = first["rewards"]["path"].rsplit("/", 1)[0]
    assert store.read_json(f"{folder}/report.json")["rewards"] == first["rewards"]


@pytest.mark.parametrize(("before", "after"), [("failed", "ok"), ("ok", "failed"), ("timeout", "ok"), ("infra_error", "ok")])
def test_a_changed_line_keeps_its_status_change(capsys, before, after):
    """rich read ``[failed -> ok]`` as a markup tag and dropped it from every "changed" line."""
    print_report({"iteration": 3, "changed": [{"rollout_id": "code-ab12-i3-g0", "domain": "code", "raw_before": 0.0,
                                               "raw_after": 1.0, "status_before": before, "status_after": after}],
                  "domains": {"code": {"before": {"mean": .1, "pass_rate": .1}, "after": {"mean": .2, "pass_rate": .2}}},
                  "control_seeds": {}, "reward_config": {"control": "none"}, "uri": "file:///x/[run]"})
    out = capsys.readouterr().out
    assert f"changed code-ab12-i3-g0 (code): 0.000 -> 1.000 [{before} -> {after}]" in out
    assert "replay written to file:///x/[run]" in out
