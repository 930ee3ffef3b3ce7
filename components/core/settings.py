"""Run settings that come from the deployment, not the recipe: one module for the CLI,
the Airflow DAG and the Kubeflow pipeline.

| variable | meaning | default |
|---|---|---|
| ``POSTTRAIN_HOME`` | local home: embedded MLflow database, Airflow home | ``./.posttrain``, made absolute |
| ``POSTTRAIN_RUN_ROOT`` | store URI every stage reads and writes | ``<home>/store`` |
| ``POSTTRAIN_RECIPE`` | recipe YAML | ``recipes/demo.yaml`` of this checkout |
| ``POSTTRAIN_SCHEDULE`` | when the DAG runs (see ``dags/wiring.py``) | manual |

An explicit value (a CLI flag, a DAG run param) overrides the environment; empty means
"not given". Every default is absolute, so a worker whose working directory differs
from the scheduler's resolves the same paths. Not covered: secrets (credentials come
from the usual AWS/MLflow variables).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from components.core.storage import normalize_uri

CHECKOUT = Path(__file__).resolve().parents[2]
DEFAULT_RECIPE = str(CHECKOUT / "recipes" / "demo.yaml")


def home() -> Path:
    return Path(os.environ.get("POSTTRAIN_HOME") or ".posttrain").resolve()


def default_run_root() -> str:
    return os.environ.get("POSTTRAIN_RUN_ROOT") or str(home() / "store")


def default_recipe() -> str:
    return os.environ.get("POSTTRAIN_RECIPE") or DEFAULT_RECIPE


@dataclass(frozen=True)
class RunSettings:
    recipe: str  # absolute path of the recipe file
    run_root: str  # normalised store URI


def resolve(recipe: str | None = None, run_root: str | None = None) -> RunSettings:
    """Explicit values win, then the environment, then the absolute defaults."""
    recipe_path = Path(recipe or default_recipe()).expanduser()
    return RunSettings(recipe=str(recipe_path.resolve()),
                       run_root=normalize_uri(run_root or default_run_root(), "--run-root"))
