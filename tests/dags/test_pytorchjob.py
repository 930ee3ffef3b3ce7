"""The trainer stage as a Kubeflow PyTorchJob, rendered and validated offline (no cluster, no operator).

Each replica's pod template is validated against the Kubernetes 1.30 API schema by
``kubernetes_validate`` in strict mode, as a ``PodTemplate``'s ``template`` (a
``PodTemplateSpec``); the envelope is checked for the fields the Training Operator's
``kubeflow.org/v1`` CRD requires; the pod is compared field by field with the pod the
DAG's ``kubernetes`` mode gives the trainer. The ``posttrain render pytorchjob`` command
prints the same job and turns bad input into one line and exit status 2.
"""

from __future__ import annotations

from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from components import __version__
from components.cli import main
from components.core.errors import UserError
from components.core.recipe import load_recipe, parse_recipe, publish_recipe
from components.core.stages import resources, spec
from dags.execution import kubernetes as mode
from dags.execution import pytorchjob
from tests.dags.test_kubernetes_mode import (
    DSHM_MOUNT,
    ENV_VARS,
    K8S_VERSION,
    RESTRICTED_CONTAINER,
    SCRATCH_MOUNTS,
    scratch_volumes,
    stage_pod,
)

REPO = Path(__file__).resolve().parents[2]
RUN_ROOT = "s3://bucket/runs"
RECIPE_URI = "s3://bucket/runs/recipes/abc.yaml"


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for name in ENV_VARS:
        monkeypatch.delenv(name, raising=False)


def recipe(scratch: dict | None = None, **trainer):
    return parse_recipe({"pipeline": "pj", "trainer": {"processes": 2, **trainer},
                         "resources": {"trainer": {"gpus": 2, "memory": "64Gi", "cpu": "8", **(scratch or {})}}})


def job(nodes: int = 3, scratch: dict | None = None, **trainer) -> dict:
    return pytorchjob.render(recipe(scratch, **trainer), RECIPE_URI, RUN_ROOT, 4, nodes)


def valid(template: dict) -> str:
    wrapped = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "trainer"}, "template": template}
    return kubernetes_validate.validate(wrapped, K8S_VERSION, strict=True)


def test_the_envelope_has_what_the_crd_requires() -> None:
    j = job(nodes=3)
    assert (j["apiVersion"], j["kind"]) == ("kubeflow.org/v1", "PyTorchJob")
    assert j["metadata"]["name"] == "pj-trainer-4" and j["metadata"]["namespace"] == "posttrain"
    assert j["spec"]["nprocPerNode"] == "2"  # a string in the v1 CRD
    replicas = j["spec"]["pytorchReplicaSpecs"]
    assert [(role, r["replicas"], r["restartPolicy"]) for role, r in replicas.items()] == [
        ("Master", 1, "Never"), ("Worker", 2, "Never")]
    assert j["spec"]["runPolicy"] == {"cleanPodPolicy": "None", "backoffLimit": 0,
                                      "activeDeadlineSeconds": spec("trainer").timeout_s}
    assert list(job(nodes=1)["spec"]["pytorchReplicaSpecs"]) == ["Master"]


def test_every_replica_pod_is_valid_for_the_api() -> None:
    for role, replica in job(nodes=2)["spec"]["pytorchReplicaSpecs"].items():
        assert valid(replica["template"]) == K8S_VERSION, role


def test_the_schema_check_is_real() -> None:
    template = job(nodes=1)["spec"]["pytorchReplicaSpecs"]["Master"]["template"]
    template["spec"]["containers"][0]["securityContext"]["runAsNonroot"] = True  # a typo the API would reject
    with pytest.raises(kubernetes_validate.ValidationError):
        valid(template)


def test_the_pod_is_the_kubernetes_modes_trainer_pod() -> None:
    r = recipe()
    res = resources("trainer", r)
    reference = stage_pod(spec("trainer"), res)
    ref_spec, (ref_container,) = reference["spec"], reference["spec"]["containers"]
    template = job(nodes=2)["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]
    pod, (container,) = template["spec"], template["spec"]["containers"]
    assert container["name"] == "pytorch"
    assert container["image"] == ref_container["image"] == f"posttrain-trainer:{__version__}"
    assert container["args"] == ["--recipe", RECIPE_URI, "--run-root", RUN_ROOT, "--iteration", "4"]
    for key in ("securityContext", "resources", "envFrom", "volumeMounts", "imagePullPolicy"):
        assert container[key] == ref_container[key], key
    assert container["securityContext"] == RESTRICTED_CONTAINER  # readOnlyRootFilesystem too
    assert container["resources"] == {"requests": {"cpu": "8", "memory": "64Gi", "ephemeral-storage": "50Gi"},
                                      "limits": {"memory": "64Gi", "ephemeral-storage": "50Gi", "nvidia.com/gpu": "2"}}
    assert container["volumeMounts"] == [*SCRATCH_MOUNTS, DSHM_MOUNT]
    assert pod["volumes"] == scratch_volumes("50Gi") + [{"name": "dshm", "emptyDir": {"medium": "Memory"}}]
    for key in ("securityContext", "tolerations", "nodeSelector", "volumes", "serviceAccountName",
                "automountServiceAccountToken"):
        assert pod[key] == ref_spec[key], key
    assert pod["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    assert pod["nodeSelector"] == {"posttrain.io/pool": "gpu"} and pod["restartPolicy"] == "Never"
    assert template["metadata"]["labels"]["posttrain.io/stage"] == "trainer"


def test_the_recipes_scratch_reaches_every_replica() -> None:
    """``resources: {trainer: {scratch: 100Gi}}``: torchrun's work folders and the checkpoints
    get 100Gi on every node, bounded by the ephemeral-storage limit; the root stays read-only."""
    for role, replica in job(nodes=2, scratch={"scratch": "100Gi"})["spec"]["pytorchReplicaSpecs"].items():
        pod, (container,) = replica["template"]["spec"], replica["template"]["spec"]["containers"]
        assert container["resources"]["requests"]["ephemeral-storage"] == "100Gi", role
        assert container["resources"]["limits"]["ephemeral-storage"] == "100Gi", role
        assert pod["volumes"][:2] == scratch_volumes("100Gi"), role
        assert container["volumeMounts"][:2] == SCRATCH_MOUNTS, role
        assert container["securityContext"]["readOnlyRootFilesystem"] is True, role
        assert valid(replica["template"]) == K8S_VERSION, role


def test_a_cpu_trainer_gets_no_gpu_and_settings_follow_the_environment(monkeypatch) -> None:
    monkeypatch.setenv(mode.NAMESPACE_VAR, "ml")
    monkeypatch.setenv("POSTTRAIN_IMAGE_PREFIX", "registry.example.com/ml/")
    r = parse_recipe({"pipeline": "cpu", "trainer": {"processes": 4, "device": "cpu"}, "timeouts": {"trainer": 900},
                      "resources": {"trainer": {"gpus": 0}}})
    j = pytorchjob.render(r, RECIPE_URI, RUN_ROOT, 2, 2)
    template = j["spec"]["pytorchReplicaSpecs"]["Master"]["template"]
    (container,) = template["spec"]["containers"]
    assert j["metadata"]["namespace"] == "ml" and j["spec"]["nprocPerNode"] == "4"
    assert j["spec"]["runPolicy"]["activeDeadlineSeconds"] == 900
    assert container["image"] == f"registry.example.com/ml/posttrain-trainer:{__version__}"
    assert "nvidia.com/gpu" not in container["resources"]["limits"]
    assert "tolerations" not in template["spec"] and "nodeSelector" not in template["spec"]
    assert template["spec"]["volumes"] == scratch_volumes("50Gi")  # the scratch space, and no /dev/shm in memory
    assert valid(template) == K8S_VERSION


@pytest.mark.parametrize(("nodes", "iteration", "trainer", "field", "problem"), [
    (0, 4, {}, "--nodes", "a job needs 1 to 4096 nodes"),
    (100_000_000, 4, {}, "--nodes", "a job needs 1 to 4096 nodes"),
    (2, 0, {}, "--iteration", "iterations 1 and up"),
    (2, 10**80, {}, "--iteration", "is more than 999999, the highest iteration a run root numbers"),  # an invalid name before
    (2, 10**6, {}, "--iteration", "is more than 999999, the highest iteration a run root numbers"),  # its pods would fail
    (2, 4, {"processes": 3}, "trainer.processes", "one GPU per process"),
])
def test_bad_input_is_a_user_error(nodes, iteration, trainer, field, problem) -> None:
    with pytest.raises(UserError) as err:
        pytorchjob.render(recipe(**trainer), RECIPE_URI, RUN_ROOT, iteration, nodes)
    assert err.value.field == field and problem in err.value.problem


def test_cuda_without_gpus_and_a_bad_setting_are_user_errors(monkeypatch) -> None:
    r = parse_recipe({"pipeline": "pj", "trainer": {"device": "cuda"}, "resources": {"trainer": {"gpus": 0}}})
    with pytest.raises(UserError) as err:
        pytorchjob.render(r, RECIPE_URI, RUN_ROOT, 1, 1)
    assert err.value.field == "trainer.device" and "no GPU" in err.value.problem
    monkeypatch.setenv(mode.NAMESPACE_VAR, "Bad_Name")
    with pytest.raises(UserError) as bad:
        job()
    assert (bad.value.field, bad.value.value) == (mode.NAMESPACE_VAR, "Bad_Name") and "posttrain" in bad.value.fix


def test_a_local_recipe_is_read_where_publish_puts_it(tmp_path) -> None:
    path = REPO / "recipes" / "tiny.yaml"
    root = tmp_path.as_uri()
    assert pytorchjob.recipe_uri(str(path), root) == publish_recipe(path, root)
    assert pytorchjob.recipe_uri(RECIPE_URI, root) == RECIPE_URI
    assert pytorchjob.job_name("a" * 63, 123) == "a" * 36 + "-trainer-123"


def test_the_command_prints_the_job(tmp_path, capsys) -> None:
    path = REPO / "recipes" / "tiny.yaml"
    root = tmp_path.as_uri()
    code = main(["render", "pytorchjob", "--recipe", str(path), "--run-root", root, "--nodes", "1", "--iteration", "3"])
    out, err = capsys.readouterr()
    uri = pytorchjob.recipe_uri(str(path), root)  # where --publish copies it (the test above)
    assert code == 0 and out.startswith("apiVersion: "), (code, out[:300])
    assert yaml.safe_load(out) == pytorchjob.render(load_recipe(path), uri, root, 3, 1)
    assert f"read the recipe from {uri}" in err and not (tmp_path / "recipes").exists()
    assert main(["render", "pytorchjob", "--recipe", str(path), "--run-root", root, "--nodes", "1", "--iteration", "3",
                 "--publish"]) == 0
    assert (tmp_path / uri.split(root + "/", 1)[1]).read_text() == path.read_text()
    assert main(["render", "pytorchjob", "--recipe", str(path), "--run-root", root, "--nodes", "0", "--iteration", "3"]) == 2
    assert capsys.readouterr().err.strip().endswith("--nodes=0: a job needs 1 to 4096 nodes; fix: pass --nodes from 1 to 4096")


def test_publish_to_a_store_that_is_down_or_refuses_is_one_line(tmp_path, capsys, monkeypatch) -> None:
    """``--publish`` checks the store first: an S3 endpoint nobody answers on is an outage
    (exit 1), a run root under a regular file a refusal naming --run-root (exit 2); before,
    botocore's or fsspec's traceback."""
    import socket

    path = REPO / "recipes" / "tiny.yaml"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "k")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s")
    args = ["render", "pytorchjob", "--recipe", str(path), "--nodes", "2", "--iteration", "1", "--publish"]
    assert main([*args, "--run-root", "s3://no-such-bucket/runs"]) == 1
    out, err = capsys.readouterr()
    assert out.strip() == "" and err.strip().splitlines()[-1].startswith(  # no YAML (a library may indent a log line)
        "posttrain: unreachable: store unreachable at 's3://no-such-bucket/runs': EndpointConnectionError")
    (tmp_path / "file").write_text("x")
    args[args.index("--nodes") + 1] = "1"  # more nodes refuse a local run root before it is probed (the test below)
    assert main([*args, "--run-root", str(tmp_path / "file" / "root")]) == 2
    out, err = capsys.readouterr()
    assert out.strip() == "" and err.strip().splitlines()[-1].startswith(
        f"posttrain: error: --run-root='file://{tmp_path}/file/root': store is not reachable or not writable")


def test_several_nodes_refuse_a_local_run_root(tmp_path, capsys) -> None:
    """Each node's pod has a file system of its own: the job rendered (exit 0) and its
    replicas could not share the run root. Refused as the docker mode refuses one, before
    anything is published; an s3:// run root passes."""
    path = REPO / "recipes" / "tiny.yaml"
    args = ["render", "pytorchjob", "--recipe", str(path), "--nodes", "2", "--iteration", "3"]
    assert main([*args, "--run-root", str(tmp_path / "rr"), "--publish"]) == 2
    out, err = capsys.readouterr()
    assert (out, err) == ("", f"posttrain: error: --run-root='file://{tmp_path}/rr': the 2 nodes' pods each have a file "
                              "system of their own, so the trainer's replicas on them cannot share a local run root; "
                              "fix: give an s3:// run root (POSTTRAIN_RUN_ROOT or --run-root), or render the job with "
                              "--nodes 1\n")
    assert list(tmp_path.iterdir()) == []  # nothing published
    assert main([*args, "--run-root", "s3://bucket/runs"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] == 1


def test_the_largest_iteration_still_makes_a_valid_job() -> None:
    job = pytorchjob.render(recipe(), RECIPE_URI, RUN_ROOT, pytorchjob.MAX_ITERATION, 2)
    assert job["metadata"]["name"].endswith("-trainer-999999") and len(job["metadata"]["name"]) <= pytorchjob.MAX_NAME
    assert job["metadata"]["labels"]["posttrain.io/iteration"] == "999999"


def test_publish_to_an_unreachable_store_is_one_line(tmp_path) -> None:
    """Before, aiobotocore's "[info] Found credentials in environment variables." came
    first: two lines on stderr where the CLI promises one."""
    from tests.fixtures.home import TINY_RECIPE
    from tests.fixtures.runs import cli_env, run_posttrain

    env = cli_env(tmp_path / "home", AWS_ENDPOINT_URL="http://127.0.0.1:1", AWS_ACCESS_KEY_ID="x",
                  AWS_SECRET_ACCESS_KEY="y")
    proc = run_posttrain(["render", "pytorchjob", "--recipe", str(TINY_RECIPE), "--nodes", "1", "--iteration", "1",
                          "--run-root", "s3://bucket/x", "--publish"], tmp_path, env, timeout=300)
    assert proc.returncode == 1
    assert len(proc.stderr.splitlines()) == 1
    assert proc.stderr.startswith("posttrain: unreachable: store unreachable at 's3://bucket/x'")


@pytest.mark.parametrize(("var", "value", "problem"), [
    ("POSTTRAIN_IMAGE_TAG", "a b:c\n", "is not an image tag"),
    ("POSTTRAIN_IMAGE_TAG", "-rc1", "is not an image tag"),
    ("POSTTRAIN_IMAGE_TAG", "v" * 129, "is not an image tag"),
    ("POSTTRAIN_IMAGE_PREFIX", "UPPER/", "makes 'UPPER/posttrain-trainer', which is not an image name"),
    ("POSTTRAIN_IMAGE_PREFIX", "reg/;rm -rf /", "which is not an image name"),
    ("POSTTRAIN_IMAGE_PREFIX", "reg:port/", "which is not an image name"),
    ("POSTTRAIN_IMAGE_PREFIX", "Team/", "which is not an image name"),
    ("POSTTRAIN_IMAGE_PREFIX", "reg.io:99999999/", "which is not an image name"),  # no port is past 65535
    ("POSTTRAIN_IMAGE_PREFIX", "reg.io:0/", "which is not an image name"),
    ("POSTTRAIN_IMAGE_PREFIX", "a" * 100_000 + "/", "makes 'aaaa"),  # past 255 characters; the name shown is cut short
])
def test_an_image_prefix_or_tag_that_makes_no_image_reference_is_named(monkeypatch, var, value, problem) -> None:
    """They went into the manifest as they were (``image: UPPER/;rm -rf /posttrain-trainer:0.1.0``):
    the pods failed on the cluster only, as InvalidImageName."""
    from components.core.errors import UserError
    from dags.execution import check_settings

    monkeypatch.setenv(var, value)
    with pytest.raises(UserError) as err:
        pytorchjob.render(parse_recipe({"pipeline": "p"}), RECIPE_URI, RUN_ROOT, 2, 2)
    assert err.value.field == var and err.value.value == value and problem in err.value.problem
    monkeypatch.setenv("POSTTRAIN_EXECUTION", "kubernetes")
    with pytest.raises(UserError, match=var):
        check_settings()


@pytest.mark.parametrize(("prefix", "tag"), [("", "0.1.0"), ("localhost:5000/", "latest"), ("ghcr.io/org/team/", "v1_2"),
                                             ("123456789012.dkr.ecr.us-east-1.amazonaws.com/ml/", "2026.1"),
                                             ("my-reg.example.com/a__b/c.d/", "X"), ("team-", "1")])
def test_image_references_of_every_usual_registry_are_taken(monkeypatch, prefix, tag) -> None:
    from dags.execution import image_for

    monkeypatch.setenv("POSTTRAIN_IMAGE_PREFIX", prefix)
    monkeypatch.setenv("POSTTRAIN_IMAGE_TAG", tag)
    assert image_for("trainer") == f"{prefix}posttrain-trainer:{tag}"
