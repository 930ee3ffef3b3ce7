"""The kubernetes execution mode's settings, read from the environment without importing
Airflow (``dags/execution/kubernetes.py`` builds the pods from them; ``posttrain run``
checks them before any work through ``dags.execution.check_settings``). Each bad value is
a UserError naming the variable, the value and the fix. The table of variables is in
``dags/execution/kubernetes.py``."""

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


def _name(var: str, pattern: re.Pattern, max_len: int, example: str, allow_empty: bool = False) -> str:
    value = _env(var)
    if allow_empty and not value:
        return ""
    if len(value) > max_len or not pattern.match(value):
        raise UserError(var, value, f"not a Kubernetes name (at most {max_len} lowercase letters, digits, '-'"
                        f"{'' if pattern is DNS_LABEL else ' and .'})",
                        f"set it to e.g. {example!r}{' or leave it unset' if allow_empty else ''}")
    return value


def _node_selector(var: str) -> dict[str, str]:
    value = _env(var)
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


def _positive_int(var: str, example: int) -> int:
    value = _env(var)
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
        namespace=_name(NAMESPACE_VAR, DNS_LABEL, 63, "posttrain"),
        service_account=_name(SERVICE_ACCOUNT_VAR, DNS_SUBDOMAIN, 253, "posttrain-stage"),
        config_map=_name(CONFIGMAP_VAR, DNS_SUBDOMAIN, 253, "posttrain-stage-env"),
        runtime_class=_name(RUNTIME_CLASS_VAR, DNS_SUBDOMAIN, 253, "gvisor", allow_empty=True),
        gpu_node_selector=_node_selector(GPU_NODE_SELECTOR_VAR),
        startup_timeout_s=_positive_int(STARTUP_TIMEOUT_VAR, 600),
        secret=_name(SECRET_VAR, DNS_SUBDOMAIN, 253, SECRET_DEFAULT, allow_empty=True),
    )
