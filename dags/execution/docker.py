"""The ``docker`` execution mode: every stage runs in its image through a Docker-compatible
API (a Docker engine, or podman's ``podman system service`` socket), with the Airflow
Docker provider's ``DockerOperator``.

What a stage container gets:

- the image ``image_for(stage)``, its entrypoint ``posttrain stage <id>``, and the
  arguments the seam hands it (``command``);
- the worker's store, tracking and cloud settings: every ``POSTTRAIN_*`` (but the
  DAG-side ones), ``MLFLOW_*`` and ``AWS_*`` variable; secrets (``*SECRET*``,
  ``*TOKEN*``, ``*PASSWORD*``, and a URI with a password) go as private environment,
  never rendered in the UI;
- the network ``POSTTRAIN_DOCKER_NETWORK`` (default ``host``: the store and tracking
  server the worker reaches on loopback are reachable the same way);
- a local run root (``file://``) bind-mounted at the same path: ``POSTTRAIN_RUN_ROOT``'s,
  read at DAG parse, and the run's own (a run conf's ``run_root``, ``posttrain run
  --run-root``) where that is another folder;
- the flags in ``POSTTRAIN_CONTAINER_FLAGS`` (default ``containers/podman-run-flags`` of
  this checkout when present), the same file the Makefile and tests pass to ``podman
  run``: ``--ulimit`` and ``--runtime`` on every container, ``--security-opt`` only on
  stages that run policy-written code (``StageSpec.sandboxed``), which need them for
  bubblewrap's namespaces;
- its CPU request as CPU shares (``resources.<stage>.cpu`` x 1024, the weight the kubelet
  gives a pod's request; no CPU limit, as on the pod), its memory as the memory limit, and,
  on the stages whose pod gets ``/dev/shm`` in memory (``gpus`` > 0: torch, vLLM), a
  ``/dev/shm`` as large as that limit (it counts against it), not the engine's 64 MiB;
- a read-only root filesystem (``read_only``), as its pod has, and its scratch space
  instead: a tmpfs at ``/tmp`` and one at the images' home ``/home/posttrain`` (where
  ``POSTTRAIN_HOME`` and the Hugging Face, matplotlib and MLflow caches are), each of
  ``resources.<stage>.scratch`` (the registry's unless the recipe overrides it), executable
  (torch's compiled kernels are loaded from there), the home one owned by the images' uid
  (podman's ``U`` option; on another engine mode 1777, its default). Unlike the pod's
  node-disk ``emptyDir``, a tmpfs is memory: what a stage writes there counts against its
  memory limit, which a stage that writes more than it can hold reaches first. The run
  root's bind mount stays writable.

``unmask=ALL`` in the default flags is podman's: a Docker Engine refuses it. ``posttrain
run`` asks the engine what it is before any work (``check_engine_here``), and a sandboxed
stage's task before its container: on a Docker Engine with such an option, one line naming
``DOCKER_HOST`` and exit 2, not retried failures. A container cut short (its time limit,
SIGTERM or Ctrl-C to ``posttrain run``, a lost writer lease) is stopped (SIGTERM, then
SIGKILL after ``STOP_GRACE_S``) and removed; the task fails unretried (the time limit,
naming ``timeouts.<stage>``) or ends stopped.

The engine is ``DOCKER_HOST`` (default ``unix:///var/run/docker.sock``). Not covered:
GPUs in this mode (``device_requests`` is left to a deployment that has them), and
registries with credentials (the images must already be on the engine: ``make images``).
"""

from __future__ import annotations

import logging
import os
import re
import shlex
import sys
from functools import cache
from pathlib import Path
from typing import Any

from components.core.errors import UserError
from components.core.stages import Resources, StageSpec
from dags.execution.cluster import SCRATCH_MOUNTS

ARGS_FIELD = "command"
FLAGS_VAR = "POSTTRAIN_CONTAINER_FLAGS"
NETWORK_VAR = "POSTTRAIN_DOCKER_NETWORK"
DEFAULT_FLAGS = Path(__file__).resolve().parents[2] / "containers" / "podman-run-flags"
PASSED_PREFIXES = ("POSTTRAIN_", "MLFLOW_", "AWS_")
IMAGE_UID = 10001  # the user the images run as (containers/base.Dockerfile)
SCRATCH = tuple(path for _, path in SCRATCH_MOUNTS)  # /tmp and the images' HOME: a stage's writable places, as on its pod
KEPT_ON_WORKER = ("POSTTRAIN_EXECUTION", "POSTTRAIN_HOME", "POSTTRAIN_RECIPE", "POSTTRAIN_SCHEDULE", "POSTTRAIN_IMAGE_PREFIX",
                  "POSTTRAIN_IMAGE_TAG", "POSTTRAIN_CONTAINER_FLAGS", "POSTTRAIN_DOCKER_NETWORK", "POSTTRAIN_RETRY_DELAY_S",
                  "POSTTRAIN_VLLM_PYTHON")
SECRET = re.compile(r"SECRET|TOKEN|PASSWORD", re.I)
CREDENTIALS_IN_URI = re.compile(r"://[^/@\s]*:[^/@\s]*@")  # user:password@ (MLflow's basic auth, a database URI)
_LIMIT = re.compile(r"[0-9]{1,19}")  # a --ulimit number: ASCII digits ("²" is a digit to str.isdigit, not to int)


class ContainerFlags:
    """The podman/docker run flags a stage container needs, parsed from one line of a file:
    ``--security-opt X``, ``--ulimit name=soft:hard``, ``--runtime R`` (anything else is a
    UserError naming the flag, so the file cannot silently drift from what is applied)."""

    def __init__(self, text: str, source: str = "<flags>") -> None:
        self.security_opt: list[str] = []
        self.ulimits: list[tuple[str, int, int]] = []
        self.runtime: str | None = None
        try:
            words = shlex.split(text, comments=True)
        except ValueError as exc:  # "No closing quotation"
            raise UserError(FLAGS_VAR, source, f"not shell words ({exc})", "close its quotes") from None
        pairs = [w.split("=", 1) if w.startswith("--") and "=" in w else [w] for w in words]
        flat = [p for pair in pairs for p in pair]
        for flag, value in zip(flat[::2], flat[1::2]):
            if flag == "--security-opt":
                self.security_opt.append(value)
            elif flag == "--runtime":
                self.runtime = value
            elif flag == "--ulimit":
                name, _, limits = value.partition("=")
                soft, _, hard = limits.partition(":")
                hard = hard or soft
                numbers = all(_LIMIT.fullmatch(x) and int(x) < 2**63 for x in (soft, hard))  # ASCII digits, int64
                if not (name and numbers):
                    raise UserError(FLAGS_VAR, source, f"--ulimit {value!r} is not name=soft[:hard]",
                                    "write e.g. --ulimit nofile=1024:1024")
                if int(soft) > int(hard):
                    raise UserError(FLAGS_VAR, source, f"--ulimit {value!r} has a soft limit above its hard limit",
                                    "write soft <= hard, e.g. --ulimit nofile=1024:1024")
                self.ulimits.append((name, int(soft), int(hard)))
            else:
                raise UserError(FLAGS_VAR, source, f"flag {flag!r} is not one the docker mode applies",
                                "use only --security-opt, --ulimit and --runtime there")
        if len(flat) % 2:
            raise UserError(FLAGS_VAR, source, f"flag {flat[-1]!r} has no value", "give it its value")


_NETWORK = re.compile(r"[a-zA-Z0-9][a-zA-Z0-9_.-]{0,254}|container:[a-zA-Z0-9][a-zA-Z0-9_.-]{0,254}", re.ASCII)


def network_mode() -> str:
    """``POSTTRAIN_DOCKER_NETWORK`` (default ``host``): a network's name (``host``,
    ``bridge``, ``none``, a user-defined one) or ``container:<name>``, in the characters
    docker and podman take; anything else is a UserError here, not a failed container
    start on every task."""
    raw = os.environ.get(NETWORK_VAR) or "host"
    if not _NETWORK.fullmatch(raw):
        raise UserError(NETWORK_VAR, raw, "is not a network name (letters, digits, '_', '.', '-'; at most 255)",
                        "set it to host (the default), bridge, or a network `podman network ls` lists")
    return raw


@cache
def container_flags() -> ContainerFlags:
    path = os.environ.get(FLAGS_VAR) or (str(DEFAULT_FLAGS) if DEFAULT_FLAGS.is_file() else "")
    if not path:
        return ContainerFlags("")
    from components.core.files import Unreadable, read_regular

    fix = "point it at a file of podman run flags such as containers/podman-run-flags"
    try:
        data = read_regular(path, 1 << 16)
    except Unreadable as exc:
        raise UserError(FLAGS_VAR, path, exc.why, fix) from None
    if len(data) > 1 << 16:
        raise UserError(FLAGS_VAR, path, "larger than 64 KiB", fix)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise UserError(FLAGS_VAR, path, "not UTF-8 text", fix) from None
    return ContainerFlags(text, path)


def passed_environment() -> tuple[dict[str, str], dict[str, str]]:
    """(environment, private environment) handed from the worker to a stage container: a
    variable whose name says it is a secret, or whose value is a URI with a password in it
    (``MLFLOW_TRACKING_URI=https://user:pw@host``), goes private, never rendered in the UI."""
    env, private = {}, {}
    for name, value in os.environ.items():
        if name.startswith(PASSED_PREFIXES) and name not in KEPT_ON_WORKER:
            (private if SECRET.search(name) or CREDENTIALS_IN_URI.search(value) else env)[name] = value
    return env, private


PODMAN_ONLY_SECURITY_OPTS = ("mask", "unmask", "proc-opts")
"""``--security-opt`` keys podman takes and a Docker Engine refuses (``invalid --security-opt``)."""


def podman_only(security_opt: list[str]) -> list[str]:
    """The options of ``security_opt`` that only podman applies (``unmask=ALL``: the
    sandboxed stages' fresh ``/proc`` for bubblewrap)."""
    return [o for o in security_opt if o.partition("=")[0].strip() in PODMAN_ONLY_SECURITY_OPTS]


def engine_name(version: dict[str, Any]) -> str:
    """The engine an API's ``/version`` answer describes: ``Podman Engine`` (podman lists
    it among its ``Components``), else its ``Platform`` name (``Docker Engine - Community``)
    or ``Docker Engine``."""
    names = [str(c.get("Name") or "") for c in version.get("Components") or [] if isinstance(c, dict)]
    podman = next((n for n in names if "podman" in n.lower()), "")
    platform = str((version.get("Platform") or {}).get("Name") or "")
    return podman or ("Podman Engine" if "podman" in platform.lower() else platform or "Docker Engine")


def check_engine(version: dict[str, Any], url: str, security_opt: list[str] | None = None) -> None:
    """A UserError when the engine at ``url`` (its ``/version`` answer) is not podman and the
    sandboxed stages' options (``security_opt``, default the flags file's) hold one only
    podman applies: a Docker Engine refuses ``unmask=ALL`` at every container's creation,
    which the tasks took for an outage and retried."""
    wanted = podman_only(container_flags().security_opt if security_opt is None else security_opt)
    name = engine_name(version)
    if not wanted or "podman" in name.lower():
        return
    raise UserError("DOCKER_HOST", url, f"the engine there is {name}, which refuses --security-opt "
                    f"{' '.join(wanted)} (podman's; the sandboxed stages need it for bubblewrap's /proc)",
                    "point DOCKER_HOST at podman's socket (`podman system service`), use "
                    "POSTTRAIN_EXECUTION=kubernetes, or unset POSTTRAIN_EXECUTION to run the stages in this process")


def cpu_count(quantity: str) -> float:
    """A Kubernetes CPU quantity (``2``, ``0.5``, ``500m``) in CPUs."""
    return int(quantity[:-1]) / 1000 if quantity.endswith("m") else float(quantity)


log = logging.getLogger(__name__)
STOP_GRACE_S = 10
"""Seconds a stopped stage container has between SIGTERM and SIGKILL (Docker's default)."""


def _operator_class():
    from airflow.providers.docker.exceptions import DockerContainerFailedException
    from airflow.providers.docker.operators.docker import DockerOperator

    class _Engine:
        """docker-py's client with the stage's security options and runtime added to each
        container's host config, and the container's exit status kept. The provider's own
        cleanup after a time limit or a stop (its ``remove_container`` without force, which
        an engine refuses for a running container, HTTP 500, and which then replaced the
        timeout, so the task was retried with the container still running) stops the
        container (SIGTERM, SIGKILL after the engine's grace period) and removes it."""

        def __init__(self, client, security_opt: list[str], runtime: str | None, read_only: bool = False,
                     scratch: dict[str, int] | None = None) -> None:
            self._client, self._security_opt, self._runtime = client, security_opt, runtime
            self._read_only, self._scratch = read_only, dict(scratch or {})
            self._version: dict[str, Any] | None = None
            self.status: int | None = None
            self.removed: str | None = None  # the container stopped and removed on an interruption

        def __getattr__(self, name: str):
            return getattr(self._client, name)

        def version(self, *args, **kwargs) -> dict[str, Any]:
            if self._version is None:  # asked once per container: the engine check and the tmpfs options
                self._version = self._client.version(*args, **kwargs)
            return self._version

        def podman(self) -> bool:
            """Whether the engine is podman; an engine that does not say counts as another."""
            try:
                return "podman" in engine_name(self.version()).lower()
            except Exception:  # noqa: BLE001 - unreachable or silent: creating the container then fails with the engine's reason
                return False

        def create_host_config(self, **kwargs):
            if self._security_opt:
                kwargs["security_opt"] = list(self._security_opt)
            if self._runtime:
                kwargs["runtime"] = self._runtime
            if self._read_only:
                kwargs["read_only"] = True
            if self._scratch:
                kwargs["tmpfs"] = tmpfs_options(self._scratch, self.podman())
            return self._client.create_host_config(**kwargs)

        def wait(self, *args, **kwargs):
            result = self._client.wait(*args, **kwargs)
            self.status = result.get("StatusCode")
            return result

        def stop(self, container, timeout: int | None = None):
            # Docker's own grace period, given: podman's Docker API without one kills at once
            # (SIGKILL), and the stage never ended its MLflow run KILLED
            return self._client.stop(container, timeout=STOP_GRACE_S if timeout is None else timeout)

        def remove_container(self, container, force: bool = False, **kwargs):
            from dags.execution import interruption

            if force or interruption(sys.exc_info()[1]) is None:
                return self._client.remove_container(container, force=force, **kwargs)
            from docker.errors import APIError

            try:
                self.stop(container)
                self._client.remove_container(container, force=True, **kwargs)
                self.removed = container
            except APIError as exc:  # the interruption goes on: the task's failure is that, not this
                log.warning("could not stop and remove container %s: %s", container, exc)
            return None

    class StageContainer(DockerOperator):
        """DockerOperator for a posttrain stage: security options and runtime from the
        flags file; exit 2/3 (user mistake, failed gate) or its time limit fail at once,
        unretried; SIGTERM or Ctrl-C under ``posttrain run`` stops the container and ends
        the task as stopped (``dags.execution.run_stoppably``); a sandboxed stage on an
        engine that refuses its podman-only options fails at once, with one line."""

        def __init__(self, *, security_opt: list[str] | None = None, runtime: str | None = None, read_only: bool = False,
                     scratch: dict[str, int] | None = None, **kwargs) -> None:
            super().__init__(**kwargs)
            self.security_opt = security_opt or []
            self.runtime = runtime
            self.read_only = read_only
            self.scratch = dict(scratch or {})  # tmpfs path -> its size in bytes
            self._engine = None

        @property
        def cli(self):
            if self._engine is None:
                self._engine = _Engine(self.hook.api_client, self.security_opt, self.runtime, self.read_only, self.scratch)
            return self._engine

        def execute(self, context):
            from dags.execution import FAIL_NOW_EXIT_CODES, fail_now, fail_user_error, run_stoppably

            self._normalize_mounts()
            self.mounts = [*self.mounts, *run_root_mounts(self.command, self.mounts)]
            if podman_only(self.security_opt):
                try:
                    check_engine(self.cli.version(), self.docker_url, self.security_opt)
                except UserError as exc:
                    raise fail_user_error(exc) from None
            try:
                return run_stoppably(self, super().execute, context)
            except DockerContainerFailedException as exc:
                if self._engine is not None and self._engine.status in FAIL_NOW_EXIT_CODES:
                    last = next((str(line).strip() for line in reversed(exc.logs or []) if str(line).strip()), "(no output)")
                    raise fail_now(self._engine.status, last, self.task_id, "container") from exc
                raise

        def on_kill(self) -> None:
            if self._engine is not None and self.container is not None and self._engine.removed == self.container["Id"]:
                return  # stopped and removed already, where the provider's cleanup would have removed it
            super().on_kill()

    return StageContainer


def tmpfs_options(scratch: dict[str, int], podman: bool) -> dict[str, str]:
    """docker-py's ``tmpfs`` host config for the scratch space: each path's size, ``exec``
    (the engines' ``--tmpfs`` default is ``noexec``, and torch loads the kernels it compiles
    there), and a home the images' uid can write: podman's ``U`` (it chowns the tmpfs to
    the container's user; podman 4 ignores ``mode`` on a tmpfs over a folder of the
    image), else mode 1777 (Docker's default for a tmpfs; podman refuses ``uid=``)."""
    home = "U" if podman else "mode=1777"
    return {path: f"size={size},exec,{'mode=1777' if path == '/tmp' else home}" for path, size in scratch.items()}


def local_folder(run_root: str) -> str | None:
    """The absolute folder of a local run root (a path or ``file://`` URI); None for a
    store's (``s3://``) and for a URI the stage itself will refuse."""
    from components.core.storage import normalize_uri

    try:
        uri = normalize_uri(run_root)
    except UserError:
        return None
    return uri.removeprefix("file://") if uri.startswith("file://") else None


def check_run_root(run_root: str) -> None:
    """``posttrain run``'s check, before any work, that the stage containers can write a
    local run root. They run as the images' uid ``IMAGE_UID``; the folders this process
    makes in the run root (the writer lease's, the iteration's) belong to its own uid with
    mode 0755, so under another uid every stage failed to write and the run ended with a
    misleading exit 2. Not covered: images built with another uid, and a run root on a
    network file system that maps ownership otherwise."""
    if local_folder(run_root) is None or os.geteuid() == IMAGE_UID:
        return
    raise UserError("--run-root", run_root,
                    f"docker-mode stage containers run as uid {IMAGE_UID} (the images' user) and cannot write the "
                    f"folders this process (uid {os.geteuid()}) makes in a local run root",
                    "give an s3:// run root (POSTTRAIN_RUN_ROOT or --run-root), or run posttrain as uid "
                    f"{IMAGE_UID}")


def run_root_mounts(command: list[str] | str | None, mounts: list) -> list:
    """The bind mount of the task's own run root (its ``--run-root`` argument, rendered
    from the plan), where it is local and no mount at the same path holds it: a run root
    given in the run conf or ``posttrain run --run-root`` differs from the one read at
    DAG parse (``POSTTRAIN_RUN_ROOT``), and a container that cannot see it failed every
    stage with exit 2 (no such run root). Made first if missing, as the parse-time one is."""
    args = command.split() if isinstance(command, str) else list(command or [])
    given = next((args[i + 1] for i, a in enumerate(args[:-1]) if a == "--run-root"), None)
    path = local_folder(given) if given else None
    if path is None:
        return []
    for m in mounts:
        target, source = m.get("Target"), m.get("Source")
        if target == source and target and (path == target or path.startswith(target.rstrip("/") + "/")):
            return []
    from docker.types import Mount

    Path(path).mkdir(parents=True, exist_ok=True)
    return [Mount(target=path, source=path, type="bind")]


def operator(spec: StageSpec, res: Resources) -> tuple[type, dict[str, Any]]:
    """(the stage's DockerOperator class, its keyword arguments)."""
    from docker.types import Mount, Ulimit

    from components.core import settings
    from dags.execution import image_for

    flags = container_flags()
    env, private = passed_environment()
    mounts = []
    run_root = settings.default_run_root()
    if "://" not in run_root or run_root.startswith("file://"):
        path = run_root.removeprefix("file://")
        Path(path).mkdir(parents=True, exist_ok=True)
        mounts.append(Mount(target=path, source=path, type="bind"))
    kwargs: dict[str, Any] = {
        "image": image_for(spec.id),
        "docker_url": os.environ.get("DOCKER_HOST") or "unix:///var/run/docker.sock",
        "network_mode": network_mode(),
        "environment": env,
        "private_environment": private,
        "mounts": mounts,
        "mount_tmp_dir": False,
        "auto_remove": "success",
        "force_pull": False,
        "ulimits": [Ulimit(name=n, soft=s, hard=h) for n, s, h in flags.ulimits],
        "runtime": flags.runtime,
        "security_opt": flags.security_opt if spec.sandboxed else [],
        "labels": {"posttrain.stage": spec.id},
        "mem_limit": _bytes(res.memory),
        "cpus": cpu_count(res.cpu),  # CPU shares, 1024 per CPU: the weight a pod's CPU request gets
        "read_only": True,  # as the pod's readOnlyRootFilesystem: a stage writes only its scratch and the run root
        "scratch": {path: _bytes(res.scratch) for path in SCRATCH},
    }
    if res.gpus > 0:  # the stages whose pod gets /dev/shm in memory (torch, vLLM), up to its memory limit
        kwargs["shm_size"] = _bytes(res.memory)
    return _operator_class(), kwargs


def _bytes(quantity: str) -> int:
    """A Kubernetes memory or storage quantity (``16Gi``) in bytes, for Docker's memory limit and tmpfs sizes."""
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}
    for suffix, factor in units.items():
        if quantity.endswith(suffix):
            return int(quantity[: -len(suffix)]) * factor
    return int(quantity)
