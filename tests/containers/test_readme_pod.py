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
        "procMount": "Unmasked", "allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}
    assert "readinessProbe" not in stage
