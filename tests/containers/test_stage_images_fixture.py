"""The ``stage_images`` fixture's result object (tests/fixtures/images.py), without building anything.

    pytest tests/containers/test_stage_images_fixture.py

Checks the tags it hands out are the ones the pipeline names, and that its ``podman run``
command line and Docker-API options come from ``containers/podman-run-flags`` itself.
The build and reuse are exercised by tests/containers/test_images.py (slow).
"""

from __future__ import annotations

from components import STAGES, __version__
from tests.fixtures.images import RUN_FLAGS, StageImages, _tags


def images() -> StageImages:
    base, stages = _tags()
    return StageImages(base=base, stages=stages, run_flags_file=RUN_FLAGS, inputs_hash="0" * 16)


def test_tags_are_the_pipelines():
    found = images()
    assert found.base == f"posttrain-base:{__version__}"
    assert list(found.stages) == list(STAGES)
    assert [found.tag(s) for s in STAGES] == [f"posttrain-{s}:{__version__}" for s in STAGES]


def test_run_argv_uses_the_flags_file():
    found = images()
    flags = RUN_FLAGS.read_text().split()
    argv = found.run_argv("sandbox", "--recipe", "recipes/tiny.yaml", env={"A": "1"}, volumes=("/x:/y:ro",))
    assert argv == ["podman", "run", "--rm", *flags, "--network", "host", "-e", "A=1", "-v", "/x:/y:ro",
                    f"posttrain-sandbox:{__version__}", "--recipe", "recipes/tiny.yaml"]
    assert found.run_argv("img:1", network_host=False, flags=[], entrypoint="sh") == [
        "podman", "run", "--rm", "--entrypoint", "sh", "img:1"]


def test_docker_options_mirror_the_flags_file():
    options = images().docker_options()
    assert sorted(options["security_opt"]) == ["apparmor=unconfined", "seccomp=unconfined", "unmask=ALL"]
    assert options["ulimits"] == [{"name": "nofile", "soft": 1024, "hard": 1024}, {"name": "nproc", "soft": 1000, "hard": 1000}]
    assert options["runtime"] == "runc"
