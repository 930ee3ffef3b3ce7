"""Recipe validation is total: any file is a Recipe or one UserError, fast and small."""

from __future__ import annotations

import resource
import subprocess
import sys

import pytest

from components.core.errors import UserError
from components.core.recipe import SANDBOX_UID_SLOTS, load_recipe

BOMB = "pipeline: demo\n" + 'a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]\n' + "".join(
    f"{n}: &{n} [{','.join([f'*{p}'] * 9)}]\n" for p, n in zip("abcdefgh", "bcdefghi"))
BOMB_USED = BOMB + "domains: *i\n"

CASES = {
    "alias-bomb": BOMB.encode(),
    "alias-bomb-used": BOMB_USED.encode(),
    "deep-flow": b"pipeline: demo\nmodel: " + b"[" * 100_000,
    "deep-block": b"pipeline: demo\n" + b"".join(b" " * i + b"k:\n" for i in range(500)),
    "utf16": "pipeline: demo\n".encode("utf-16"),
    "utf16-be-no-bom": "pipeline: demo\n".encode("utf-16-be"),
    "binary": bytes(range(256)) * 4,
    "latin1": "pipeline: démo\n".encode("latin-1"),
    "lone-surrogate-bytes": b"pipeline: \xed\xa0\x80\n",
    "huge-int": b"pipeline: demo\nseed: " + b"9" * 10_000 + b"\n",
    "huge-float": b"pipeline: demo\nrollout: {temperature: 1e999}\n",
    "nan": b"pipeline: demo\nrollout: {temperature: .nan}\n",
    "not-a-mapping": b"- 1\n- 2\n",
    "empty": b"",
    "huge-file": b"pipeline: demo\n#" + b"x" * (2 << 20) + b"\n",
    "huge-key": b"pipeline: demo\n" + b"k" * 200_000 + b": 1\n",
    "huge-value": b"pipeline: " + b"v" * 200_000 + b"\n",
    "list-value": b"pipeline: demo\ndomains: " + b"[" + b",".join([b"[1,2,3]"] * 5000) + b"]\n",
    "python-tag": b"pipeline: !!python/object/apply:os.system ['true']\n",
    "concurrency": b"pipeline: demo\nsandbox: {concurrency: 1000000}\n",
    "tasks": b"pipeline: demo\ntaskgen: {tasks_per_iteration: 1000000000}\n",
    "shards": b"pipeline: demo\nrollout: {shards: 100000}\n",
    "sandbox-shards": b"pipeline: demo\nsandbox: {shards: 100000}\n",
    "memory": b"pipeline: demo\nsandbox: {memory_mb: 100000000000}\n",
    "negative-weight": b"pipeline: demo\ntaskgen: {domain_weights: {arithmetic: -1}}\n",
    "inf-weight": b"pipeline: demo\ntaskgen: {domain_weights: {arithmetic: .inf}}\n",
    "zero-weights": b"pipeline: demo\ntaskgen: {domain_weights: {arithmetic: 0, code: 0}}\n",
    "curriculum-negative": b"pipeline: demo\ntaskgen: {curriculum: [{until: 2, weights: {arithmetic: -1, code: 1}}]}\n",
    "engine": b"pipeline: demo\nrollout: {engine: nope}\n",
    "backend": b"pipeline: demo\nsandbox: {backend: nope}\n",
    "domain": b"pipeline: demo\ndomains: [nope]\n",
    "domain-not-str": b"pipeline: demo\ndomains: [[1]]\n",
    "timeouts": b"pipeline: demo\ntimeouts: {trainer: 100000000}\n",
}


LIMIT = "write the values out plainly, without deep nesting or alias chains"
NOT_UTF8 = "save the recipe as UTF-8 text (see recipes/demo.yaml)"
EXPECTED = {  # name: (field, with {path} for the recipe file's path; problem)
    "alias-bomb": ("--recipe", "expands to more than 100000 values (YAML aliases count in full) at line 6"),
    "alias-bomb-used": ("--recipe", "expands to more than 100000 values (YAML aliases count in full) at line 6"),
    "deep-flow": ("--recipe", "nested deeper than 32 levels at line 2"),
    "deep-block": ("--recipe", "nested deeper than 32 levels at line 33"),
    "utf16": ("--recipe", "UTF-16 text, not UTF-8"),
    "utf16-be-no-bom": ("--recipe", "binary data (NUL bytes), not YAML text"),
    "binary": ("--recipe", "binary data (NUL bytes), not YAML text"),
    "latin1": ("--recipe", "not UTF-8 text (byte 11)"),
    "lone-surrogate-bytes": ("--recipe", "not UTF-8 text (byte 10)"),
    "huge-int": ("{path}: seed", "is a whole number of 10,000 digits (line 2)"),  # it named neither key nor line
    "huge-float": ("{path}: rollout.temperature", "Input should be a finite number"),
    "nan": ("{path}: rollout.temperature", "Input should be a finite number"),
    "not-a-mapping": ("recipe", "the recipe must be a YAML mapping"),
    "empty": ("recipe", "the recipe must be a YAML mapping"),
    "huge-file": ("--recipe", "larger than 1024 KiB"),
    "huge-key": ("--recipe", "not valid YAML at line 2, column 200001"),  # PyYAML: a simple key is at most 1024 characters
    "huge-value": ("{path}: pipeline", "String should match pattern '^[a-z][a-z0-9-]{0,62}$'"),
    "list-value": ("{path}: domains", "List should have at most 256 items after validation, not 5000"),
    "python-tag": ("--recipe", "not valid YAML at line 1, column 11"),  # the safe loader constructs no object
    "concurrency": ("{path}: sandbox.concurrency", "Input should be less than or equal to 4096"),
    "tasks": ("{path}: taskgen.tasks_per_iteration", "Input should be less than or equal to 1000000"),
    "shards": ("{path}: rollout.shards", "Input should be less than or equal to 1024"),
    "sandbox-shards": ("{path}: sandbox.shards", "Input should be less than or equal to 1024"),
    "memory": ("{path}: sandbox.memory_mb", "Input should be less than or equal to 1048576"),
    "negative-weight": ("{path}: taskgen.domain_weights.arithmetic", "negative or not a finite weight"),
    "inf-weight": ("{path}: taskgen.domain_weights.arithmetic", "Input should be a finite number"),
    "zero-weights": ("{path}: taskgen.domain_weights", "no domain has a positive weight"),
    "curriculum-negative": ("{path}: taskgen.curriculum[0].weights.arithmetic", "negative weight"),
    "engine": ("{path}: rollout.engine", "unknown rollout engine"),
    "backend": ("{path}: sandbox.backend", "unknown sandbox backend"),
    "domain": ("{path}: domains[0]", "unknown domain"),
    "domain-not-str": ("{path}: domains[0]", "Input should be a valid string"),
    "timeouts": ("{path}: timeouts.trainer", "not a number of seconds from 1 to a week"),
}
FIXES = {"alias-bomb": LIMIT, "alias-bomb-used": LIMIT, "deep-flow": LIMIT, "deep-block": LIMIT, "utf16": NOT_UTF8,
         "utf16-be-no-bom": NOT_UTF8, "binary": NOT_UTF8, "latin1": NOT_UTF8, "lone-surrogate-bytes": NOT_UTF8,
         "huge-int": "write a number of at most 19 digits (the largest a recipe takes is seed's 2**63 - 1)",
         "huge-file": "a recipe holds only overrides; shorten it",
         "huge-key": "fix the YAML syntax there", "python-tag": "fix the YAML syntax there"}


def test_every_case_has_its_expected_error():
    assert sorted(EXPECTED) == sorted(CASES) and len(CASES) == 33


@pytest.mark.timeout(60)  # a recipe that takes the loader this long is a hang
@pytest.mark.parametrize("name", sorted(CASES))
def test_every_hostile_recipe_is_one_user_error(tmp_path, name):
    path = tmp_path / "r.yaml"
    path.write_bytes(CASES[name])
    with pytest.raises(UserError) as err:
        load_recipe(path)
    field, problem = EXPECTED[name]
    assert (err.value.field, err.value.problem) == (field.format(path=path), problem)
    if name in FIXES:
        assert err.value.fix == FIXES[name]
    line = err.value.line()
    assert "\n" not in line and len(line) < 1200, line
    assert err.value.fix


def test_a_huge_value_is_shortened_in_the_error(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_bytes(CASES["huge-value"])
    with pytest.raises(UserError) as err:
        load_recipe(path)
    assert err.value.value == "v" * 77 + "..."


def test_error_values_are_shortened_before_formatting(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_bytes(CASES["list-value"])
    with pytest.raises(UserError) as err:
        load_recipe(path)
    assert len(err.value.line()) < 600


def test_concurrency_bound_is_the_uid_pool():
    from components.sandbox.limits import UID_SLOTS

    assert SANDBOX_UID_SLOTS == UID_SLOTS


PIPELINES = {"demo.yaml": "demo", "gpu-check.yaml": "gpu-check", "smollm2.yaml": "smollm2", "tiny-vllm.yaml": "tiny",
             "tiny.yaml": "tiny"}


def test_good_recipes_still_load():
    """Every shipped recipe loads (the folder was read relative to pytest's working folder,
    so a run started elsewhere found no recipes and checked nothing)."""
    from tests.fixtures.runs import REPO

    loaded = {path.name: load_recipe(path).pipeline for path in sorted((REPO / "recipes").glob("*.yaml"))}
    assert loaded == PIPELINES


def test_alias_bomb_in_a_subprocess_stays_small(tmp_path):
    """The 463-byte alias bomb: one line, exit 2, well under a second and 1 GB."""
    path = tmp_path / "bomb.yaml"
    path.write_bytes(CASES["alias-bomb-used"])

    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))

    proc = subprocess.run([sys.executable, "-m", "components.cli", "run", "--recipe", str(path), "--iterations", "0",
                           "--run-root", str(tmp_path / "root")], capture_output=True, text=True, timeout=30,
                          preexec_fn=limit)
    assert proc.returncode == 2, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr
