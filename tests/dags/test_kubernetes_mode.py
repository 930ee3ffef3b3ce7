"""POSTTRAIN_EXECUTION=kubernetes: the pod of every stage, rendered offline and checked.

    pytest tests/dags/test_kubernetes_mode.py

Each stage's ``KubernetesPodOperator`` (``dags/execution/kubernetes.py``) renders its pod
through the operator's own ``build_pod_request_obj`` (no cluster: the hook is told it is
not in one), and the pod is validated against the Kubernetes 1.30 API schema (the
kubernetes client 30's) by ``kubernetes_validate`` in strict mode (no unknown fields),
then checked field by field against the stage registry. First ``operator()`` on its
own, then the real DAG file parsed with ``POSTTRAIN_EXECUTION=kubernetes``: every stage
task (mapped ones expanded per shard) renders a valid pod, and the DAG serializes as the
DAG processor stores it. Not covered: admission (Pod Security, the feature gates
``hostUsers``/``procMount`` need) and a real scheduler; the cluster part is in
``infra/terraform/README.md``.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import SimpleNamespace

import kubernetes_validate
import pytest
from kubernetes.client import ApiClient
from kubernetes.client import models as k8s

from components import __version__
from components.core.errors import UserError
from components.core.stages import Resources, StageSpec, registered, resources
from dags.execution import kubernetes as mode

REPO = Path(__file__).resolve().parents[2]
K8S_VERSION = "1.30"  # the API the kubernetes client 30 speaks
ENV_VARS = (mode.NAMESPACE_VAR, mode.SERVICE_ACCOUNT_VAR, mode.CONFIGMAP_VAR, mode.RUNTIME_CLASS_VAR,
            mode.GPU_NODE_SELECTOR_VAR, mode.STARTUP_TIMEOUT_VAR, mode.SECRET_VAR, "POSTTRAIN_IMAGE_PREFIX",
            "POSTTRAIN_IMAGE_TAG")
STAGE_SECRET = {"secretRef": {"name": "posttrain-s3", "optional": True}}
SANDBOX_CONTAINER = {"runAsNonRoot": True, "runAsUser": 10001, "runAsGroup": 10001, "allowPrivilegeEscalation": False,
                     "privileged": False, "readOnlyRootFilesystem": True, "capabilities": {"drop": ["ALL"]},
                     "seccompProfile": {"type": "Unconfined"}, "appArmorProfile": {"type": "Unconfined"},
                     "procMount": "Unmasked"}
RESTRICTED_CONTAINER = {"runAsNonRoot": True, "runAsUser": 10001, "runAsGroup": 10001, "allowPrivilegeEscalation": False,
                        "privileged": False, "readOnlyRootFilesystem": True, "capabilities": {"drop": ["ALL"]},
                        "seccompProfile": {"type": "RuntimeDefault"}}
SCRATCH_MOUNTS = [{"mountPath": "/tmp", "name": "scratch-tmp"}, {"mountPath": "/home/posttrain", "name": "scratch-home"}]
DSHM_MOUNT = {"mountPath": "/dev/shm", "name": "dshm"}


def scratch_volumes(size: str) -> list[dict]:
    return [{"name": "scratch-tmp", "emptyDir": {"sizeLimit": size}}, {"name": "scratch-home", "emptyDir": {"sizeLimit": size}}]


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for name in ENV_VARS:
        monkeypatch.delenv(name, raising=False)


def _args(spec: StageSpec, shard: str = "0/2") -> list[str]:
    args = ["--recipe", "s3://bucket/store/recipes/abc.yaml", "--run-root", "s3://bucket/store", "--iteration", "3",
            "--orchestrator-run-id", "manual__2026-01-01"]
    return [*args, "--shard", shard] if spec.sharded else args


def render(op, map_index: int = -1) -> dict:
    """The pod ``op`` would create, as the API server receives it (camelCase JSON)."""
    op.hook._is_in_cluster = False  # offline: no kubeconfig, no service-account token to look for
    ti = SimpleNamespace(dag_id="post_training_iteration", task_id=op.task_id, map_index=map_index, try_number=1)
    context = {"ti": ti, "run_id": "manual__2026-01-01", "dag": SimpleNamespace(), "task": op}
    op.render_template_fields(context)
    return ApiClient().sanitize_for_serialization(op.build_pod_request_obj(context))


def stage_pod(spec: StageSpec, res: Resources | None = None) -> dict:
    cls, kwargs = mode.operator(spec, res or resources(spec.id))
    return render(cls(task_id=spec.id, arguments=_args(spec), **kwargs), map_index=0 if spec.sharded else -1)


STAGES = [pytest.param(s, id=s.id) for s in registered()]


@pytest.mark.parametrize("runtime_class", ["", "gvisor"])
@pytest.mark.parametrize("spec", STAGES)
def test_every_stage_pod_is_valid_for_the_api(spec, runtime_class, monkeypatch):
    monkeypatch.setenv(mode.RUNTIME_CLASS_VAR, runtime_class)
    pod = stage_pod(spec)
    assert kubernetes_validate.validate(pod, K8S_VERSION, strict=True) == K8S_VERSION


def test_the_schema_check_is_real():
    pod = stage_pod(registered()[0])
    pod["spec"]["containers"][0]["securityContext"]["procMounts"] = "Unmasked"  # a typo the API would reject
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(pod, K8S_VERSION, strict=True)


@pytest.mark.parametrize("spec", STAGES)
def test_pod_fields_follow_the_registry(spec):
    pod = stage_pod(spec)
    meta, podspec = pod["metadata"], pod["spec"]
    (container,) = podspec["containers"]
    res = resources(spec.id)
    assert meta["namespace"] == "posttrain"
    assert meta["name"].startswith(f"posttrain-{spec.id}-")
    assert meta["labels"]["posttrain.io/stage"] == spec.id
    assert meta["labels"]["app.kubernetes.io/part-of"] == "posttrain"
    assert meta["labels"].get("posttrain.io/shard") == ("0" if spec.sharded else None)
    assert container["image"] == f"posttrain-{spec.id}:{__version__}"
    assert container["command"] == []  # the image's entrypoint, posttrain stage <id>, runs
    assert container["args"] == _args(spec)
    assert podspec["serviceAccountName"] == "posttrain-stage"
    assert podspec["automountServiceAccountToken"] is False
    assert container["envFrom"] == [{"configMapRef": {"name": "posttrain-stage-env"}}, STAGE_SECRET]
    assert podspec["restartPolicy"] == "Never"

    gpu = spec.gpus > 0
    assert container["resources"]["requests"] == {"cpu": res.cpu, "memory": res.memory, "ephemeral-storage": spec.scratch}
    assert container["resources"]["limits"] == {"memory": res.memory, "ephemeral-storage": spec.scratch,
                                                **({"nvidia.com/gpu": str(spec.gpus)} if gpu else {})}
    tolerations = [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}] if gpu else []
    assert podspec.get("tolerations") == tolerations
    assert podspec.get("nodeSelector") == ({"posttrain.io/pool": "gpu"} if gpu else {})
    # the root is read-only: /tmp and the home are node-disk emptyDirs of the stage's scratch size (and /dev/shm in
    # memory on GPU stages, kept beside them)
    assert container["volumeMounts"] == SCRATCH_MOUNTS + ([DSHM_MOUNT] if gpu else [])
    assert podspec["volumes"] == scratch_volumes(spec.scratch) + (
        [{"name": "dshm", "emptyDir": {"medium": "Memory"}}] if gpu else [])

    assert container["securityContext"] == (SANDBOX_CONTAINER if spec.sandboxed else RESTRICTED_CONTAINER)
    assert podspec["securityContext"]["runAsNonRoot"] is True
    assert podspec["securityContext"]["seccompProfile"] == {"type": "Unconfined" if spec.sandboxed else "RuntimeDefault"}
    assert podspec.get("hostUsers") == (False if spec.sandboxed else None)  # procMount Unmasked needs a user namespace
    assert "runtimeClassName" not in podspec


def test_gpu_stages_are_the_registrys():
    """The registry, not this module, says which stages want a GPU or the sandbox's settings."""
    assert {s.id for s in registered() if s.gpus} == {"bootstrap", "rollout", "trainer", "evaluation"}
    assert {s.id for s in registered() if s.sandboxed} == {"bootstrap", "rollout", "sandbox", "evaluation"}


def test_runtime_class_goes_on_sandboxed_pods_only(monkeypatch):
    monkeypatch.setenv(mode.RUNTIME_CLASS_VAR, "gvisor")
    for spec in registered():
        assert stage_pod(spec)["spec"].get("runtimeClassName") == ("gvisor" if spec.sandboxed else None), spec.id


def test_deployment_settings_reach_the_pod(monkeypatch):
    monkeypatch.setenv(mode.NAMESPACE_VAR, "ml-train")
    monkeypatch.setenv(mode.SERVICE_ACCOUNT_VAR, "trainer-sa")
    monkeypatch.setenv(mode.CONFIGMAP_VAR, "stage-env.v2")
    monkeypatch.setenv(mode.GPU_NODE_SELECTOR_VAR, "node.kubernetes.io/instance-type=p5.48xlarge, accel=h100")
    monkeypatch.setenv("POSTTRAIN_IMAGE_PREFIX", "123456789012.dkr.ecr.us-east-1.amazonaws.com/ml/")
    monkeypatch.setenv("POSTTRAIN_IMAGE_TAG", "2026.1")
    pod = stage_pod(next(s for s in registered() if s.id == "trainer"))
    (container,) = pod["spec"]["containers"]
    assert pod["metadata"]["namespace"] == "ml-train"
    assert pod["spec"]["serviceAccountName"] == "trainer-sa"
    assert container["envFrom"] == [{"configMapRef": {"name": "stage-env.v2"}}, STAGE_SECRET]
    assert pod["spec"]["nodeSelector"] == {"node.kubernetes.io/instance-type": "p5.48xlarge", "accel": "h100"}
    assert container["image"] == "123456789012.dkr.ecr.us-east-1.amazonaws.com/ml/posttrain-trainer:2026.1"


@pytest.mark.parametrize("value, env_from", [
    ("stage-creds.v2", [{"configMapRef": {"name": "posttrain-stage-env"}},
                        {"secretRef": {"name": "stage-creds.v2", "optional": True}}]),
    ("", [{"configMapRef": {"name": "posttrain-stage-env"}}])])
def test_the_stage_secret_reaches_every_pod_as_optional_environment(value, env_from, monkeypatch):
    """``POSTTRAIN_STAGE_SECRET`` (default ``posttrain-s3``, as the Kubeflow pipeline's): its
    keys become the stage's environment where the secret exists; a pod starts without it
    (``optional``); empty: none. Before, a stage pod could get only the config map."""
    monkeypatch.setenv(mode.SECRET_VAR, value)
    for spec in registered():
        pod = stage_pod(spec)
        assert kubernetes_validate.validate(pod, K8S_VERSION, strict=True) == K8S_VERSION
        assert pod["spec"]["containers"][0]["envFrom"] == env_from, spec.id


def test_a_bad_stage_secret_is_one_line(monkeypatch):
    monkeypatch.setenv(mode.SECRET_VAR, "Posttrain_S3")
    with pytest.raises(UserError) as error:
        mode.cluster_settings()
    assert error.value.line() == (
        "POSTTRAIN_STAGE_SECRET='Posttrain_S3': not a Kubernetes name (at most 253 lowercase letters, digits, '-' and .); "
        "fix: set it to e.g. 'posttrain-s3' or leave it unset")


def test_an_empty_gpu_node_selector_means_none(monkeypatch):
    monkeypatch.setenv(mode.GPU_NODE_SELECTOR_VAR, "")
    pod = stage_pod(next(s for s in registered() if s.id == "rollout"))
    assert pod["spec"]["nodeSelector"] == {}
    assert pod["spec"]["tolerations"]  # still tolerates the GPU taint


def test_the_recipes_resources_override_the_registrys():
    """``resources(stage, recipe)`` is what the seam passes: a recipe may take the GPU away."""
    trainer = next(s for s in registered() if s.id == "trainer")
    pod = stage_pod(trainer, Resources(cpu="500m", memory="3Gi", gpus=0, scratch="2Gi"))
    (container,) = pod["spec"]["containers"]
    assert container["resources"] == {"requests": {"cpu": "500m", "memory": "3Gi", "ephemeral-storage": "2Gi"},
                                      "limits": {"memory": "3Gi", "ephemeral-storage": "2Gi"}}
    assert pod["spec"]["tolerations"] == [] and pod["spec"]["nodeSelector"] == {}
    assert pod["spec"]["volumes"] == scratch_volumes("2Gi")  # no GPU: no /dev/shm in memory either
    pod = stage_pod(trainer, Resources(cpu="8", memory="64Gi", gpus=4))
    assert pod["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "4"


def test_the_recipes_scratch_resizes_the_pods_scratch_space():
    """``resources: {trainer: {scratch: 100Gi}}``: the ephemeral-storage request and limit and
    both emptyDirs follow it; the GPU's /dev/shm stays."""
    from components.core.recipe import parse_recipe

    trainer = next(s for s in registered() if s.id == "trainer")
    recipe = parse_recipe({"pipeline": "big", "resources": {"trainer": {"scratch": "100Gi"}}})
    pod = stage_pod(trainer, resources("trainer", recipe))
    assert kubernetes_validate.validate(pod, K8S_VERSION, strict=True) == K8S_VERSION
    (container,) = pod["spec"]["containers"]
    assert container["resources"]["requests"]["ephemeral-storage"] == "100Gi"
    assert container["resources"]["limits"]["ephemeral-storage"] == "100Gi"
    assert pod["spec"]["volumes"] == scratch_volumes("100Gi") + [{"name": "dshm", "emptyDir": {"medium": "Memory"}}]
    assert container["volumeMounts"] == [*SCRATCH_MOUNTS, DSHM_MOUNT]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert stage_pod(trainer)["spec"]["volumes"][0] == {"name": "scratch-tmp", "emptyDir": {"sizeLimit": "50Gi"}}


def test_every_stage_has_a_scratch_size_sized_for_what_it_writes():
    """The registry's: the trainer and bootstrap checkpoint models locally, rollout and
    evaluation load them (and vLLM caches), the CPU stages write little."""
    sizes = {s.id: s.scratch for s in registered()}
    assert sizes == {"bootstrap": "50Gi", "taskgen": "4Gi", "rollout": "30Gi", "sandbox": "8Gi", "reward": "4Gi",
                     "validation": "4Gi", "trainer": "50Gi", "evaluation": "30Gi"}
    for stage in sizes:
        assert resources(stage).scratch == sizes[stage]


def test_pod_lifecycle_settings():
    cls, kwargs = mode.operator(registered()[1], resources(registered()[1].id))
    assert mode.ARGS_FIELD == "arguments" and mode.ARGS_FIELD not in kwargs
    op = cls(task_id="taskgen", arguments=["--iteration", "1"], **kwargs)
    assert op.get_logs is True
    assert op.on_finish_action.value == "delete_succeeded_pod"  # a failed pod stays for kubectl describe/logs
    assert op.startup_timeout_seconds == 600
    assert op.deferrable is False


def test_mapped_shards_render_one_pod_each():
    """The seam maps ``arguments`` over shards; each expanded task is one pod with its shard."""
    from airflow.sdk import DAG

    spec = next(s for s in registered() if s.id == "sandbox")
    cls, kwargs = mode.operator(spec, resources(spec.id))
    shards = [_args(spec, f"{i}/3") for i in range(3)]
    with DAG("k8s_mapping_check", schedule=None):
        mapped = cls.partial(task_id=spec.id, pool="posttrain_sandbox", **kwargs).expand(arguments=shards)
    for i, args in enumerate(shards):
        pod = render(mapped.unmap({"arguments": args}), map_index=i)
        kubernetes_validate.validate(pod, K8S_VERSION, strict=True)
        assert pod["spec"]["containers"][0]["args"][-2:] == ["--shard", f"{i}/3"]
        assert pod["metadata"]["labels"]["posttrain.io/shard"] == str(i)
        assert pod["metadata"]["labels"]["map_index"] == str(i)


@pytest.mark.parametrize(("var", "value", "hint"), [
    (mode.STARTUP_TIMEOUT_VAR, "ten", "set it to e.g. '600'"),
    (mode.STARTUP_TIMEOUT_VAR, "0", "whole number of seconds from 1 to 86400"),
    (mode.NAMESPACE_VAR, "Post_Train", "set it to e.g. 'posttrain'"),
    (mode.NAMESPACE_VAR, "a.b", "not a Kubernetes name"),
    (mode.SERVICE_ACCOUNT_VAR, "stage sa", "set it to e.g. 'posttrain-stage'"),
    (mode.CONFIGMAP_VAR, "-env", "set it to e.g. 'posttrain-stage-env'"),
    (mode.RUNTIME_CLASS_VAR, "gVisor", "set it to e.g. 'gvisor' or leave it unset"),
    (mode.GPU_NODE_SELECTOR_VAR, "gpu", "not a node label 'key=value'"),
    (mode.GPU_NODE_SELECTOR_VAR, "pool=a/b", "not a node label 'key=value'"),
])
def test_a_bad_setting_is_one_line_naming_the_variable_and_the_fix(var, value, hint, monkeypatch):
    monkeypatch.setenv(var, value)
    with pytest.raises(UserError) as err:
        mode.operator(registered()[0], resources(registered()[0].id))
    line = err.value.line()
    assert "\n" not in line
    assert line.startswith(f"{var}={value!r}: ")
    assert hint in line


def _parse_dag():
    spec = importlib.util.spec_from_file_location("post_training_iteration_k8s", REPO / "dags" / "post_training_iteration.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.iteration_dag


@pytest.fixture(scope="module")
def k8s_dag():
    """The real DAG file, parsed as the DAG processor would in kubernetes mode."""
    with pytest.MonkeyPatch.context() as mp:
        for name in ENV_VARS:
            mp.delenv(name, raising=False)
        mp.setenv("POSTTRAIN_EXECUTION", "kubernetes")
        mp.setenv("POSTTRAIN_SCHEDULE", "")  # no Airflow Variable lookup
        mp.setenv("POSTTRAIN_IMAGE_PREFIX", "registry.example.com/ml/")
        mp.setenv(mode.RUNTIME_CLASS_VAR, "gvisor")
        yield _parse_dag()


def test_a_bad_setting_fails_the_dag_parse(monkeypatch):
    monkeypatch.setenv("POSTTRAIN_EXECUTION", "kubernetes")
    monkeypatch.setenv("POSTTRAIN_SCHEDULE", "")
    monkeypatch.setenv(mode.STARTUP_TIMEOUT_VAR, "5m")
    with pytest.raises(UserError, match=r"^POSTTRAIN_POD_STARTUP_TIMEOUT_S='5m': not a whole number of seconds from 1 to 86400 \(a day\); "
                                        r"fix: set it to e\.g\. '600'$"):
        _parse_dag()


def test_the_dag_in_kubernetes_mode_runs_every_stage_as_a_pod(k8s_dag):
    from airflow.providers.cncf.kubernetes.operators.pod import KubernetesPodOperator
    from airflow.sdk.definitions.mappedoperator import MappedOperator

    for spec in registered():
        task = k8s_dag.get_task(spec.id)
        if spec.sharded:
            assert isinstance(task, MappedOperator) and issubclass(task.operator_class, KubernetesPodOperator), spec.id
            ops = [(task.unmap({"arguments": _args(spec, f"{i}/2")}), i) for i in range(2)]
        else:
            assert isinstance(task, KubernetesPodOperator), spec.id
            task.arguments = _args(spec)  # at run time: the <stage>_args task's XCom
            ops = [(task, -1)]
        assert k8s_dag.get_task(f"{spec.id}_args").task_id in task.upstream_task_ids
        for op, map_index in ops:
            pod = render(op, map_index)
            assert kubernetes_validate.validate(pod, K8S_VERSION, strict=True) == K8S_VERSION
            podspec = pod["spec"]
            (container,) = podspec["containers"]
            assert container["image"] == f"registry.example.com/ml/posttrain-{spec.id}:{__version__}"
            assert container["args"] == (_args(spec, f"{map_index}/2") if spec.sharded else _args(spec))
            assert ("nvidia.com/gpu" in container["resources"]["limits"]) == (spec.gpus > 0), spec.id
            assert bool(podspec.get("tolerations")) == (spec.gpus > 0), spec.id
            assert container["securityContext"] == (SANDBOX_CONTAINER if spec.sandboxed else RESTRICTED_CONTAINER)
            assert podspec.get("runtimeClassName") == ("gvisor" if spec.sandboxed else None), spec.id
            assert op.pool == (spec.pool or "default_pool"), spec.id
            assert op.retries == 3 and op.execution_timeout.total_seconds() == spec.timeout_s, spec.id
            assert op.on_failure_callback, spec.id
            if spec.sharded:
                assert pod["metadata"]["labels"]["posttrain.io/shard"] == str(map_index)


def test_the_kubernetes_dag_serializes_for_the_scheduler(k8s_dag):
    from airflow.serialization.serialized_objects import DagSerialization

    back = DagSerialization.from_dict(DagSerialization.to_dict(k8s_dag))
    assert sorted(back.task_ids) == sorted(k8s_dag.task_ids)
    for spec in registered():
        task = back.get_task(spec.id)
        assert task.task_type == "StagePod", spec.id
        kwargs = task.partial_kwargs if spec.sharded else vars(task)
        assert kwargs["image"] == f"registry.example.com/ml/posttrain-{spec.id}:{__version__}", spec.id


def _finished_pod(code: int) -> k8s.V1Pod:
    terminated = k8s.V1ContainerStateTerminated(exit_code=code, message="posttrain: error: --recipe='x': no such recipe file")
    status = k8s.V1PodStatus(phase="Failed", container_statuses=[k8s.V1ContainerStatus(
        name="base", image="i", image_id="", ready=False, restart_count=0, state=k8s.V1ContainerState(terminated=terminated))])
    return k8s.V1Pod(metadata=k8s.V1ObjectMeta(name="posttrain-taskgen-x", namespace="posttrain"), status=status)


def _offline(op) -> None:
    """No API server runs here: the provider's own calls to it during cleanup (label patch,
    deletion, events, the istio probe) are stood in for; what is tested is how a finished
    pod's exit code is classified."""
    op.patch_already_checked = lambda *a, **k: None
    op.process_pod_deletion = lambda *a, **k: None
    op._read_pod_events = lambda *a, **k: None
    op.is_istio_enabled = lambda *a, **k: False


@pytest.mark.parametrize("code", [2, 3])
def test_a_stage_pod_that_exits_with_a_user_mistake_fails_at_once(code, monkeypatch):
    from airflow.sdk.exceptions import AirflowFailException

    from dags import wiring

    monkeypatch.setattr(wiring, "FINAL_ERRORS", [])  # the pod's error goes there, for `posttrain run`
    cls, kwargs = mode.operator(registered()[1], resources(registered()[1].id))
    op = cls(task_id="taskgen", arguments=_args(registered()[1]), **kwargs)
    _offline(op)
    pod = _finished_pod(code)
    assert mode.exit_code(pod, "base") == code
    with pytest.raises(AirflowFailException, match=rf"^stage pod exited {code}: "):
        op.cleanup(pod, pod)
    assert len(wiring.FINAL_ERRORS) == 1  # tests/dags/test_exec_stage_containers.py checks what it is


def test_a_stage_pod_that_fails_otherwise_is_left_to_the_retries():
    from airflow.exceptions import AirflowException
    from airflow.sdk.exceptions import AirflowFailException

    cls, kwargs = mode.operator(registered()[1], resources(registered()[1].id))
    op = cls(task_id="taskgen", arguments=_args(registered()[1]), **kwargs)
    _offline(op)
    pod = _finished_pod(1)
    with pytest.raises(AirflowException) as failed:
        op.cleanup(pod, pod)
    assert not isinstance(failed.value, AirflowFailException)
