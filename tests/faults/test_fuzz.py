"""Seeded fuzzing of everything a user or a model hands in: recipes, task files and
completions. Every case ends in a result or one ``UserError`` line (exit 2): never a
traceback, never over 10 s, never over 1 GB.

Hypothesis is not installed here, so cases come from a seeded generator (same seed, same
cases; a failure prints its seed and index). The fast part runs each case in-process under
a 10 s alarm and checks the process's peak memory; the slow part sends a sample through
the real command line (``posttrain run --iterations 0`` stops right after recipe
validation; ``posttrain verify``) in subprocesses limited to 1 GB of address space.
"""

from __future__ import annotations

import contextlib
import io
import json
import random
import resource
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from components.cli import main
from components.core.errors import UserError
from components.core.recipe import Recipe, load_recipe
from components.domains import registry
from components.domains.base import judge
from components.domains.taskfile import load_tasks

SEED = 20261201
CASES = 220
LIMIT_S = 10
LIMIT_BYTES = 1 << 30
DOMAINS = ("arithmetic", "code", "terminal", "math", "extraction", "structured")
EXECUTING = ("code", "terminal")
DEMO = yaml.safe_load(Path("recipes/demo.yaml").read_text())


# -- hostile values ------------------------------------------------------------------------
def scalar(rng: random.Random):
    return rng.choice([
        0, -1, 1, 2**31, 2**63, -(2**63), 10**30, 1e308, -1e-308, float("inf"), float("-inf"), float("nan"), True, None,
        "", " ", "x" * rng.randint(1, 5000), "\x00", "\udcff" if rng.random() < 0.1 else "é", "ünï©ødé ☃ 𝄞", "..",
        "/etc/passwd", "file:", "dir", "link", "3/4", "-0", "0.333", "1e5", "[", "]" * 50, "{}", "!!python/name:os",
        "${HOME}", "%s%s%n", "\n" * 20, rng.randint(-10**6, 10**6), rng.random() * 10**rng.randint(-5, 5),
    ])


def value(rng: random.Random, depth: int = 0):
    roll = rng.random()
    if depth > 3 or roll < 0.55:
        return scalar(rng)
    if roll < 0.75:
        return [value(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    if roll < 0.95:
        return {str(scalar(rng))[:20]: value(rng, depth + 1) for _ in range(rng.randint(0, 4))}
    nest = rng.choice([10, 40, 200, 5000])
    return json.loads("[" * nest + "]" * nest) if nest < 500 else "[" * nest  # deep, or text that looks deep


def mutate_bytes(rng: random.Random, data: bytes) -> bytes:
    data = bytearray(data)
    for _ in range(rng.randint(1, 6)):
        op = rng.random()
        pos = rng.randint(0, len(data))
        if op < 0.3:
            data[pos:pos] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 8)))
        elif op < 0.45 and data:
            del data[pos:pos + rng.randint(1, 20)]
        elif op < 0.6:
            data[pos:pos] = rng.choice([b"&a ", b"*a", b"[" * 3000, b"{" * 50, b"\n  - ", b": ", b"\xff\xfe", b"\x00",
                                        b"\t", b"!!binary ", b"<<: *a\n", b"\xed\xa0\x80"])
        elif op < 0.7:
            data = data[: rng.randint(0, len(data))]
        elif op < 0.8:
            data = bytearray(bytes(data).decode("utf-8", "replace").encode(rng.choice(["utf-16", "utf-32", "latin-1"]),
                                                                             errors="replace"))
        else:
            data += data[: rng.randint(0, 200)]
    return bytes(data)


def set_path(tree: dict, rng: random.Random) -> None:
    """Overwrite (or add) one field somewhere in a recipe-shaped tree with a hostile value."""
    node = tree
    sections = [k for k, v in Recipe.model_fields.items()]
    key = rng.choice(sections + ["bogus", "sandbox", "taskgen", "rollout"])
    if key in Recipe.model_fields and hasattr(Recipe.model_fields[key].annotation, "model_fields") and rng.random() < 0.8:
        fields = list(Recipe.model_fields[key].annotation.model_fields)
        node = node.setdefault(key, {}) if isinstance(node.get(key, {}), dict) else node
        key = rng.choice(fields + ["typo_field"])
    node[key] = value(rng)


def recipe_case(rng: random.Random) -> bytes:
    tree = json.loads(json.dumps(DEMO))
    kind = rng.random()
    if kind < 0.5:
        for _ in range(rng.randint(1, 3)):
            set_path(tree, rng)
        try:
            text = yaml.safe_dump(tree, allow_unicode=True)
        except (yaml.YAMLError, RecursionError):
            text = json.dumps(tree, default=str)
        return text.encode("utf-8", "surrogatepass")
    if kind < 0.6:  # an alias chain of random width and depth
        width, depth = rng.randint(2, 12), rng.randint(2, 10)
        lines = ["pipeline: demo", "a0: &a0 [" + ",".join(['"x"'] * width) + "]"]
        lines += [f"a{i}: &a{i} [" + ",".join([f"*a{i - 1}"] * width) + "]" for i in range(1, depth)]
        lines.append(rng.choice(["domains", "timeouts", "taskgen", "seed", "zz"]) + f": *a{depth - 1}")
        return "\n".join(lines).encode()
    return mutate_bytes(rng, Path("recipes/demo.yaml").read_bytes())


def task_case(rng: random.Random) -> tuple[str, str, bytes]:
    """(domain, file suffix, file bytes) of a hostile task file."""
    domain = rng.choice(DOMAINS)
    task = registry.get(domain).make_task(rng, "train")
    row = {"domain": domain, "prompt": task.prompt, "reference": dict(task.reference), "metadata": dict(task.metadata)}
    kind = rng.random()
    if kind < 0.45:
        target = row["reference"] if rng.random() < 0.7 else row
        keys = list(target) + ["extra"]
        key = rng.choice(keys)
        if rng.random() < 0.2:
            target.pop(key, None)
        else:
            target[key] = value(rng)
        text = json.dumps(row, default=str)
    elif kind < 0.6:
        row["reference"] = json.dumps(row["reference"]) if rng.random() < 0.5 else value(rng)
        text = json.dumps(row, default=str)
    elif kind < 0.7:
        text = json.dumps(value(rng), default=str)
    else:
        return domain, ".json", mutate_bytes(rng, json.dumps(row).encode())
    suffix = rng.choice([".json", ".jsonl"])
    return domain, suffix, text.encode("utf-8", "surrogatepass")


def completion_case(rng: random.Random) -> bytes:
    kind = rng.random()
    if kind < 0.2:
        return bytes(rng.randrange(256) for _ in range(rng.randint(0, 3000)))
    if kind < 0.35:
        n = rng.choice([100, 1000, 100_000])
        return rng.choice([b"[", b"{", b'{"a":', b"[1,", b"(", b"-"]) * n
    if kind < 0.5:
        return json.dumps(value(rng), default=str).encode("utf-8", "surrogatepass")
    if kind < 0.6:
        return rng.choice([b"9" * 100_000, b"1/" + b"9" * 5000, b"0." + b"3" * 9000, b"\n" * 50_000, b",".join([b"1"] * 50_000)])
    if kind < 0.7:
        return "".join(chr(rng.randrange(0x110000)) for _ in range(rng.randint(1, 500))).encode("utf-8", "surrogatepass")
    return mutate_bytes(rng, rng.choice([b"[3,4,2]", b'{"w":3,"d":4,"h":2}', b"85", b"3/4", b"412,30", b"mkdir a", b"x*2+3"]))


# -- running one case --------------------------------------------------------------------
@contextlib.contextmanager
def deadline(seconds: float):
    def expire(signum, frame):
        raise TimeoutError(f"case ran past {seconds} s")

    old = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def cli(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return code, out.getvalue(), err.getvalue()


def check_cli(code: int, out: str, err: str, where: str) -> None:
    assert "Traceback" not in out + err, where
    assert code in (0, 2), f"{where}: exit {code}: {err[-500:]}"
    if code == 2:
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("posttrain: error: ") and "; fix: " in lines[0], f"{where}: {err[:500]}"
    else:
        verdict = json.loads(out)
        assert 0.0 <= verdict["score"] <= 1.0, where


def peak_rss_bytes() -> int:
    """This process's peak resident memory so far. In a full test run earlier tests (models)
    may already have set it above 1 GB, so the in-process cases are checked on how far they
    raise it; the slow part runs the command line under a hard 1 GB limit."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# -- the fast, in-process part -------------------------------------------------------------
def test_fuzz_recipes(tmp_path):
    before = peak_rss_bytes()  # what earlier tests in this process already reached
    rng = random.Random(SEED)
    path = tmp_path / "r.yaml"
    outcomes = {"recipe": 0, "user_error": 0}
    for i in range(CASES):
        path.write_bytes(recipe_case(rng))
        where = f"recipe case {i} (seed {SEED})"
        with deadline(LIMIT_S):
            try:
                recipe = load_recipe(path)
                if recipe.taskgen.task_file:  # what taskgen would read
                    load_tasks(recipe.taskgen.task_file)
                outcomes["recipe"] += 1
            except UserError as exc:
                line = exc.line()
                assert "\n" not in line and len(line) < 2000, f"{where}: {line[:300]}"
                outcomes["user_error"] += 1
    assert outcomes["user_error"] > 50 and sum(outcomes.values()) == CASES, outcomes
    assert peak_rss_bytes() - before < LIMIT_BYTES  # the fuzz raised the process's peak by under 1 GB


def test_fuzz_task_files(tmp_path):
    before = peak_rss_bytes()  # what earlier tests in this process already reached
    rng = random.Random(SEED + 1)
    completion = tmp_path / "c.txt"
    codes = {0: 0, 2: 0}
    for i in range(CASES):
        domain, suffix, data = task_case(rng)
        task = tmp_path / f"t{i}{suffix}"
        task.write_bytes(data)
        # executing domains get a completion nothing runs for; the slow test executes real ones
        completion.write_bytes(b"\xff\xfe" if domain in EXECUTING else b"1")
        where = f"task case {i} (seed {SEED + 1}): {data[:120]!r}"
        with deadline(LIMIT_S):
            code, out, err = cli(["verify", "--domain", domain, "--task", str(task), "--completion", str(completion)])
        check_cli(code, out, err, where)
        codes[code] += 1
    assert codes[2] > 50 and codes[0] > 10, codes
    assert peak_rss_bytes() - before < LIMIT_BYTES  # the fuzz raised the process's peak by under 1 GB


def test_fuzz_completions(tmp_path):
    before = peak_rss_bytes()  # what earlier tests in this process already reached
    from components.core.records import Execution

    rng = random.Random(SEED + 2)
    tasks = {d: registry.get(d).make_task(random.Random(d), "train") for d in DOMAINS}
    for d, t in tasks.items():
        (tmp_path / f"{d}.json").write_text(json.dumps({"domain": d, "prompt": t.prompt, "reference": t.reference,
                                                        "metadata": t.metadata}))
    failed = Execution(rollout_id="r", task_id="t", domain="code", backend="bwrap", isolation="test", status="failed",
                       exit_code=1, signal=0, stdout="", stderr="", duration_s=0.0, cpu_time_s=0.0,
                       peak_memory_mb=0.0, result=None)
    completion = tmp_path / "c.txt"
    statuses: dict[str, int] = {}
    for i in range(CASES):
        domain = DOMAINS[i % len(DOMAINS)]
        data = completion_case(rng)
        where = f"completion case {i} (seed {SEED + 2}, {domain}): {data[:80]!r}"
        with deadline(LIMIT_S):
            if domain in EXECUTING:  # the verifier over a sandbox result, in-process; the slow test runs them
                v = judge(registry.get(domain), tasks[domain], data.decode("utf-8", "surrogateescape"), failed)
                assert v.status != "verifier_error", f"{where}: {v.detail}"
                status = v.status
            else:
                completion.write_bytes(data)
                code, out, err = cli(["verify", "--domain", domain, "--task", str(tmp_path / f"{domain}.json"),
                                      "--completion", str(completion)])
                check_cli(code, out, err, where)
                assert code == 0, where
                status = json.loads(out)["status"]
                assert status != "verifier_error", f"{where}: {out}"
        statuses[status] = statuses.get(status, 0) + 1
    assert statuses.get("malformed", 0) > 10 and statuses.get("ok", 0) > 50, statuses
    assert peak_rss_bytes() - before < LIMIT_BYTES  # the fuzz raised the process's peak by under 1 GB


# -- the slow part: the real command line, in subprocesses limited to 1 GB ------------------
def limited():
    resource.setrlimit(resource.RLIMIT_AS, (LIMIT_BYTES, LIMIT_BYTES))


def run_cli(argv: list[str], tmp_path) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "components.cli", *argv], capture_output=True, text=True,
                          timeout=LIMIT_S * 3, preexec_fn=limited, cwd=Path.cwd(),
                          env={"PATH": "/usr/bin:/bin", "POSTTRAIN_HOME": str(tmp_path / "home"), "HOME": str(tmp_path)})
    return proc  # a hang is subprocess.run's TimeoutExpired


def test_cli_sample_quick(tmp_path):
    """Three cases through the real command line under 1 GB (fast enough for every run)."""
    bomb = tmp_path / "bomb.yaml"
    rng = random.Random(SEED)
    while b"*a" not in (data := recipe_case(rng)):
        pass
    bomb.write_bytes(data)
    proc = run_cli(["run", "--recipe", str(bomb), "--iterations", "0", "--run-root", str(tmp_path / "root")], tmp_path)
    check_cli(proc.returncode, "{}", proc.stderr, "bomb")
    assert proc.returncode == 2


@pytest.mark.slow
@pytest.mark.parametrize("part", ["recipes", "tasks", "completions"])
def test_cli_sample_in_subprocesses(tmp_path, part):
    rng = random.Random(SEED + 10)
    completion = tmp_path / "c.txt"
    tasks = {d: registry.get(d).make_task(random.Random(d), "train") for d in DOMAINS}
    for i in range(25):
        if part == "recipes":
            path = tmp_path / f"r{i}.yaml"
            path.write_bytes(recipe_case(rng))
            proc = run_cli(["run", "--recipe", str(path), "--iterations", "0", "--run-root", str(tmp_path / "root")],
                           tmp_path)
            check_cli(proc.returncode, "{}", proc.stderr, f"recipe {i}")
            assert proc.returncode == 2  # --iterations 0: even a valid recipe stops right after validation
            continue
        if part == "tasks":
            domain, suffix, data = task_case(rng)
            task = tmp_path / f"t{i}{suffix}"
            task.write_bytes(data)
            completion.write_bytes(registry.get(domain).reference_completion(tasks[domain]).encode())
        else:
            domain = DOMAINS[i % len(DOMAINS)]
            t = tasks[domain]
            task = tmp_path / f"t{i}.json"
            task.write_text(json.dumps({"domain": domain, "prompt": t.prompt, "reference": t.reference,
                                        "metadata": t.metadata}))
            completion.write_bytes(completion_case(rng))
        proc = run_cli(["verify", "--domain", domain, "--task", str(task), "--completion", str(completion),
                        "--backend", "subprocess", "--allow-weak-isolation", "--timeout", "3"], tmp_path)
        check_cli(proc.returncode, proc.stdout, proc.stderr, f"{part} {i}")
