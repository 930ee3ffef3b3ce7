"""The kubernetes execution mode's settings, read from the environment without importing
Airflow (``dags/execution/kubernetes.py`` builds the pods from them; ``posttrain run``
checks them before any work through ``dags.execution.check_settings``). Each bad value is
a UserError naming the variable, the value and the fix. The table of variables is in
``dags/execution/kubernetes.py``. The check of each value (``check_name``,
``check_config_map``, ``check_secret``, ``parse_node_selector``, ``parse_positive_int``)
takes it as an argument with the name to give it in the error, and reads no environment:
the Kubeflow pipeline (``pipelines/``) checks its compile options with the same ones."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from components.core.errors import UserError

NAMESPACE_VAR = "POSTTRAIN_NAMESPACE"
SERVICE_ACCOUNT_VAR = "POSTTRAIN_STAGE_SERVICE_ACCOUNT"
CONFIGMAP_VAR = "POSTTRAIN_STAGE_CONFIGMAP"
RUNTIME_CLASS_VAR = "POSTTRAIN_SANDBOX_RUNTIME_CLASS"
GPU_NODE_SELECTOR_VAR = "POSTTRAIN_GPU_NODE_SELECTOR"
STARTUP_TIMEOUT_VAR = "POSTTRAIN_POD_STARTUP_TIMEOUT_S"
SECRET_VAR = "POSTTRAIN_STAGE_SECRET"
SECRET_DEFAULT = "posttrain-s3"
"""The stage pods' optional secret (``envFrom``, ``optional: true``: a pod starts without
it), as the Kubeflow pipeline's ``posttrain-s3`` (``pipelines/post_training_iteration.py``):
e.g. ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY`` where no IRSA grants the store. Not
in ``DEFAULTS`` (the settings ``infra/terraform`` sets): EKS grants the store through IRSA."""

SCRATCH_MOUNTS = (("scratch-tmp", "/tmp"), ("scratch-home", "/home/posttrain"))
"""(volume, mount path) of a stage pod's scratch space, ``emptyDir`` volumes sized by the
stage's ``scratch``: ``/tmp`` and the images' home (``containers/base.Dockerfile``: HOME,
holding ``POSTTRAIN_HOME``), the only places its container can write besides the store
(its root filesystem is read-only). The DAG's ``kubernetes`` mode and the Kubeflow
pipeline mount the same."""

DEFAULTS = {NAMESPACE_VAR: "posttrain", SERVICE_ACCOUNT_VAR: "posttrain-stage", CONFIGMAP_VAR: "posttrain-stage-env",
            RUNTIME_CLASS_VAR: "", GPU_NODE_SELECTOR_VAR: "posttrain.io/pool=gpu", STARTUP_TIMEOUT_VAR: "600"}


_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
DNS_LABEL = re.compile(rf"^{_LABEL}$")  # namespaces
DNS_SUBDOMAIN = re.compile(rf"^{_LABEL}(\.{_LABEL})*$")  # service accounts, config maps, runtime classes
_QUALIFIED = r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?"
LABEL_KEY = re.compile(rf"^({_LABEL}(\.{_LABEL})*/)?{_QUALIFIED}$")
LABEL_VALUE = re.compile(rf"^({_QUALIFIED})?$")


@dataclass(frozen=True)
class ClusterSettings:
    namespace: str
    service_account: str
    config_map: str
    runtime_class: str  # "" = the cluster's default runtime
    gpu_node_selector: dict[str, str]
    startup_timeout_s: int
    secret: str = SECRET_DEFAULT  # "" = none


def _env(name: str) -> str:
    value = os.environ.get(name)
    return (SECRET_DEFAULT if name == SECRET_VAR else DEFAULTS[name]) if value is None else value.strip()


# The checks of one value each, named after where it came from (``var``: a variable, or a
# compile option of ``pipelines/compile.py``), so the pipeline takes exactly the names the
# DAG does without going through the environment. White space around a value is not part of it.


def empty_fix(var: str) -> str:
    """How to give ``var`` no value: a variable is left unset; a compile option (``--x``),
    whose default is a name, is passed empty."""
    return f" or pass {var} ''" if var.startswith("--") else " or leave it unset"


def check_name(var: str, value: str, pattern: re.Pattern, max_len: int, example: str,
               allow_empty: bool = False) -> str:
    """``value`` as a Kubernetes name matching ``pattern`` (``DNS_LABEL`` or
    ``DNS_SUBDOMAIN``) of at most ``max_len`` characters, or '' where ``allow_empty``; a
    UserError naming ``var``, the value and ``example`` otherwise."""
    value = value.strip()
    if allow_empty and not value:
        return ""
    if len(value) > max_len or not pattern.match(value):
        raise UserError(var, value, f"not a Kubernetes name (at most {max_len} lowercase letters, digits, '-'"
                        f"{'' if pattern is DNS_LABEL else ' and .'})",
                        f"set it to e.g. {example!r}{empty_fix(var) if allow_empty else ''}")
    return value


def check_config_map(var: str, value: str) -> str:
    """The stage pods' config map (``POSTTRAIN_STAGE_CONFIGMAP``): a Kubernetes name, required."""
    return check_name(var, value, DNS_SUBDOMAIN, 253, DEFAULTS[CONFIGMAP_VAR])


def check_secret(var: str, value: str) -> str:
    """The stage pods' optional secret (``POSTTRAIN_STAGE_SECRET``): a Kubernetes name, or '' for none."""
    return check_name(var, value, DNS_SUBDOMAIN, 253, SECRET_DEFAULT, allow_empty=True)


def parse_node_selector(var: str, value: str) -> dict[str, str]:
    """``"key=value[,key=value]"`` (empty: none) as {key: value}; a UserError naming ``var``
    where a pair is not a node label."""
    value = value.strip()
    selector: dict[str, str] = {}
    for pair in filter(None, (p.strip() for p in value.split(","))):
        key, sep, label = pair.partition("=")
        key, label = key.strip(), label.strip()
        if not sep or len(key.split("/")[-1]) > 63 or len(label) > 63 or not LABEL_KEY.match(key) \
                or not LABEL_VALUE.match(label):
            raise UserError(var, value, f"{pair!r} is not a node label 'key=value'",
                            "set it to e.g. 'posttrain.io/pool=gpu' (comma-separated for several), or '' for none")
        selector[key] = label
    return selector


MAX_WAIT_S = 86400  # a pod that has not started in a day will not: a longer wait only hides it


def parse_positive_int(var: str, value: str, example: int) -> int:
    """``value`` as a whole number of seconds from 1 to ``MAX_WAIT_S``; a UserError naming
    ``var`` and ``example`` otherwise."""
    value = value.strip()
    try:
        number = int(value)
    except ValueError:
        number = 0
    if not 1 <= number <= MAX_WAIT_S:
        raise UserError(var, value, f"not a whole number of seconds from 1 to {MAX_WAIT_S} (a day)",
                        f"set it to e.g. '{example}'")
    return number


def cluster_settings() -> ClusterSettings:
    """The deployment's cluster settings from the environment; a UserError naming the variable and the fix."""
    return ClusterSettings(
        namespace=check_name(NAMESPACE_VAR, _env(NAMESPACE_VAR), DNS_LABEL, 63, "posttrain"),
        service_account=check_name(SERVICE_ACCOUNT_VAR, _env(SERVICE_ACCOUNT_VAR), DNS_SUBDOMAIN, 253, "posttrain-stage"),
        config_map=check_config_map(CONFIGMAP_VAR, _env(CONFIGMAP_VAR)),
        runtime_class=check_name(RUNTIME_CLASS_VAR, _env(RUNTIME_CLASS_VAR), DNS_SUBDOMAIN, 253, "gvisor", allow_empty=True),
        gpu_node_selector=parse_node_selector(GPU_NODE_SELECTOR_VAR, _env(GPU_NODE_SELECTOR_VAR)),
        startup_timeout_s=parse_positive_int(STARTUP_TIMEOUT_VAR, _env(STARTUP_TIMEOUT_VAR), 600),
        secret=check_secret(SECRET_VAR, _env(SECRET_VAR)),
    )
