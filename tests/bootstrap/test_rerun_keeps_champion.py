"""A re-run bootstrap leaves a trained champion in place while it bootstraps the same
model, and starts a new line only when the recipe's ``model`` section changed.

Before, every bootstrap that really ran (a changed ``rollout``, ``evaluation`` or
``sandbox`` section misses its cache) moved ``champion`` and ``candidate`` back to the
bootstrap version, so the next nightly iteration trained from the base policy again.
A real ``posttrain run`` of recipes/tiny.yaml, then ``posttrain stage bootstrap`` with
edited recipes, as a user runs them.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from components.core import models
from tests.fixtures.home import use_home
from tests.fixtures.runs import TINY, cli_env, run_posttrain


def edited(tmp: Path, name: str, section: str, key: str, value) -> Path:
    recipe = yaml.safe_load(TINY.read_text())
    recipe[section][key] = value
    path = tmp / name
    path.write_text(yaml.safe_dump(recipe))
    return path


def aliases() -> tuple[str, str]:
    return models.resolve_alias("tiny", "champion")[0], models.resolve_alias("tiny", "candidate")[0]


def test_a_rerun_bootstrap_keeps_the_trained_champion_unless_the_model_changed(tmp_path: Path,
                                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    home = tmp_path / ".posttrain"
    env = cli_env(home)
    root = str(tmp_path / "root")
    ran = run_posttrain(["run", "--recipe", str(TINY), "--iterations", "1", "--run-root", root], tmp_path, env)
    assert ran.returncode == 0, ran.stdout[-3000:] + ran.stderr[-3000:]
    use_home(monkeypatch, home)
    champion, candidate = aliases()
    assert candidate == "2"
    if champion != "2":  # iteration 1 held its candidate: promoted by hand, as an operator may
        models.set_alias("tiny", "champion", "2")

    # A sampling setting changed: bootstrap runs again (its cache key holds the rollout
    # section), makes the same weights, and leaves the line that grew from them alone.
    warmer = edited(tmp_path, "warmer.yaml", "rollout", "temperature", 0.9)
    again = run_posttrain(["stage", "bootstrap", "--recipe", str(warmer), "--run-root", root], tmp_path, env)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert "registered version 1; champion stays version 2, trained from the same model" in again.stdout
    assert aliases() == ("2", "2")

    # Another SFT length: other weights, a new version, and the line goes on from the champion.
    shorter = edited(tmp_path, "shorter.yaml", "bootstrap", "max_steps", 10)
    fresh = run_posttrain(["stage", "bootstrap", "--recipe", str(shorter), "--run-root", root], tmp_path, env)
    assert fresh.returncode == 0, fresh.stdout[-3000:] + fresh.stderr[-3000:]
    assert "registered version 3; champion stays version 2, trained from the same model" in fresh.stdout
    assert aliases() == ("2", "2")
    assert models.lineage_root("tiny", "2") == "1" and models.lineage_root("tiny", "3") == "3"

    # Another model: a new line starts from its bootstrap.
    wider = edited(tmp_path, "wider.yaml", "model", "intermediate_size", 96)
    new = run_posttrain(["stage", "bootstrap", "--recipe", str(wider), "--run-root", root], tmp_path, env)
    assert new.returncode == 0, new.stdout[-3000:] + new.stderr[-3000:]
    assert "registered version 4 as champion (was version 2, trained from another model)" in new.stdout
    assert aliases() == ("4", "4")
