"""Profile one demo iteration under py-spy: a flame graph and a summary of where its time goes.

Bootstraps ``recipes/demo.yaml`` with a short SFT (not profiled) in a private
``POSTTRAIN_HOME``, then runs ``posttrain run --iterations 1`` under
``py-spy record --subprocesses --format flamegraph`` and writes

- ``docs/profile/iteration.svg``: the flame graph (open it in a browser; click to zoom);
- ``docs/profile/summary.md``: each stage's share of the iteration's wall time (from the
  manifests' timings, summed over shards) and the top functions by own and by total samples
  (parsed back from the SVG's frames).

    python docs/profile/iteration_profile.py [--recipe recipes/demo.yaml] [--sft-steps 50] [--rate 50] [--out docs/profile]

py-spy samples threads that are running, not idle ones (no ``--idle``), so a stage that waits
on sandbox processes shows in the stage shares but in the flame graph only as far as the
sampled processes spend CPU. Sandboxed jobs run in their own PID namespace; py-spy samples
the ones it can attach to. Not covered: the bootstrap stage, GPU time, more than one iteration.
"""

from __future__ import annotations

import argparse
import html
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from xml.etree import ElementTree

import yaml

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from benchmarks.iteration import STAGES, stage_seconds  # noqa: E402  (stage seconds from the manifests, as the benchmark reads them)

FRAME = re.compile(r'<g><title>(?P<title>.*?) \((?P<n>[\d,]+) samples?, [\d.]+%\)</title><rect [^>]*?y="(?P<y>[\d.]+)"'
                   r'[^>]*?fg:x="(?P<x>\d+)" fg:w="(?P<w>\d+)"')
TOP = 15


@dataclass
class Frame:
    """One rectangle of the flame graph: a function at one depth of one set of stacks."""

    title: str
    x: int
    w: int
    level: int
    self_w: int = 0
    parent: Frame | None = None


def env_for(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AIRFLOW", "MLFLOW_", "POSTTRAIN_"))}
    return {**env, "POSTTRAIN_HOME": str(home), "PYTHONUNBUFFERED": "1"}


def run(cmd: list[str], env: dict[str, str]) -> float:
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"profile command failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    return time.perf_counter() - start


def frames_of(svg: str) -> list[Frame]:
    """The flame graph's frames with their depth and own samples (width less their children's)."""
    raw = [(html.unescape(m["title"]), float(m["y"]), int(m["x"]), int(m["w"])) for m in FRAME.finditer(svg)]
    if not raw:
        raise ValueError("no frames in the SVG: is it a py-spy flame graph?")
    root_y = max(raw, key=lambda f: f[3])[1]
    ys = sorted({y for _, y, _, _ in raw}, key=lambda y: abs(y - root_y))
    level = {y: i for i, y in enumerate(ys)}
    frames = sorted((Frame(t, x, w, level[y]) for t, y, x, w in raw), key=lambda f: (f.level, f.x))
    by_level: dict[int, list[Frame]] = {}
    for f in frames:
        by_level.setdefault(f.level, []).append(f)
    for f in frames:
        f.self_w = f.w
    for lvl, children in by_level.items():
        parents = by_level.get(lvl - 1, [])
        i = 0
        for c in children:  # both sorted by x: walk the parents once
            while i < len(parents) and parents[i].x + parents[i].w <= c.x:
                i += 1
            if i < len(parents) and parents[i].x <= c.x:
                c.parent = parents[i]
                parents[i].self_w -= c.w
    return frames


def function_name(title: str) -> str:
    """``func (file.py:12)`` -> ``func (file.py)``: one row per function, not per line."""
    return re.sub(r":\d+\)$", ")", title)


def process_of(frames: list[Frame]) -> dict[int, Frame]:
    """Each frame's process: its nearest ``process <pid>:...`` frame, itself included (by ``id``)."""
    owner: dict[int, Frame] = {}
    for f in frames:  # sorted by level: a parent's owner is known first
        if f.title.startswith("process "):
            owner[id(f)] = f
        elif f.parent is not None and id(f.parent) in owner:
            owner[id(f)] = owner[id(f.parent)]
    return owner


def command_line(frame: Frame) -> str:
    return re.sub(r"^process \d+:", "", frame.title).strip('"')


def top_functions(frames: list[Frame]) -> tuple[int, Counter, Counter, Counter]:
    """For the profiled (outermost) process alone: its samples, own samples per function and total
    samples per function (each stack counted once); and samples per child command line.

    Child processes are kept apart: py-spy cannot tell that a sandbox zygote blocked in a read is
    idle (it runs in another PID namespace), so their samples measure their lifetime, not CPU."""
    owner = process_of(frames)
    roots = [f for f in frames if f.title.startswith("process ") and f.level == 1]
    main = max(roots, key=lambda f: f.w)
    own, inclusive, children = Counter(), Counter(), Counter()
    total = 0
    for f in frames:
        proc = owner.get(id(f))
        if proc is None:
            continue
        if proc is not main:
            children[re.sub(r" \d+ /sandbox/", " N /sandbox/", command_line(proc))[:100]] += f.self_w
            continue
        total += f.self_w
        if f is main:
            continue
        name = function_name(f.title)
        own[name] += f.self_w
        ancestors, p = set(), f.parent
        while p is not None and p is not main:
            ancestors.add(function_name(p.title))
            p = p.parent
        if name not in ancestors:
            inclusive[name] += f.w - sum(c.w for c in frames if c.parent is f and c.title.startswith("process "))
    return total, own, inclusive, children


def summary(meta: dict, stages: dict[str, float], svg: str) -> str:
    total, own, inclusive, children = top_functions(frames_of(svg))
    wall = meta["wall_s"]
    lines = [f"# Where one demo iteration's time goes ({meta['date']}, {meta['machine']})", "",
             f"`make profile` (`python docs/profile/iteration_profile.py`): `{meta['recipe']}` bootstrapped with {meta['sft_steps']} SFT "
             f"steps (not profiled), then `posttrain run --iterations 1` under `py-spy record --subprocesses "
             f"--rate {meta['rate']}` (flame graph: [iteration.svg](iteration.svg)). Process wall time under py-spy "
             f"{wall:.1f} s; load average {meta['load_before'][0]:.2f} before, {meta['load_after'][0]:.2f} after "
             f"({os.cpu_count()} cores, shared). Code: HEAD {meta['head']} plus {meta['dirty']} uncommitted tracked file(s).", "",
             "## Share of the iteration's wall time per stage", "",
             "| stage | s (summed over shards) | share of wall time |", "|---|---:|---:|"]
    for s in STAGES:
        lines.append(f"| {s} | {stages.get(s, 0.0):.2f} | {stages.get(s, 0.0) / wall:.1%} |")
    outside = wall - sum(stages.values())
    lines += [f"| outside stages (interpreter start, imports, Airflow DB set-up, task glue) | {outside:.2f} | {outside / wall:.1%} |",
              f"| **process wall time** | **{wall:.2f}** | 100% |", "",
              f"## Top functions of the `posttrain run` process by own samples ({total} samples at {meta['rate']}/s "
              "on its running threads; its child processes are apart, below)", "",
              "| function (file) | own samples | share |", "|---|---:|---:|"]
    lines += [f"| `{name}` | {n} | {n / total:.1%} |" for name, n in own.most_common(TOP)]
    lines += ["", "## Child processes (py-spy cannot tell a sandbox zygote blocked in a read from a running one: "
              "these samples measure how long they lived, not CPU)", "",
              "| command line (pids and fds dropped, same ones merged) | samples |", "|---|---:|"]
    lines += [f"| `{cmd}` | {n} |" for cmd, n in children.most_common(6)]
    project = [(name, n) for name, n in inclusive.most_common()
               if re.search(r"\((components|dags)/", name)][:TOP]
    lines += ["", "## Top project functions of the `posttrain run` process by total samples (own + callees)", "",
              "| function (file) | samples | share |", "|---|---:|---:|"]
    lines += [f"| `{name}` | {n} | {n / total:.1%} |" for name, n in project]
    imports, policy = inclusive["_find_and_load (<frozen importlib._bootstrap>)"], inclusive["load_policy (components/core/policy.py)"]
    lines += ["", f"Imports (`_find_and_load`, with callees) take {imports} samples ({imports / total:.1%}) of the process, "
              f"policy loading (`load_policy`, imports inside it included) {policy} ({policy / total:.1%}). A stage that waits "
              "on its sandbox processes spends wall time with few samples here: compare with the stage shares above."]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default=str(REPO / "recipes" / "demo.yaml"))
    parser.add_argument("--sft-steps", type=int, default=50, help="bootstrap SFT steps (not profiled)")
    parser.add_argument("--rate", type=int, default=50, help="py-spy samples per second")
    parser.add_argument("--out", default=str(REPO / "docs" / "profile"), help="folder for iteration.svg and summary.md")
    parser.add_argument("--summarize", action="store_true", help="only rewrite summary.md from the SVG and the last run's meta")
    args = parser.parse_args()
    out = Path(args.out)
    if args.summarize:
        meta = json.loads((out / "profile.json").read_text())
        (out / "summary.md").write_text(summary(meta, meta["stage_s"], (out / "iteration.svg").read_text()))
        return
    py_spy = shutil.which("py-spy", path=str(Path(sys.executable).parent)) or shutil.which("py-spy")
    if py_spy is None:
        sys.exit("py-spy is not installed: pip install -e '.[bench]' (it pins py-spy)")
    work = Path(tempfile.mkdtemp(prefix="posttrain-profile-"))
    try:
        data = yaml.safe_load(Path(args.recipe).read_text())
        data.setdefault("bootstrap", {}).update({"max_steps": args.sft_steps, "eval_every": args.sft_steps})
        recipe = work / "profile.yaml"
        recipe.write_text(yaml.safe_dump(data))
        env = env_for(work / "home")
        cli = [sys.executable, "-m", "components.cli"]
        store = ["--recipe", str(recipe), "--run-root", str(work / "home" / "store")]
        print(f"bootstrapping {data['pipeline']} ({args.sft_steps} SFT steps, not profiled) ...", flush=True)
        run([*cli, "stage", "bootstrap", *store], env)
        out.mkdir(parents=True, exist_ok=True)
        svg_path = work / "iteration.svg"
        print("iteration 1 under py-spy ...", flush=True)
        load_before = os.getloadavg()
        wall = run([py_spy, "record", "--subprocesses", "--format", "flamegraph", "--rate", str(args.rate),
                    "--output", str(svg_path), "--", *cli, "run", *store, "--iterations", "1"], env)
        svg = svg_path.read_text()
        ElementTree.fromstring(svg)  # a well-formed SVG, or this raises before anything is written
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO, capture_output=True,
                               text=True).stdout.splitlines()
        meta = {"recipe": str(Path(args.recipe).resolve().relative_to(REPO)), "sft_steps": args.sft_steps, "rate": args.rate,
                "wall_s": wall, "load_before": load_before, "load_after": os.getloadavg(),
                "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": os.uname().machine,
                "head": subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                                       text=True).stdout.strip(), "dirty": len(dirty),
                "stage_s": stage_seconds(work / "home" / "store", data["pipeline"])}
        text = summary(meta, meta["stage_s"], svg)
        shutil.copyfile(svg_path, out / "iteration.svg")
        (out / "profile.json").write_text(json.dumps(meta, indent=2) + "\n")
        (out / "summary.md").write_text(text)
        print(text)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
