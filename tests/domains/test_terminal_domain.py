"""terminal domain: commands judged by the filesystem state a trusted driver lists.

Cases that execute run through ``get_executor(SandboxConfig())`` (the recipe default, the
hardened bwrap backend; skipped where this host cannot run it) and again through the weak
``subprocess`` backend, so every verdict is checked on any host.
"""

from __future__ import annotations

import random

import pytest

from components.core.jobs import JobResult
from components.core.recipe import SandboxConfig
from components.domains import registry
from components.domains.base import make_task
from components.domains.taskfile import parse_task
from components.domains.terminal import MAX_ENTRIES, MAX_STATE_PATHS
from components.sandbox.executor import get_executor

TERMINAL = registry.get("terminal")


@pytest.fixture(scope="module", params=["default", "subprocess"])
def executor(request):
    if request.param == "default":
        from tests.sandbox.helpers import bwrap_unavailable

        if bwrap_unavailable():
            pytest.skip(f"bwrap sandbox unavailable: {bwrap_unavailable()}")
        ex = get_executor(SandboxConfig())
    else:
        ex = get_executor(SandboxConfig(backend="subprocess", allow_weak_isolation=True))
    yield ex
    ex.close()


def task(goal: str, start: dict, expected: dict, trap: bool = False):
    return make_task("terminal", "train", 2, f"{goal}\n$ ", {"solution": "", "start": start, "expected": expected},
                     trap=trap)


NEW_DIR = task("new dir a", {}, {"a": "dir"})
NEW_DEEP = task("new dir a/b", {}, {"a": "dir", "a/b": "dir"})
WRITE = task("a says hi", {}, {"a": "file:hi\n"})
RENAME = task("rename a b", {"a": "file:"}, {"b": "file:"})
DEL_ONE = task("del x.log", {"x.log": "file:"}, {})
DEL_TRAP = task("del x.log", {"x.log": "file:", "y.txt": "file:"}, {"y.txt": "file:"}, trap=True)
TWO_STEP = task("new dir a, file b in it", {}, {"a": "dir", "a/b": "file:"})


@pytest.mark.parametrize(("t", "completion", "score"), [
    (NEW_DIR, "mkdir a", 1.0),
    (NEW_DIR, "touch a", 0.0),  # a file is not a dir
    (NEW_DIR, "mkdir a b", 0.5),  # one extra path out of two
    (NEW_DEEP, "mkdir -p a/b", 1.0),
    (NEW_DEEP, "mkdir a", 0.5),
    (WRITE, "echo hi>a", 1.0),
    (WRITE, "echo ho>a", 0.0),
    (RENAME, "mv a b", 1.0),
    (RENAME, "cp a b", 0.5),
    (DEL_ONE, "rm x.log", 1.0),
    (DEL_ONE, "rm *", 1.0),  # the shortcut works on ordinary deletions...
    (DEL_TRAP, "rm *", 0.0),  # ...and fails the trap, which keeps y.txt
    (DEL_TRAP, "rm x.log", 1.0),
    (TWO_STEP, "mkdir a;>a/b", 1.0),
    (TWO_STEP, "mkdir a", 0.5),
    # malformed or hostile completions
    (NEW_DIR, "", 0.0),
    (NEW_DIR, "mkdir (", 0.0),
    (NEW_DIR, 'echo \'{"ok": true, "state": {"a": "dir"}}\' > results.json', 0.0),
    (NEW_DIR, "cd ..; rm -rf ws; mkdir ws; ln -s /tmp ws/a", 0.0),
    (NEW_DIR, "kill -9 $PPID", 0.0),  # killing the driver loses the result: 0, not a pass
    (NEW_DIR, "ln -s /etc a", 0.0),
    # a carriage return is no line break for bash (before, the driver read "true\rmkdir a" as two lines; the
    # multi-step and session paths ran it as one command)
    (NEW_DIR, "true\rmkdir a", 0.0),
    (NEW_DIR, "mkdir a\r", 0.0),  # makes "a\r"
])
def test_verify_table(executor, t, completion, score):
    job = TERMINAL.execution_plan(t, completion)
    v = TERMINAL.verify(t, completion, executor.run(job))
    assert v.status == "ok"
    assert v.score == pytest.approx(score)
    assert v.passed is (score == 1.0)


def test_runaway_command_is_cut_at_the_driver_limit(executor):
    result = executor.run(TERMINAL.execution_plan(NEW_DIR, "mkdir a; sleep 30"))
    v = TERMINAL.verify(NEW_DIR, "mkdir a; sleep 30", result)
    assert result.result["timed_out"] is True
    assert v.score == 1.0 and v.components["exit_ok"] == 0.0  # the state was right when it was cut


def test_background_writer_cannot_change_the_listing_after_exit(executor):
    # A child left running would write after the command returns; the driver kills its group first.
    result = executor.run(TERMINAL.execution_plan(NEW_DIR, "(sleep 0.3; mkdir a) & exit 0"))
    assert result.result["state"] == {}
    assert TERMINAL.verify(NEW_DIR, "", result).score == 0.0


def test_infra_error_is_excluded_not_zero():
    broken = JobResult(status="infra_error", exit_code=-1, signal=0, stdout="", stderr="boom", duration_s=0.0,
                       cpu_time_s=0.0, peak_memory_mb=0.0)
    assert TERMINAL.verify(NEW_DIR, "mkdir a", broken).status == "infra_error"
    assert TERMINAL.verify(NEW_DIR, "mkdir a", None).status == "infra_error"


def test_generated_references_pass(executor):
    r = random.Random(5)
    tasks = [TERMINAL.make_task(r, "train") for _ in range(12)]
    for t in tasks:
        c = TERMINAL.reference_completion(t)
        assert TERMINAL.verify(t, c, executor.run(TERMINAL.execution_plan(t, c))).passed, t.prompt
    assert max(len(t.prompt) for t in tasks) <= 40
    # One completion per one-shot task, one generation per action of an episode: each fits
    # the demo's 16 new tokens.
    one_shot = [t for t in tasks if not t.metadata.get("interactive")]
    actions = [a for t in tasks if t.metadata.get("interactive") for a, _ in t.reference["episode"]]
    assert actions and one_shot
    assert max(len(TERMINAL.reference_completion(t)) for t in one_shot) <= 12
    assert max(len(a) for a in actions) <= 12



MULTI = make_task("terminal", "train", 3, "new dir a, then file b in it\n$ ",
                  {"solution": "mkdir a\n>a/b", "start": {}, "expected": {"a": "dir", "a/b": "file:"}}, multi_step=True)


@pytest.mark.parametrize(("completion", "score", "exit_ok"), [
    ("mkdir a\n>a/b", 1.0, 1.0),  # two steps; the second sees the first's folder
    ("mkdir a", 0.5, 1.0),
    ("mkdir a;>a/b", 1.0, 1.0),  # one step doing both is fine too
    ("false\nmkdir a\n>a/b", 1.0, 0.0),  # the right state, but a step failed
    ("mkdir a\ncd a\n>b", 1 / 3, 1.0),  # each step is its own command in ws/: cd does not carry over
    ("mkdir a\n>a/b\n>c\n>d", 2 / 3, 1.0),  # at most MAX_STEPS = 3 steps run: d never exists, c is extra
    ("", 0.0, 1.0),
    # forging the listing: a step rewrites the lister, but it is written again right before it runs
    ("mkdir a\necho 'import os,sys;os.write(int(sys.argv[1]),b\"{}\")' > ../lister.py\n>a/b", 1.0, 1.0),
    ("mkdir a\nln -sf /etc/hostname ../lister.py\n>a/b", 1.0, 1.0),  # ...or leaves a symlink in its place
    ("mkdir a\nrm ../lister.py; mkdir ../lister.py\n>a/b", 1.0, 1.0),  # ...or a folder
    ("(sleep 0.3; mkdir a) &\n>c", 0.0, 1.0),  # a step's background process dies with the step
])
def test_multi_step_tasks_run_each_line_as_a_step(executor, completion, score, exit_ok):
    job = TERMINAL.execution_plan(MULTI, completion)
    result = executor.run(job)
    v = TERMINAL.verify(MULTI, completion, result)
    assert v.score == pytest.approx(score)
    if executor.name == "bwrap":  # one sandbox session: per-step exit codes from the host
        assert result.isolation.endswith("+mode:session")
        assert v.components["exit_ok"] == exit_ok
        assert v.components["steps"] == float(min(3, max(1, len([x for x in completion.split("\n") if x.strip()]))))


def test_multi_step_reference_passes_and_steps_persist_files(executor):
    tasks = [t for t in TERMINAL.eval_set(60, seed=3) if t.metadata.get("multi_step")]
    assert tasks and all(t.difficulty == 3 for t in tasks)
    for t in tasks[:3]:
        c = TERMINAL.reference_completion(t)
        assert "\n" in c
        assert TERMINAL.verify(t, c, executor.run(TERMINAL.execution_plan(t, c))).passed, t.prompt


# -- task-file references the verifier could never pass, or could not run -----------------------------


@pytest.mark.parametrize("metadata", [{}, {"multi_step": True}, {"interactive": True}])
def test_a_reference_without_start_runs_from_an_empty_folder(executor, metadata):
    """``start`` is optional in a task file, but the plans read ``reference["start"]``: a
    KeyError in every rollout's plan, so the task's rollouts never ran (no result: infra_error).
    An interactive task's actions ran under ``cd ws || exit 97`` with no ``ws/`` laid out (no
    start files): every episode, the reference's too, scored 0."""
    t = parse_task({"domain": "terminal", "prompt": "new dir a\n$ ", "reference": {"expected": {"a": "dir"}},
                    "metadata": metadata}, "row 0")
    for completion, passed in (("mkdir a", True), ("ls", False)):
        v = TERMINAL.verify(t, completion, executor.run(TERMINAL.execution_plan(t, completion)))
        assert (v.status, v.passed) == ("ok", passed)


@pytest.mark.parametrize(("expected", "problem"), [
    ({"a/b": "dir"}, ("expected['a/b']", "lies inside 'a', which is not listed: the state listing reports every folder, "
                      "so add 'a': 'dir'")),
    ({"a": "dir", "a/b/c": "file:"}, ("expected['a/b/c']", "lies inside 'a/b', which is not listed: the state listing "
                                      "reports every folder, so add 'a/b': 'dir'")),
])
def test_an_expected_path_needs_every_folder_above_it_listed(expected, problem):
    """Before, these loaded, and no completion could pass: the listing reports ``a`` too."""
    assert TERMINAL.reference_problem({"start": {}, "expected": expected}) == problem
    assert TERMINAL.reference_problem({"start": {}, "expected": {"a": "dir", "a/b": "dir", "a/b/c": "file:"}}) is None
    # A start file's folders are made for it (a multi-step start cannot list a dir): not required there.
    assert TERMINAL.task_problem({"start": {"a/b": "file:x"}, "expected": {"a": "dir", "a/b": "file:x"}},
                                 {"multi_step": True}) is None


@pytest.mark.parametrize("name", ["start", "expected"])
def test_a_state_holds_no_more_paths_than_the_listing_reports(executor, name):
    """References held up to 256 paths, but the listing stops at 64 entries: a larger
    expected state never matched, and a cut listing could equal a 64-path one."""
    assert MAX_STATE_PATHS == MAX_ENTRIES - 1 == 63
    many = {f"f{i:03}": "file:" for i in range(64)}
    other = "expected" if name == "start" else "start"
    assert TERMINAL.reference_problem({name: many, other: {}}) == (
        name, "must be an object of at most 63 paths: {path: 'dir' | 'file:<text>'} (the state listing stops at 64 entries)")
    del many["f063"]
    assert TERMINAL.reference_problem({name: many, other: {}}) is None
    t = task("touch 63", {}, many)  # the largest expected state still passes
    assert TERMINAL.verify(t, "touch f{000..062}", executor.run(TERMINAL.execution_plan(t, "touch f{000..062}"))).passed


def test_a_file_longer_than_the_expected_text_fails(executor):
    """The listing read 64 bytes, the most an expected text may hold: a file of those 64
    bytes and then anything passed."""
    for text in ("x" * 64, "é" * 32):  # 64 bytes each: the longest text allowed
        t = task("a says it", {}, {"a": f"file:{text}"})
        assert TERMINAL.reference_problem(t.reference) is None
        for completion, passed in ((f"printf '%s' '{text}' > a", True), (f"printf '%s' '{text}JUNK' > a", False),
                                   (f"printf '%s\\n' '{text}' > a", False)):
            v = TERMINAL.verify(t, completion, executor.run(TERMINAL.execution_plan(t, completion)))
            assert v.passed is passed, completion
    assert TERMINAL.reference_problem({"start": {}, "expected": {"a": "file:" + "x" * 65}}) == (
        "expected['a']", "file text must be at most 64 bytes (the state listing reads 65 bytes of each file, so a longer "
        "text never matches)")


@pytest.mark.parametrize("key", ["multi_step", "interactive"])
@pytest.mark.parametrize("value", ["no", "false", 0, 1, None])
def test_a_mode_flag_must_be_a_json_boolean(key, value):
    """The flags were read for truth: ``"no"`` or ``"false"`` turned the mode on."""
    reference = {"start": {"a": "file:x"}, "expected": {"a": "file:x"}}
    assert TERMINAL.task_problem(reference, {key: value}) == (
        f"metadata.{key}", "must be true or false without quotes (a JSON boolean: the string 'no' would turn the mode on)")
    assert TERMINAL.task_problem(reference, {key: False}) is None
    assert TERMINAL.task_problem(reference, {key: True}) is None
