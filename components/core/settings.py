"""Run settings that come from the deployment, not the recipe: one module for the CLI,
the Airflow DAG and the Kubeflow pipeline.

| variable | meaning | default |
|---|---|---|
| ``POSTTRAIN_HOME`` | local home: embedded MLflow database, Airflow home | ``./.posttrain``, made absolute |
| ``POSTTRAIN_RUN_ROOT`` | store URI every stage reads and writes | ``<home>/store`` |
| ``POSTTRAIN_RECIPE`` | recipe YAML | ``recipes/demo.yaml`` of this checkout |
| ``POSTTRAIN_SCHEDULE`` | when the DAG runs (see ``dags/wiring.py``) | manual |
| ``POSTTRAIN_EXECUTION`` | where the DAG's stage tasks run (see ``dags/execution/``) | ``inprocess`` |
| ``POSTTRAIN_IMAGE`` | set by the images: refuse a local default run root | unset |
| ``POSTTRAIN_VLLM_PYTHON`` | a separate vLLM environment's interpreter (``vllm`` engine) | ``.venv-vllm/bin/python`` here, if any |
| ``POSTTRAIN_VLLM_START_TIMEOUT_S`` | seconds that vLLM's server may take to answer ``/v1/models`` | ``600`` |
| ``POSTTRAIN_TORCH_THREADS`` | torch intra-op threads: 1-512, or ``auto`` (every CPU this process has) | ``auto`` in ``posttrain run``, else 1 |
| ``POSTTRAIN_RETRY_DELAY_S`` | seconds before a failed stage task is retried (doubling, up to 10 minutes) | ``10`` |
| ``POSTTRAIN_GC`` | ``default``: Python's own collector, not ``components/core/gcpolicy.py``'s | the policy |
| ``POSTTRAIN_STAGE_HOST`` | ``0``: ``posttrain run`` runs its stages in its own process (``dags/stagehost.py``) | ``1`` |

An explicit value (a CLI flag, a DAG run param) overrides the environment; empty means
"not given". Every default is absolute, so a worker whose working directory differs
from the scheduler's resolves the same paths. Not covered: secrets (credentials come
from the usual AWS/MLflow variables).
"""

from __future__ import annotations

import errno
import math
import os
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from components.core.errors import UserError
from components.core.storage import local_path, make_folders, normalize_uri, scheme, unusable_text

CHECKOUT = Path(__file__).resolve().parents[2]
DEFAULT_RECIPE = str(CHECKOUT / "recipes" / "demo.yaml")


HOME_FIX = "point POSTTRAIN_HOME at a local folder, e.g. /var/lib/posttrain (default: ./.posttrain)"


def home() -> Path:
    """``POSTTRAIN_HOME`` (default ``./.posttrain``), ``~`` expanded, absolute and resolved;
    a UserError when its text cannot name a local folder: ``storage.unusable_text``,
    white space around it or nothing but white space (a folder named " " in the working
    folder), a URI (the home is local: MLflow's database and locks live there), ``~user``
    of no such user, a symbolic-link loop."""
    raw = os.environ.get("POSTTRAIN_HOME") or ".posttrain"
    if (problem := unusable_text(raw)) is not None:
        raise UserError("POSTTRAIN_HOME", raw, *problem)
    if raw != raw.strip():
        raise UserError("POSTTRAIN_HOME", raw, "has white space around it" if raw.strip() else "is only white space",
                        "remove the spaces around the path" if raw.strip() else HOME_FIX)
    if scheme(raw):
        raise UserError("POSTTRAIN_HOME", raw, "is a URI, but the home is a local folder (MLflow's database, locks)",
                        HOME_FIX + "; the run root can be a URI (POSTTRAIN_RUN_ROOT)")
    return local_path(raw, "POSTTRAIN_HOME")


def _home_error(path: Path, exc: OSError) -> UserError:
    return UserError("POSTTRAIN_HOME", str(path), f"cannot be a folder ({exc.strerror or type(exc).__name__})",
                     "point POSTTRAIN_HOME at a folder this user can write (default: ./.posttrain)")


def made_home() -> Path:
    """``home()``, created if missing; a path that cannot be a folder (a file, ``/dev/null``,
    under ``/proc``, no permission) is a UserError naming ``POSTTRAIN_HOME``, and leaves
    none of the parents it made behind. Call it where work starts, not before the recipe
    is read: a refused command leaves no home behind (``check_home`` checks without making)."""
    path = home()
    try:
        make_folders(path)
    except OSError as exc:
        raise _home_error(path, exc) from None
    return path


def check_home() -> Path:
    """``home()``, if ``made_home`` could make it, without making anything: the same
    UserError otherwise. It exists and is a folder, or the nearest folder above it that
    exists takes a new folder (probed with a uniquely named one, removed at once, so no
    other process's home is ever touched)."""
    path = home()
    try:
        if path.exists():
            if not path.is_dir():
                raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(path))
            return path
        above, missing = path.parent, [path.name]
        while not above.exists() and above != above.parent:
            above, missing = above.parent, [above.name, *missing]
        if not above.is_dir():
            raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(above))
        try:
            longest = os.pathconf(above, "PC_NAME_MAX")
        except (OSError, ValueError):  # a filesystem that does not say: the usual limit
            longest = 255
        if any(len(os.fsencode(name)) > longest for name in missing):
            raise OSError(errno.ENAMETOOLONG, os.strerror(errno.ENAMETOOLONG), str(path))
        probe = above / f".posttrain-probe-{uuid.uuid4().hex}"
        probe.mkdir()
        probe.rmdir()
    except OSError as exc:
        raise _home_error(path, exc) from None
    return path


FLAG_VARIABLES = {"--recipe": ("recipe", "POSTTRAIN_RECIPE"), "--run-root": ("run_root", "POSTTRAIN_RUN_ROOT")}
"""The flags whose value may come from the environment instead: flag -> (its argument and
run parameter name, the variable), for an error to name what the value came from."""


def env_text(name: str) -> str:
    """The setting ``name`` from the environment: "" when unset or empty (not given); a
    UserError for a value with white space around it, or only white space, which was
    stripped, or taken as unset, without a word."""
    from components.core.errors import UserError

    raw = os.environ.get(name, "")
    if raw != raw.strip():
        raise UserError(name, raw, "has white space around it" if raw.strip() else "is only white space",
                        "remove the spaces around it" if raw.strip() else "set a value, or unset it for the default")
    return raw


def default_run_root() -> str:
    return env_text("POSTTRAIN_RUN_ROOT") or str(home() / "store")


def default_recipe() -> str:
    return env_text("POSTTRAIN_RECIPE") or DEFAULT_RECIPE


@dataclass(frozen=True)
class RunSettings:
    recipe: str  # absolute path of the recipe file, or its store URI
    run_root: str  # normalised store URI


def vllm_python() -> str:
    """The interpreter of a separate vLLM environment, or "" when none is set or installed
    (an explicit ``POSTTRAIN_VLLM_PYTHON`` is returned as given, existing or not)."""
    given = os.environ.get("POSTTRAIN_VLLM_PYTHON")
    if given:
        return given
    default = CHECKOUT / ".venv-vllm" / "bin" / "python"
    return str(default) if default.exists() else ""


def check_vllm_python(python: str) -> None:
    """A UserError naming ``POSTTRAIN_VLLM_PYTHON`` when no interpreter is at ``python``."""
    try:
        there = Path(python).is_file()
    except (OSError, ValueError):  # a name past the filesystem's limit, a NUL
        there = False
    if not there:
        raise UserError("POSTTRAIN_VLLM_PYTHON", python, "no interpreter there",
                        "run `make vllm` (creates .venv-vllm) or point POSTTRAIN_VLLM_PYTHON at a Python with vllm")


def check_vllm() -> None:
    """The vLLM engine's settings (``rollout.engine: vllm``), for a run to check before any
    work: the rollout stage reads them only when it starts its server, after bootstrap.
    Whether the interpreter has vllm is the server's own probe (it takes seconds)."""
    vllm_start_timeout_s()
    if given := os.environ.get("POSTTRAIN_VLLM_PYTHON"):
        check_vllm_python(given)


MAX_VLLM_START_TIMEOUT_S = 86400.0
MIN_VLLM_START_TIMEOUT_S = 1.0  # a vLLM server takes seconds to start: less never waits long enough


def vllm_start_timeout_s() -> float:
    """``POSTTRAIN_VLLM_START_TIMEOUT_S``: seconds from 1 up to a day (default 600); a
    UserError otherwise (NaN, inf and 1e400 would wait for ever)."""
    raw = env_text("POSTTRAIN_VLLM_START_TIMEOUT_S") or "600"  # float() would strip white space
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (MIN_VLLM_START_TIMEOUT_S <= value <= MAX_VLLM_START_TIMEOUT_S):  # also NaN
        raise UserError("POSTTRAIN_VLLM_START_TIMEOUT_S", raw,
                        f"not a number of seconds from {MIN_VLLM_START_TIMEOUT_S:g} to {MAX_VLLM_START_TIMEOUT_S:g}",
                        "export POSTTRAIN_VLLM_START_TIMEOUT_S=600 (or unset it)")
    return value


MAX_TORCH_THREADS = 512
"""The most intra-op threads a count may ask for: libgomp aborts the process when it
cannot create the threads (100,000 does, here)."""


def gc_policy() -> bool:
    """Whether ``POSTTRAIN_GC`` leaves posttrain's collector policy on (unset, or
    ``posttrain``) or turns it off (``default``: Python's own collector); any other value is
    a UserError (a typo would otherwise leave the policy on unnoticed)."""
    from components.core.errors import UserError

    value = env_text("POSTTRAIN_GC").lower()
    if value in ("", "posttrain"):
        return True
    if value == "default":
        return False
    raise UserError("POSTTRAIN_GC", os.environ["POSTTRAIN_GC"], "unknown collector policy",
                    "set it to 'default' for Python's own collector, or unset it")


def torch_threads(default: str = "1") -> int:
    """``POSTTRAIN_TORCH_THREADS`` as a thread count (``auto``: the CPUs in this process's
    affinity mask). ``posttrain run`` defaults it to ``auto``: its stages run one after the
    other in one process, so a stage has the machine to itself (the trainer steps about
    1.5x faster on 2 cores than on one, `benchmarks/results/iteration_baseline.md`). Every
    other entry defaults to 1: under a scheduler, shards and tasks share the cores, and
    torch's OpenMP workers spin-wait, so an oversubscribed core slows a step several
    times over. Not covered: a CPU quota (a container's ``cpu.max``) narrower than the
    affinity mask: ``auto`` counts the mask; give such a pod its count. ``default``: the
    value when the variable is unset or empty."""
    raw = env_text("POSTTRAIN_TORCH_THREADS") or default  # int() would strip white space
    if raw.lower() == "auto":
        return max(1, len(os.sched_getaffinity(0)))
    try:
        count = int(raw) if raw.isascii() else 0  # int() reads other scripts' digits too ('٣' is 3)
    except ValueError:
        count = 0
    if not 1 <= count <= MAX_TORCH_THREADS:
        raise UserError("POSTTRAIN_TORCH_THREADS", raw, f"not a thread count from 1 to {MAX_TORCH_THREADS} or 'auto'",
                        "export POSTTRAIN_TORCH_THREADS=auto (or 1, 2, ...), or unset it")
    return count


def in_image() -> bool:
    return bool(os.environ.get("POSTTRAIN_IMAGE"))


def _check_image_run_root(run_root: str | None) -> None:
    """Inside an image the working directory is the read-only install and a container's
    files vanish with it: the run root must be named, and be a store URI or an absolute
    (mounted) folder."""
    given = run_root or env_text("POSTTRAIN_RUN_ROOT")
    if not given:
        raise UserError("--run-root", "(unset)", "inside an image the run root must be given, not defaulted to a local folder",
                        "pass --run-root s3://bucket/prefix (or set POSTTRAIN_RUN_ROOT), or an absolute path to a mounted volume")
    if "://" not in given:
        local_path(given, "--run-root")  # a NUL, ~user of no such user: one line, not a traceback
        if not Path(given).expanduser().is_absolute():
            raise UserError("--run-root", given, "a relative run root inside an image lands in the image's read-only install",
                            "pass an s3:// URI or an absolute path to a mounted volume")


RUN_PARAMS = ("recipe", "run_root", "holder")
"""What a user may set on an orchestrator's run (an Airflow DAG run's conf, a Kubeflow run's arguments)."""
MAX_HOLDER = 4096 + len("local:")


def check_run_params(params: dict[str, Any], given: Iterable[str] = ()) -> None:
    """A UserError for run parameters an orchestrator's run cannot use, before it plans:
    a key of ``given`` (the conf the user sent) that is not in ``RUN_PARAMS`` (a typo ran
    the default recipe), a ``recipe`` or ``run_root`` that is a relative path (each
    worker, and the DAG's failure callback, would resolve it against its own working
    folder) or holds a control character, and a ``holder`` that is not the
    ``local:<home>`` that ``posttrain run`` and ``posttrain kfp-local`` pass (a run
    given a holder keeps its lease when it fails, for that command to resume: a hand-typed
    one blocked the pipeline for the lease's 6 hours, and one over 64 KiB wrote a lease
    no one could read back). Only the holder's form is checked here: the DAG's plan also
    refuses one whose ``posttrain run`` does not drive it from that very process
    (``dags.wiring.posttrain_run_holder``)."""
    for key in given:
        if key not in RUN_PARAMS:
            raise UserError("params", key, "is not a parameter of this pipeline",
                            f"use {', '.join(RUN_PARAMS)} (each may be left out for its default)")
    for name in ("recipe", "run_root"):
        value = params.get(name) or ""
        if not value:
            continue
        if (problem := unusable_text(value)) is not None:
            raise UserError(name, value, *problem)
        if value != value.strip():
            raise UserError(name, value, "has white space around it", "remove the spaces and newlines around it")
        if not scheme(value) and not value.startswith("/"):
            raise UserError(name, value, "is a relative path, which each worker would resolve against its own "
                            "working folder", "pass an absolute path or a URI (file:///..., s3://bucket/prefix)")
    holder = params.get("holder") or ""
    if holder and not (isinstance(holder, str) and holder.startswith("local:/") and len(holder) <= MAX_HOLDER
                       and unusable_text(holder) is None):
        raise UserError("holder", holder, "is set by posttrain run and posttrain kfp-local only (local:<their home>)",
                        "leave holder empty: the run then holds its own lease and hands it back if it fails")


def resolve(recipe: str | None = None, run_root: str | None = None) -> RunSettings:
    """Explicit values win, then the environment, then the absolute defaults. A recipe
    may be a store URI (``s3://.../recipes/<digest>.yaml``), kept as it is."""
    if in_image():
        _check_image_run_root(run_root)
    chosen = recipe or default_recipe()
    if chosen.startswith("file:") and "://" not in chosen:  # file:/abs/r.yaml, as a run root may be written
        chosen = normalize_uri(chosen, "--recipe")
    recipe_path = chosen if "://" in chosen else str(local_path(chosen, "--recipe"))
    if not (run_root or env_text("POSTTRAIN_RUN_ROOT")):
        check_home()  # the default run root is in the home: a bad POSTTRAIN_HOME is named as such (made when work starts)
    else:
        home()  # its text at least, before the run root is made: the embedded MLflow database lives there
    root = normalize_uri(run_root or default_run_root(), "--run-root")
    if root == "file:///":  # the pipeline's folders would be made at the top of the file system
        raise UserError("--run-root", run_root or root, "is the file system's root folder",
                        "pass a folder of its own, such as /srv/posttrain/runs")
    if "'" in root and '"' in root:  # MLflow's search, which finds a run root's runs by tag, quotes with one or the other
        raise UserError("--run-root", run_root or root, "holds both ' and \" (MLflow's search cannot match a tag "
                        "value with both)", "use a run root without one of the two quote characters")
    return RunSettings(recipe=recipe_path, run_root=root)
