"""Run settings that come from the deployment, not the recipe: where things live.

- ``POSTTRAIN_HOME``: the local home (embedded MLflow database, Airflow home); default
  ``.posttrain`` under the working directory, resolved to an absolute path.
- ``POSTTRAIN_RUN_ROOT``: the store URI every stage reads and writes; default
  ``<home>/store``.

The CLI and the orchestrators read them here, so they agree on the defaults. Not
covered: the recipe path and schedule, which the orchestrators pass explicitly.
"""

from __future__ import annotations

import os
from pathlib import Path

DEFAULT_RECIPE = "recipes/demo.yaml"


def home() -> Path:
    return Path(os.environ.get("POSTTRAIN_HOME", ".posttrain")).resolve()


def default_run_root() -> str:
    return os.environ.get("POSTTRAIN_RUN_ROOT") or str(home() / "store")
