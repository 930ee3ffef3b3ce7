"""Where the DAG's stage tasks run: one switch, ``POSTTRAIN_EXECUTION``, read at DAG parse.

| mode | a stage task | the deployment provides |
|---|---|---|
| ``inprocess`` (default) | a TaskFlow task calls the stage function on the worker | the project installed on the workers |
| ``docker`` | the stage's image runs through a Docker-compatible API (Docker, or podman's socket) | ``DOCKER_HOST``, the images (``make images``) |
| ``kubernetes`` | a pod in the stage's image (``KubernetesPodOperator``) | images in a registry; namespace, service account, config map |

The wiring is shared: the same plan task, the same registry of stages, shard mapping,
retries, pools, time limits and failure callbacks. In the container modes the plan task
publishes the recipe into the store (a container cannot see the scheduler's files), and
a ``<stage>_args`` task hands each task its argument list (one per shard), the
command line of ``posttrain stage <id>`` that the image's entrypoint runs. A container
that exits 2 (a user's mistake) or 3 (a failed data-quality gate) fails at once;
any other failure is retried like an outage.

Images are ``<POSTTRAIN_IMAGE_PREFIX>posttrain-<stage>:<POSTTRAIN_IMAGE_TAG>`` (tag:
the package version by default). Not covered: mixing modes per stage.

The DAG's settings read at parse (``POSTTRAIN_EXECUTION`` here, ``POSTTRAIN_SCHEDULE``
and ``POSTTRAIN_RETRY_DELAY_S`` for ``dags/wiring.py``) are checked by ``mode``,
``schedule_value`` and ``retry_delay_s``: a bad value is a ``UserError`` naming the
variable, the value and the values allowed (a DAG import error under Airflow).
``check_settings`` runs all three; ``posttrain run`` calls it before any work (one line,
exit 2). This module imports Airflow only where an operator is built, so those checks
cost no Airflow start-up.
"""

from __future__ import annotations

import math
import os
import re
from typing import Any

from components import __version__
from components.core.errors import UserError, value_text
from components.core.settings import env_text
from components.core.stages import StageSpec, resources

MODE_VAR = "POSTTRAIN_EXECUTION"
MODES = ("inprocess", "docker", "kubernetes")
FAIL_NOW_EXIT_CODES = (2, 3)  # UserError, DataQualityError: retrying cannot help

SCHEDULE_VAR = "POSTTRAIN_SCHEDULE"
SCHEDULE_PRESETS = ("@once", "@continuous", "@hourly", "@daily", "@weekly", "@monthly", "@quarterly", "@yearly")
SCHEDULE_ASSETS = ("asset:champion", "asset:candidate", "asset:task-file")
"""The asset schedules (``dags/wiring.py`` maps each to its Airflow ``Asset``)."""
MANUAL = ("", "manual", "none")
RETRY_DELAY_VAR = "POSTTRAIN_RETRY_DELAY_S"  # the first retry's delay in seconds (default 10; tests shorten it)
RETRY_DELAY_DEFAULT_S = 10.0
MAX_RETRY_DELAY_S = 600.0
"""The longest wait between retries (``max_retry_delay`` in ``dags/wiring.py``): a longer
first delay would be cut to it."""


def mode() -> str:
    """The execution mode; a UserError (a DAG import error) naming the choices for a bad value."""
    raw = env_text(MODE_VAR)
    value = (raw or "inprocess").lower()
    if value not in MODES:
        raise UserError(MODE_VAR, raw, "unknown execution mode",
                        f"use one of {', '.join(MODES)} (unset: inprocess)")
    return value


def schedule_value(value: str) -> str | None:
    """A ``POSTTRAIN_SCHEDULE`` value (the environment's through ``env_text``, which refuses
    white space around it; an Airflow Variable's is stripped here): None for manual (empty,
    ``manual``, ``none``), else a preset, an asset schedule or a cron expression; a UserError naming
    the allowed values otherwise."""
    text = (value or "").strip()
    if text.lower() in MANUAL:
        return None
    if text in SCHEDULE_ASSETS:
        return text
    if text.startswith("@"):
        if text not in SCHEDULE_PRESETS:
            raise UserError(SCHEDULE_VAR, value, f"unknown preset; the presets are {', '.join(SCHEDULE_PRESETS)}",
                            "use one of those presets, a cron expression such as '0 2 * * *', or unset it for manual")
        return text
    from croniter import croniter

    try:
        valid = croniter.is_valid(text)
    except Exception:  # croniter's own errors on odd input: not a cron expression either
        valid = False
    if not valid:
        raise UserError(SCHEDULE_VAR, value,
                        f"neither a cron expression, a preset nor one of {', '.join(SCHEDULE_ASSETS)}",
                        "use e.g. '0 2 * * *', '@daily' or 'asset:champion' (unset or 'manual': only when triggered)")
    if len(text.split()) != 5:  # croniter takes a sixth field of seconds (and a seventh); Airflow's timetable runs it
        raise UserError(SCHEDULE_VAR, value, f"has {len(text.split())} fields; a cron expression here has 5 (minute "
                        "hour day-of-month month day-of-week)", "use e.g. '0 2 * * *' (02:00 every day)")
    from datetime import UTC, datetime

    try:  # what Airflow's CronTriggerTimetable asks of it, from now on and back
        croniter(text, datetime.now(UTC)).get_next(datetime)
        croniter(text, datetime.now(UTC)).get_prev(datetime)
    except Exception:  # CroniterBadDateError: "failed to find next date"
        raise UserError(SCHEDULE_VAR, value, "names no date that exists (e.g. 31 February): the DAG would never run",
                        "use a day of the month every month has, e.g. '0 2 28 * *'") from None
    return text


def retry_delay_s() -> float:
    """``POSTTRAIN_RETRY_DELAY_S``: the first retry's delay in seconds, from 0 to
    ``MAX_RETRY_DELAY_S`` (default 10); a UserError otherwise."""
    raw = env_text(RETRY_DELAY_VAR)
    if not raw:
        return RETRY_DELAY_DEFAULT_S
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (0 <= value <= MAX_RETRY_DELAY_S):  # also NaN
        raise UserError(RETRY_DELAY_VAR, raw, f"not a number of seconds from 0 to {MAX_RETRY_DELAY_S:g}",
                        f"set it to e.g. '10' (retries then wait 10 s, 20 s, 40 s), or unset it for "
                        f"{RETRY_DELAY_DEFAULT_S:g} s")
    return value


def check_settings() -> None:
    """The DAG's settings from the environment, as its import would read them: a UserError
    for the first bad one (``POSTTRAIN_EXECUTION``, ``POSTTRAIN_SCHEDULE``,
    ``POSTTRAIN_RETRY_DELAY_S``, and the chosen mode's own: the docker mode's
    ``POSTTRAIN_CONTAINER_FLAGS`` file and ``POSTTRAIN_DOCKER_NETWORK``, the kubernetes mode's cluster settings, and both
    modes' image prefix and tag). A schedule kept as an Airflow Variable is not read here."""
    chosen = mode()
    schedule_value(env_text(SCHEDULE_VAR))
    retry_delay_s()
    if chosen in ("docker", "kubernetes"):
        image_for("trainer")
    if chosen == "docker":
        from dags.execution import docker

        docker.container_flags()
        docker.network_mode()
    elif chosen == "kubernetes":
        from dags.execution import cluster

        cluster.cluster_settings()


def check_engine_here() -> None:
    """``posttrain run``'s check, before any work, that this machine can reach the chosen
    mode's engine at all: a Kubernetes configuration (in-cluster, or a kubeconfig), a
    Docker engine's socket. Before, each stage task failed on it and was retried as an
    outage, minutes of tracebacks and then exit 1. Not at the DAG's import: a scheduler's
    workers have their own. A socket or cluster that is there but does not answer is
    still an outage, retried. A Docker Engine (not podman) where the flags file holds
    podman-only security options (``unmask=ALL``, which the sandboxed stages need) is
    refused here too: it rejected every sandboxed stage's container, retried as an outage."""
    chosen = mode()
    if chosen == "kubernetes":
        from kubernetes import config

        try:
            config.load_incluster_config()
        except config.ConfigException:
            try:
                config.load_kube_config()
            except Exception as exc:  # noqa: BLE001 - ConfigException, or a kubeconfig that does not parse
                why = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
                raise UserError(MODE_VAR, chosen, f"no Kubernetes configuration here ({why})",
                                "point KUBECONFIG at the cluster's config, or unset POSTTRAIN_EXECUTION to run the "
                                "stages in this process") from None
    elif chosen == "docker":
        given = os.environ.get("DOCKER_HOST") or ""
        url = given or "unix:///var/run/docker.sock"
        if url.startswith("unix://") and not os.path.exists(url[len("unix://"):]):
            raise UserError("DOCKER_HOST" if given else MODE_VAR, given or chosen,
                            f"no Docker engine socket at {url[len('unix://'):]}",
                            "start the engine (dockerd, or `podman system service`) or point DOCKER_HOST at its socket, "
                            "or unset POSTTRAIN_EXECUTION to run the stages in this process")
        from dags.execution import docker

        if docker.podman_only(docker.container_flags().security_opt):
            version = _engine_version(url)
            if version is not None:
                docker.check_engine(version, url)


def _engine_version(url: str) -> dict[str, Any] | None:
    """The engine's ``/version`` answer; None when it does not answer (an outage: the stage
    tasks retry it)."""
    import docker

    try:
        client = docker.APIClient(base_url=url, version="1.41", timeout=10)
        try:
            return client.version(api_version=False)
        finally:
            client.close()
    except Exception:  # noqa: BLE001 - a socket that does not answer, or an answer that is not an engine's
        return None


IMAGE_PREFIX_VAR, IMAGE_TAG_VAR = "POSTTRAIN_IMAGE_PREFIX", "POSTTRAIN_IMAGE_TAG"
# The image reference grammar of the OCI distribution spec (what docker, podman and the kubelet parse)
_HOST_PART = r"[a-zA-Z0-9](?:[a-zA-Z0-9-]*[a-zA-Z0-9])?"
_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_HOST = re.compile(rf"{_HOST_PART}(?:\.{_HOST_PART})*(?::[0-9]+)?", re.ASCII)
_PATH = re.compile(rf"{_COMPONENT}(?:/{_COMPONENT})*", re.ASCII)
IMAGE_TAG = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}", re.ASCII)


MAX_IMAGE_NAME = 255  # the distribution spec's limit on a repository name, host included


def _image_name(name: str) -> bool:
    """Whether ``name`` is an image name: lowercase path parts, after a registry host when
    the first part holds a '.' or ':' or is ``localhost`` (as docker tells the two apart)."""
    if len(name) > MAX_IMAGE_NAME:
        return False
    host, _, path = name.partition("/")
    if path and ("." in host or ":" in host or host == "localhost"):
        port = host.rpartition(":")[2] if ":" in host else "1"
        return bool(_HOST.fullmatch(host)) and bool(_PATH.fullmatch(path)) and 0 < int(port) <= 65535
    return bool(_PATH.fullmatch(name))


def check_image_tag(var: str, value: str) -> str:
    """``value`` as an image tag; a UserError naming ``var`` otherwise."""
    if not IMAGE_TAG.fullmatch(value):
        raise UserError(var, value, "is not an image tag (ASCII letters, digits, '_', '.' and '-', at most "
                        "128, not starting with '.' or '-')", f"set it to e.g. '{__version__}', or unset it for the "
                        "package version")
    return value


def check_image_prefix(var: str, value: str, stage: str) -> str:
    """The image name ``<value>posttrain-<stage>`` (without its tag); a UserError naming
    ``var`` and the prefix when it is not an image name (lowercase path parts after an
    optional registry host[:port]). Reads no environment: ``pipelines/compile.py`` checks
    its ``--image-prefix`` with it."""
    name = f"{value}posttrain-{stage}"
    if not _image_name(name):
        raise UserError(var, value, f"makes {value_text(name)!r}, which is not an image name (lowercase path parts "
                        f"after an optional registry host[:port], at most {MAX_IMAGE_NAME} characters)",
                        "set it to e.g. 'registry.example.com:5000/ml/' (ending in '/'), or unset it")
    return name


def image_for(stage: str) -> str:
    """The image a stage runs in: ``<prefix>posttrain-<stage>:<tag>``; a UserError naming
    ``POSTTRAIN_IMAGE_PREFIX`` or ``POSTTRAIN_IMAGE_TAG`` when the two do not make an image
    reference (a pod with one fails on the cluster only, as InvalidImageName)."""
    tag = check_image_tag(IMAGE_TAG_VAR, os.environ.get(IMAGE_TAG_VAR) or __version__)
    return f"{check_image_prefix(IMAGE_PREFIX_VAR, os.environ.get(IMAGE_PREFIX_VAR, ''), stage)}:{tag}"


def stage_arguments(plan: dict[str, Any], run_id: str, shard: str = "") -> list[str]:
    """The arguments of ``posttrain stage <id>`` for one task (the shard last, so a mapped
    task's map index can show it)."""
    args = ["--recipe", plan["recipe_uri"], "--run-root", plan["run_root"], "--iteration", str(plan["iteration"]),
            "--orchestrator-run-id", run_id]
    if plan.get("holder"):  # the stage renews the plan's lease on the iteration while it runs
        args += ["--lease-holder", plan["holder"]]
    return [*args, "--shard", shard] if shard else args


def args_task(spec: StageSpec):
    """The argument list(s) of one stage's container task(s): one list, or one per shard."""
    from airflow.sdk import task

    @task(task_id=f"{spec.id}_args")
    def stage_args(plan: dict[str, Any]) -> list[str] | list[list[str]]:
        from airflow.sdk import get_current_context

        run_id = get_current_context()["run_id"]
        if spec.sharded:
            return [stage_arguments(plan, run_id, shard) for shard in plan[f"shards_{spec.id}"]]
        return stage_arguments(plan, run_id)

    return stage_args


def timed_out_error(stage: str, limit):
    """The UserError of a stage task past its ``execution_timeout`` (a ``timedelta`` or
    None): it names the recipe's ``timeouts.<stage>``. The same work would run as long
    again, so such a task fails without a retry (three retries cost four limits)."""
    from components.core.errors import UserError

    seconds = int(limit.total_seconds()) if limit is not None else 0
    return UserError(f"timeouts.{stage}", seconds, "the stage ran past its time limit, and a retry would run as long "
                     "again", f"raise timeouts.{stage} in the recipe (seconds), or give the stage less work")


def fail_timed_out(operator):
    """For a stage container's or pod's operator whose ``execute`` hit its time limit: stop
    what it started (``on_kill``, which Airflow calls only for a timeout it sees itself),
    and the ``AirflowFailException`` naming ``timeouts.<stage>``, its error first added to
    ``dags.wiring.FINAL_ERRORS`` as ``fail_now`` does."""
    from airflow.sdk.exceptions import AirflowFailException

    from dags import wiring

    operator.on_kill()
    error = timed_out_error(operator.task_id, operator.execution_timeout)
    wiring.FINAL_ERRORS.append(error)
    return AirflowFailException(error.line())


def interruption(exc: BaseException | None) -> BaseException | None:
    """The time limit (``AirflowTaskTimeout``) or stop (``tracking.Terminated``: SIGTERM,
    Ctrl-C, a lost writer lease) behind ``exc``: ``exc`` itself, or one it was raised while
    handling (``__cause__``, ``__context__``), e.g. an engine's error in the provider's own
    cleanup after the limit struck, which replaced it; None for any other failure."""
    from airflow.sdk.exceptions import AirflowTaskTimeout

    from components.core.tracking import Terminated

    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, (AirflowTaskTimeout, Terminated)):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


def stopped(operator, cause: BaseException):
    """For a stage container's or pod's operator whose ``execute`` was cut short by
    ``cause`` (``interruption``): past its time limit, ``fail_timed_out``; told to stop,
    ``on_kill`` (stop what it started, as the in-process stage ends where the signal
    lands) and ``AirflowTaskTerminated`` (no retry), as ``dags.wiring.run_stage_task``
    raises: ``posttrain run`` then ends with "stopped by SIGTERM" and exit 143 (130 for
    Ctrl-C)."""
    from airflow.sdk.exceptions import AirflowTaskTerminated, AirflowTaskTimeout

    if isinstance(cause, AirflowTaskTimeout):
        return fail_timed_out(operator)
    operator.on_kill()
    return AirflowTaskTerminated(f"{operator.task_id}: {cause}")


def run_stoppably(operator, execute, context):
    """``execute(context)`` (the provider's) as ``posttrain run`` runs an in-process stage:
    within ``runner.stop_signals_raised``, so SIGTERM, Ctrl-C and a lost writer lease (which
    sends SIGTERM) raise inside it, where it waits for its container or pod, instead of being
    only recorded while the stage runs to its end; refused before it starts when the process
    was told to stop already. The stop and the time limit are turned into ``stopped``'s
    exceptions; any other failure is the provider's."""
    from airflow.sdk.exceptions import AirflowTaskTerminated

    from components.core.runner import stop_signals_raised, stopping

    try:
        with stop_signals_raised():
            if stopping():
                raise AirflowTaskTerminated(f"{operator.task_id}: not started, the process was told to stop")
            return execute(context)
    except AirflowTaskTerminated:
        raise
    except BaseException as exc:
        cause = interruption(exc)
        if cause is None:
            raise
        raise stopped(operator, cause) from None


def fail_user_error(error):
    """The ``AirflowFailException`` of a user's mistake a stage's operator finds before it
    starts the stage (``error``, a UserError), added to ``dags.wiring.FINAL_ERRORS`` first:
    ``posttrain run`` ends with its line and exit 2."""
    from airflow.sdk.exceptions import AirflowFailException

    from dags import wiring

    wiring.FINAL_ERRORS.append(error)
    return AirflowFailException(error.line())


def fail_now(status: int, line: str, stage: str, what: str):
    """The ``AirflowFailException`` for a stage container or pod that exited 2 or 3 (no retry
    can help), its error first added to ``dags.wiring.FINAL_ERRORS`` as the in-process path
    adds the stage's own: ``posttrain run`` then ends with that line and exit 2 or 3, not 1."""
    from airflow.sdk.exceptions import AirflowFailException

    from components.core.errors import final_error_from_line
    from dags import wiring

    wiring.FINAL_ERRORS.append(final_error_from_line(status, line, stage))
    return AirflowFailException(f"stage {what} exited {status}: {line}")


def _module(name: str):
    if name == "docker":
        from dags.execution import docker as module
    else:
        from dags.execution import kubernetes as module
    return module


def container_task(spec: StageSpec, planned, airflow_kwargs: dict[str, Any], recipe=None):
    """The stage's operator in a container mode, mapped over shards when it fans out."""
    module = _module(mode())
    cls, kwargs = module.operator(spec, resources(spec.id, recipe))
    field = module.ARGS_FIELD
    arguments = args_task(spec)(planned)
    if spec.sharded:
        return cls.partial(task_id=spec.id, map_index_template="{{ task." + field + "[-1] }}", **airflow_kwargs,
                           **kwargs).expand(**{field: arguments})
    return cls(task_id=spec.id, **airflow_kwargs, **kwargs, **{field: arguments})
