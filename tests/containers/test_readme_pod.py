"""The Kubernetes pod spec that containers/README.md gives for the sandbox stage applies:
it validates in strict mode against the API version the project's kubernetes client
speaks, runs to completion (``restartPolicy: Never``) and checks the sandbox before the
stage starts. Not covered: whether a given cluster's nodes allow what it asks for
(``hostUsers: false``, ``procMount: Unmasked``)."""

from __future__ import annotations

import re
from pathlib import Path

import kubernetes_validate
import yaml

README = Path(__file__).resolve().parents[2] / "containers" / "README.md"
K8S_VERSION = "1.30"


def _pod() -> dict:
    block = re.search(r"```yaml\n(apiVersion: v1\nkind: Pod\n.*?)```", README.read_text(), re.S)
    assert block, "containers/README.md has no Pod example"
    return yaml.safe_load(block.group(1))


def test_the_readme_pod_validates_and_runs_once() -> None:
    pod = _pod()
    assert kubernetes_validate.validate(pod, K8S_VERSION, strict=True) == K8S_VERSION
    spec = pod["spec"]
    assert spec["restartPolicy"] == "Never"
    assert [c["command"][-3:] for c in spec["initContainers"]] == [["posttrain", "sandbox", "doctor"]]
    stage = spec["containers"][0]
    assert stage["securityContext"] == spec["initContainers"][0]["securityContext"] == {
        "procMount": "Unmasked", "allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]},
        "readOnlyRootFilesystem": True}
    # the scratch space the DAG's pods get (dags/execution/kubernetes.py), sized as the sandbox stage's
    from components.core.stages import resources
    from dags.execution.cluster import SCRATCH_MOUNTS

    scratch = resources("sandbox").scratch
    assert [(m["name"], m["mountPath"]) for m in stage["volumeMounts"]] == list(SCRATCH_MOUNTS)
    assert {v["name"]: v["emptyDir"]["sizeLimit"] for v in spec["volumes"]} == {n: scratch for n, _ in SCRATCH_MOUNTS}
    assert stage["resources"] == {"requests": {"ephemeral-storage": scratch}, "limits": {"ephemeral-storage": scratch}}
    assert "readinessProbe" not in stage
