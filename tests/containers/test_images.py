"""The images for real: built from the Debian-made base with podman, the sandbox working inside.

    pytest -m slow tests/containers/test_images.py

Builds (or reuses, when the inputs did not change) every image through the
``stage_images`` fixture, i.e. ``containers/images.sh``, what ``make images`` runs; then:

- the images are what the pipeline expects: ``posttrain-<stage>:<version>`` with the
  stage's entrypoint under tini, uid 10001, ``POSTTRAIN_IMAGE=1``, CPU torch, Debian's
  ``/usr/bin/python3``, from the Debian-made base;
- ``posttrain sandbox doctor`` in the sandbox image, with ``containers/podman-run-flags``,
  reports the strong isolation (bwrap namespaces + seccomp, nothing missing);
- without those security options the doctor names the real cause: podman's default
  seccomp profile (it denies sethostname inside the sandbox's namespace), the masked
  /proc, or a Docker-like profile that denies user namespaces;
- real code-domain jobs (strict and warm) run sandboxed in the container, the right
  solution passes, a wrong one fails, and nothing is left behind as a zombie;
- under a read-only root with only ``/tmp`` and the home writable (``READ_ONLY``: what a
  stage pod gets, ``readOnlyRootFilesystem`` and two ``emptyDir`` volumes, and the docker
  mode's tmpfs), the doctor still reports the strong isolation, the code jobs run, and a
  whole tiny iteration (every stage, the trainer under torchrun with two processes) runs
  in process in the base image: nothing a stage writes lands elsewhere in the image;
- ``TORCH`` other than cpu/cuda fails the build with a message naming both.

A cold build takes about 4 minutes here (containers/README.md); a reused one seconds.
Not covered: the CUDA torch build (gigabytes; TORCH=cuda is built by hand), a whole
iteration with one container per stage (the DAG's container-mode tests do that).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from components import STAGES
from dags.execution.cluster import SCRATCH_MOUNTS

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600)]

REPO = Path(__file__).resolve().parents[2]
DATA = Path(__file__).resolve().parent / "data"
UNDER_TINI = '["/usr/bin/tini", "-s", "--"]'
STRONG = "bwrap:user,pid,net,ipc,uts,mount,cgroup-ns+uid:unprivileged+caps:none+rlimits+tmpfs:/work,/tmp,/dev/shm+seccomp"
READ_ONLY = ["--read-only", "--read-only-tmpfs=false",
             *(arg for _, path in SCRATCH_MOUNTS for arg in ("--tmpfs", f"{path}:U,size=2g"))]
"""A stage pod's file system: the image read-only, writable only the pod's scratch mounts,
/tmp and the home (podman's --read-only alone would also give /run and /var/tmp, which a
pod does not get; ``U`` gives them to the image's uid, as the pod's emptyDir is writable by it)."""


def run(argv: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout)


def inspect(tag: str) -> dict:
    return json.loads(run(["podman", "image", "inspect", tag]).stdout)[0]


def without_security_opts(flags: list[str], keep: tuple[str, ...] = ()) -> list[str]:
    """The run flags minus every --security-opt pair whose value is not in ``keep``."""
    out, pairs = [], list(zip(flags[::2], flags[1::2]))
    for name, value in pairs:
        if name != "--security-opt" or value in keep:
            out += [name, value]
    return out


def doctor(stage_images, flags: list[str]) -> tuple[int, dict, str]:
    result = run(stage_images.run_argv("sandbox", "sandbox", "doctor", entrypoint="posttrain", flags=flags))
    return result.returncode, json.loads(result.stdout), result.stderr


def test_images_are_the_stage_images_the_pipeline_names(stage_images):
    assert list(stage_images.stages) == list(STAGES)
    for stage, tag in stage_images.stages.items():
        config = inspect(tag)["Config"]
        assert config["Entrypoint"] == ["/usr/bin/tini", "-s", "--", "posttrain-stage"]
        assert config["User"] == "10001:10001"
        assert f"POSTTRAIN_STAGE={stage}" in config["Env"] and "POSTTRAIN_IMAGE=1" in config["Env"]
        assert config["Labels"]["posttrain.inputs"] == stage_images.inputs_hash
        assert config["Labels"]["org.opencontainers.image.title"] == f"posttrain-{stage}"
        # made from the Debian-made base (its label is inherited), not a registry image
        assert config["Labels"]["org.opencontainers.image.source"].startswith("debootstrap:bookworm:")
    base = inspect(stage_images.base)["Config"]
    assert base["Entrypoint"] == ["/usr/bin/tini", "-s", "--", "posttrain"]
    probe = ("import sys, torch, importlib.metadata as m; print(torch.__version__, sys.executable, m.version('posttrain'))")
    out = run(stage_images.run_argv(stage_images.base, "-c", probe, entrypoint="python"))
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["2.13.0+cpu", "/opt/venv/bin/python", "0.1.0"]
    out = run(stage_images.run_argv(stage_images.base, "-I", "-c", "import sys; print(sys.version_info[:2])",
                                    entrypoint="/usr/bin/python3"))
    assert out.stdout.strip() == "(3, 11)", out.stderr


def test_the_index_and_its_ca_are_not_in_the_image(stage_images):
    """build.sh gave the build pip's CA (and any index URL) as secrets: no layer, history entry or
    environment variable keeps them."""
    history = run(["podman", "history", "--no-trunc", "--format", "{{.CreatedBy}}", stage_images.base]).stdout
    assert "BEGIN CERTIFICATE" not in history and "PIP_CERT=" not in history and "PIP_INDEX_URL=" not in history
    env = inspect(stage_images.base)["Config"]["Env"]
    assert not [e for e in env if e.startswith(("PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_CERT", "PIP_CONFIG_FILE"))]
    out = run(stage_images.run_argv(stage_images.base, "-c", "find /run/secrets /tmp/containers /tmp/wheels -type f 2>/dev/null",
                                    entrypoint="sh"))
    assert out.stdout.strip() == ""


def test_a_stage_image_takes_only_the_stage_arguments(stage_images):
    out = run(stage_images.run_argv("rollout", "--help"))
    assert out.returncode == 0, out.stderr
    assert "usage: posttrain stage" in out.stdout and "--shard" in out.stdout and "--run-root" in out.stdout


def test_sandbox_doctor_with_the_run_flags_reports_strong_isolation(stage_images):
    code, report, err = doctor(stage_images, stage_images.run_flags)
    assert code == 0, err
    assert report["missing"] == [] and report["causes"] == []
    assert report["isolation"].startswith(STRONG) and "WEAK" not in report["isolation"]
    assert report["drops_uid"] is False  # uid 10001: jobs run as that unprivileged uid


@pytest.mark.parametrize("keep, causes", [
    ((), ["seccomp-filter", "masked-proc"]),  # podman's defaults
    (("seccomp=unconfined", "apparmor=unconfined"), ["masked-proc"]),
    (("unmask=ALL", "apparmor=unconfined"), ["seccomp-filter"]),
], ids=["no-security-opts", "masked-proc-only", "seccomp-only"])
def test_sandbox_doctor_without_the_security_opts_names_the_real_cause(stage_images, keep, causes):
    code, report, err = doctor(stage_images, without_security_opts(stage_images.run_flags, keep))
    assert code == 1
    assert report["isolation"].startswith("process+rlimits (WEAK")
    assert [c["cause"] for c in report["causes"]] == causes
    assert "would refuse to run the sandbox" in err
    fixes = " ".join(c["fix"] for c in report["causes"])
    if "masked-proc" in causes:
        assert "unmask=ALL" in fixes and "procMount: Unmasked" in fixes
    if "seccomp-filter" in causes:
        assert "seccomp=unconfined" in fixes and "seccompProfile.type: Unconfined" in fixes


def test_sandbox_doctor_under_a_docker_like_seccomp_profile_blames_seccomp_not_the_sysctl(stage_images):
    flags = [*without_security_opts(stage_images.run_flags, ("unmask=ALL", "apparmor=unconfined")),
             "--security-opt", f"seccomp={DATA / 'deny-userns-seccomp.json'}"]
    code, report, _ = doctor(stage_images, flags)
    assert code == 1
    assert [c["cause"] for c in report["causes"]] == ["seccomp-filter"]
    assert "creating a user namespace failed" in report["causes"][0]["evidence"]


def code_jobs(stage_images, flags=None) -> dict:
    """The report of ``data/code_job.py`` run in the sandbox image (``flags``: the run's, else
    the default ones), after checking that a right and a wrong answer each got their verdict
    under strong isolation in strict and warm mode."""
    argv = stage_images.run_argv("sandbox", "python", "/data/code_job.py", entrypoint=UNDER_TINI,
                                 volumes=(f"{DATA}:/data:ro",), flags=flags)
    out = run(argv)
    assert out.returncode == 0, out.stdout + out.stderr
    report = json.loads(out.stdout.splitlines()[-1])
    for mode in ("strict", "warm"):
        assert report[mode]["right"] == [["ok", True, f"{STRONG}+no-cgroup+mode:{mode}"]]
        assert report[mode]["wrong"] == [["ok", False, f"{STRONG}+no-cgroup+mode:{mode}"]]
    return report


def test_code_domain_jobs_run_sandboxed_in_the_container(stage_images):
    report = code_jobs(stage_images)
    # tini is PID 1 and reaps: nothing of the 80 sandboxes is left (was one zombie per job).
    assert len(report["processes_left"]) <= 2, report["processes_left"]


def test_under_a_read_only_root_the_sandbox_keeps_its_strong_isolation(stage_images):
    code, report, err = doctor(stage_images, [*stage_images.run_flags, *READ_ONLY])
    assert code == 0, err
    assert report["missing"] == [] and report["causes"] == []
    assert report["isolation"].startswith(STRONG) and "WEAK" not in report["isolation"]
    code_jobs(stage_images, [*stage_images.run_flags, *READ_ONLY])


def test_a_whole_iteration_runs_under_a_read_only_root(stage_images, tmp_path):
    """Every stage of the tiny recipe, in process in the base image, writing only the run root
    (a bind mount), /tmp and the home: the model and tokenizer folders, the sandbox's jobs,
    torchrun's work folders and checkpoints, torch's compile cache, MLflow's and matplotlib's
    files. A write anywhere else fails with 'Read-only file system'."""
    recipes, root = tmp_path / "recipes", tmp_path / "root"
    recipes.mkdir()
    root.mkdir()
    root.chmod(0o777)  # the image's uid 10001 writes it
    recipes.chmod(0o755)
    text = (REPO / "recipes" / "tiny.yaml").read_text()
    assert "trainer: {prompts_per_step: 4}" in text
    (recipes / "tiny.yaml").write_text(text.replace("trainer: {prompts_per_step: 4}",
                                                    "trainer: {prompts_per_step: 4, processes: 2, parallelism: fsdp}"))
    (recipes / "tiny.yaml").chmod(0o644)
    argv = stage_images.run_argv(stage_images.base, "run", "--recipe", "/recipes/tiny.yaml", "--iterations", "1",
                                 "--run-root", "file:///data/root", volumes=(f"{root}:/data/root", f"{recipes}:/recipes:ro"),
                                 network_host=False, flags=[*stage_images.run_flags, *READ_ONLY, "--network", "none"])
    out = run(argv, timeout=1200)
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    assert "Read-only file system" not in out.stdout + out.stderr
    assert "| trainer |" in out.stdout + out.stderr and "2 process(es)" in out.stdout + out.stderr


def test_an_unknown_torch_fails_the_build_naming_the_choices(stage_images, tmp_path):
    context = tmp_path / "context"
    (context / "containers").mkdir(parents=True)
    for name in ("base.Dockerfile", "pip-env.sh", "constraints.txt"):
        (context / "containers" / name).write_bytes((REPO / "containers" / name).read_bytes())
    (tmp_path / "wheels").mkdir()
    runtime = stage_images.run_flags[stage_images.run_flags.index("--runtime") + 1]
    argv = ["podman", "build", "--runtime", runtime, "-f", str(context / "containers" / "base.Dockerfile"),
            "--build-arg", "BASE_IMAGE=localhost/posttrain-debian:bookworm", "--build-arg", "TORCH=rocm",
            "--build-context", f"wheels={tmp_path / 'wheels'}", str(context)]
    out = run(argv, timeout=900)
    assert out.returncode != 0
    assert "TORCH=rocm: build with --build-arg TORCH=cpu (CPU-only torch) or TORCH=cuda" in out.stdout + out.stderr
