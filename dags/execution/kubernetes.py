"""The ``kubernetes`` execution mode: every stage task is a pod in the stage's image, started
and watched by the cncf-kubernetes provider's ``KubernetesPodOperator``.

What a stage pod gets (``operator(spec, res)``):

- every stage: the image ``<POSTTRAIN_IMAGE_PREFIX>posttrain-<stage>:<POSTTRAIN_IMAGE_TAG>``
  (its entrypoint ``posttrain stage <id>``; the seam passes the arguments), namespace
  ``POSTTRAIN_NAMESPACE``, service account ``POSTTRAIN_STAGE_SERVICE_ACCOUNT``, the config
  map ``POSTTRAIN_STAGE_CONFIGMAP`` and the secret ``POSTTRAIN_STAGE_SECRET`` (optional: the
  pod starts without it) as environment (``envFrom``), requests ``cpu`` and
  ``memory`` and a ``memory`` limit from ``res``, and the Pod Security Standards'
  *restricted* profile: uid/gid 10001, non-root, no privilege escalation, every capability
  dropped, seccomp ``RuntimeDefault``;
- every stage: a read-only root filesystem (``readOnlyRootFilesystem``), and its scratch
  space instead (``SCRATCH_MOUNTS``): node-disk ``emptyDir`` volumes at ``/tmp`` (temporary
  folders, torch's and torchrun's, the sandbox's per-job folders; ``TMPDIR`` is unset, so
  Python's ``tempfile`` uses it) and at the images' home ``/home/posttrain``
  (``POSTTRAIN_HOME``, the Hugging Face, matplotlib, MLflow and Triton caches), each with
  ``sizeLimit`` ``res.scratch``, and an ``ephemeral-storage`` request and limit of
  ``res.scratch`` (the registry's ``scratch`` unless the recipe's
  ``resources.<stage>.scratch`` overrides it), which bounds both together: a stage that
  writes more is evicted (the task fails and is retried) instead of filling the node's disk;
- GPU stages (``res.gpus`` > 0; the registry's ``gpus`` unless the recipe's ``resources``
  overrides it): a ``nvidia.com/gpu`` limit, a toleration for the ``nvidia.com/gpu``
  NoSchedule taint, the node selector ``POSTTRAIN_GPU_NODE_SELECTOR``, and ``/dev/shm`` in
  memory (torch and vLLM share tensors between processes there);
- sandboxed stages (``spec.sandboxed``): the sandbox's security context instead (below),
  ``hostUsers: false``, and ``runtimeClassName`` ``POSTTRAIN_SANDBOX_RUNTIME_CLASS`` when set;
  their root is read-only too: bubblewrap builds each job's root on a fresh tmpfs in its own
  mount namespace, and what the sandbox writes on the container's side (the subprocess
  backend's job folders, the seccomp filter's file) goes through ``tempfile`` to ``/tmp``.

Settings, read at DAG parse (``dags/execution/cluster.py``; a bad value is a DAG import
error, and ``posttrain run`` refuses it before any work: one line naming the variable and
the fix):

| variable | default | meaning |
|---|---|---|
| ``POSTTRAIN_NAMESPACE`` | ``posttrain`` | namespace of the stage pods |
| ``POSTTRAIN_STAGE_SERVICE_ACCOUNT`` | ``posttrain-stage`` | their service account (IRSA on EKS grants the store) |
| ``POSTTRAIN_STAGE_CONFIGMAP`` | ``posttrain-stage-env`` | the stages' environment: store, tracking server, region |
| ``POSTTRAIN_STAGE_SECRET`` | ``posttrain-s3`` | a secret whose keys join it where it exists (store credentials without IRSA, a tracking token); empty: none |
| ``POSTTRAIN_SANDBOX_RUNTIME_CLASS`` | unset | RuntimeClass of sandboxed pods, e.g. ``gvisor`` |
| ``POSTTRAIN_GPU_NODE_SELECTOR`` | ``posttrain.io/pool=gpu`` | ``key=value[,key=value]`` for GPU pods; empty: none |
| ``POSTTRAIN_POD_STARTUP_TIMEOUT_S`` | ``600`` | seconds a pod may stay Pending (image pull, GPU node scale-up) |
| ``POSTTRAIN_IMAGE_PREFIX``, ``POSTTRAIN_IMAGE_TAG`` | ``""``, the package version | the stage images |

Why the sandboxed stages' pods look as they do: the sandbox runs policy-written code
under bubblewrap, which needs unprivileged user namespaces (blocked by the runtime's
default seccomp and AppArmor profiles) and must mount a fresh ``/proc`` in its own PID
namespace (refused by the kernel while the container's ``/proc`` has masked paths). The
container stays non-root with every capability dropped; what it gets instead is
``seccompProfile``/``appArmorProfile`` ``Unconfined`` and ``procMount: Unmasked``, the
same as the docker mode's ``--security-opt`` flags (``containers/podman-run-flags``).
The API server accepts ``procMount: Unmasked`` only in a pod with its own user namespace,
``hostUsers: false``: that needs Kubernetes 1.30+ with the ``UserNamespacesSupport`` and
``ProcMountType`` feature gates (on by default from 1.33) and a runtime and kernel that
support idmapped mounts (containerd 2.0+ or CRI-O 1.25+, Linux 6.3+). Where they are
missing, the API server either ignores these fields (the sandbox then finds weaker
isolation at start and refuses to run untrusted code unless the recipe allows it) or
rejects the pod, which fails the task with the API server's reason. A gVisor
RuntimeClass isolates the whole pod in a user-space kernel on top of that.

Pods are deleted when they succeed and kept when they ran and failed (``kubectl logs`` /
``describe`` them); their logs stream into the Airflow task log. A pod that has not
terminated when the task ends is deleted (its SIGTERM ends the stage's MLflow run KILLED):
past the task's time limit (the task fails at once, naming ``timeouts.<stage>``), told to
stop (SIGTERM or Ctrl-C to ``posttrain run``, a lost writer lease: the task ends stopped),
still Pending after ``POSTTRAIN_POD_STARTUP_TIMEOUT_S`` (its events are in the task log; the
retry makes a new pod), or left running by an outage of the API server's log stream. Labels:
``app.kubernetes.io/part-of=posttrain``, ``posttrain.io/stage=<id>`` and, on sharded
stages, ``posttrain.io/shard=<map index>``.

Not covered: multi-node stages (the trainer stays one pod here; ``dags/execution/pytorchjob.py``
renders the same pod as the replicas of a Kubeflow PyTorchJob, which
``posttrain render pytorchjob`` prints and nothing in the DAG submits), deferrable mode (the
deployment runs no triggerer), image pull secrets (use node IAM / ECR, or the service
account's ``imagePullSecrets``).
"""

from __future__ import annotations

import sys
from typing import Any

from airflow.providers.cncf.kubernetes.operators.pod import KubernetesPodOperator
from kubernetes.client import models as k8s

from components.core.stages import Resources, StageSpec
from dags.execution import FAIL_NOW_EXIT_CODES, fail_now, image_for
from dags.execution.cluster import (  # noqa: F401 - the settings, read by this mode (and by the tests through it)
    CONFIGMAP_VAR,
    DEFAULTS,
    GPU_NODE_SELECTOR_VAR,
    NAMESPACE_VAR,
    RUNTIME_CLASS_VAR,
    SCRATCH_MOUNTS,
    SECRET_VAR,
    SERVICE_ACCOUNT_VAR,
    STARTUP_TIMEOUT_VAR,
    ClusterSettings,
    cluster_settings,
)

ARGS_FIELD = "arguments"

GPU_RESOURCE = "nvidia.com/gpu"
STAGE_UID = 10001  # the images' user "posttrain" (containers/base.Dockerfile)
EPHEMERAL_STORAGE = "ephemeral-storage"


def security_contexts(sandboxed: bool) -> tuple[k8s.V1PodSecurityContext, k8s.V1SecurityContext]:
    """(pod, container) security contexts: the Pod Security Standards' *restricted* profile,
    or the sandbox's (see the module docstring)."""
    seccomp = k8s.V1SeccompProfile(type="Unconfined" if sandboxed else "RuntimeDefault")
    pod = k8s.V1PodSecurityContext(run_as_non_root=True, run_as_user=STAGE_UID, run_as_group=STAGE_UID,
                                   fs_group=STAGE_UID, seccomp_profile=seccomp)
    container = k8s.V1SecurityContext(run_as_non_root=True, run_as_user=STAGE_UID, run_as_group=STAGE_UID,
                                      allow_privilege_escalation=False, privileged=False, read_only_root_filesystem=True,
                                      capabilities=k8s.V1Capabilities(drop=["ALL"]), seccomp_profile=seccomp)
    if sandboxed:
        container.app_armor_profile = k8s.V1AppArmorProfile(type="Unconfined")
        container.proc_mount = "Unmasked"
    return pod, container


def volumes(res: Resources) -> tuple[list[k8s.V1Volume], list[k8s.V1VolumeMount]]:
    """(volumes, the container's mounts): the scratch space, ``emptyDir`` on the node's disk
    capped at ``res.scratch`` each, and on GPU stages ``/dev/shm`` in memory."""
    vols = [k8s.V1Volume(name=name, empty_dir=k8s.V1EmptyDirVolumeSource(size_limit=res.scratch))
            for name, _ in SCRATCH_MOUNTS]
    mounts = [k8s.V1VolumeMount(name=name, mount_path=path) for name, path in SCRATCH_MOUNTS]
    if res.gpus > 0:  # torch and vLLM share tensors between processes through /dev/shm (64 MiB by default)
        vols.append(k8s.V1Volume(name="dshm", empty_dir=k8s.V1EmptyDirVolumeSource(medium="Memory")))
        mounts.append(k8s.V1VolumeMount(name="dshm", mount_path="/dev/shm"))
    return vols, mounts


def operator(spec: StageSpec, res: Resources) -> tuple[type, dict[str, Any]]:
    """(KubernetesPodOperator, its keyword arguments for this stage): everything but the
    task id, the arguments (``ARGS_FIELD``) and the Airflow retry/timeout/callback/pool ones."""
    conf = cluster_settings()
    gpu = res.gpus > 0
    pod_security, container_security = security_contexts(spec.sandboxed)
    limits = {"memory": res.memory, EPHEMERAL_STORAGE: res.scratch, **({GPU_RESOURCE: str(res.gpus)} if gpu else {})}
    requests = {"cpu": res.cpu, "memory": res.memory, EPHEMERAL_STORAGE: res.scratch}
    vols, mounts = volumes(res)
    labels = {"app.kubernetes.io/part-of": "posttrain", "app.kubernetes.io/component": spec.id, "posttrain.io/stage": spec.id}
    if spec.sharded:
        labels["posttrain.io/shard"] = "{{ ti.map_index }}"
    # What KubernetesPodOperator has no argument for goes in a base pod it merges under its own.
    base = k8s.V1PodSpec(containers=[], host_users=False if spec.sandboxed else None,
                         runtime_class_name=(conf.runtime_class or None) if spec.sandboxed else None)
    kwargs: dict[str, Any] = {
        "name": f"posttrain-{spec.id}",
        "namespace": conf.namespace,
        "image": image_for(spec.id),
        "image_pull_policy": "IfNotPresent",
        "service_account_name": conf.service_account,
        "automount_service_account_token": False,  # stages never call the Kubernetes API (IRSA mounts its own token)
        "env_from": [k8s.V1EnvFromSource(config_map_ref=k8s.V1ConfigMapEnvSource(name=conf.config_map)),
                     *([k8s.V1EnvFromSource(secret_ref=k8s.V1SecretEnvSource(name=conf.secret, optional=True))]
                       if conf.secret else [])],
        "container_resources": k8s.V1ResourceRequirements(requests=requests, limits=limits),
        "volumes": vols,
        "volume_mounts": mounts,
        "security_context": pod_security,
        "container_security_context": container_security,
        "labels": labels,
        "get_logs": True,
        "log_events_on_failure": True,
        "on_finish_action": "delete_succeeded_pod",
        "termination_message_policy": "FallbackToLogsOnError",  # a failed stage's last line reaches the task log
        "startup_timeout_seconds": conf.startup_timeout_s,
        "deferrable": False,
    }
    if base.host_users is not None or base.runtime_class_name:
        kwargs["full_pod_spec"] = k8s.V1Pod(spec=base)
    if gpu:
        kwargs["tolerations"] = [k8s.V1Toleration(key=GPU_RESOURCE, operator="Exists", effect="NoSchedule")]
        kwargs["node_selector"] = dict(conf.gpu_node_selector)
    return StagePod, kwargs


def exit_code(remote_pod, container: str) -> int | None:
    """The exit code of ``container`` in a finished pod, or None."""
    statuses = (remote_pod.status.container_statuses if remote_pod is not None and remote_pod.status else None) or []
    status = next((s for s in statuses if s.name == container), None)
    terminated = status.state.terminated if status is not None and status.state is not None else None
    return terminated.exit_code if terminated is not None else None


def last_line(remote_pod, container: str, failure: str) -> str:
    """The stage's last line: its termination message's (the log's tail, with
    ``FallbackToLogsOnError``), else the provider's failure's first line (the rest of
    that text is the pod's spec, which it logs on failure)."""
    statuses = (remote_pod.status.container_statuses if remote_pod is not None and remote_pod.status else None) or []
    status = next((s for s in statuses if s.name == container), None)
    terminated = status.state.terminated if status is not None and status.state is not None else None
    message = terminated.message if terminated is not None and isinstance(terminated.message, str) else ""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    return lines[-1] if lines else (failure.strip().splitlines() or ["(no output)"])[0]


TERMINATED_PHASES = ("Succeeded", "Failed")


class StagePod(KubernetesPodOperator):
    """KubernetesPodOperator for a posttrain stage: a pod whose stage exits 2 (a user's
    mistake) or 3 (a failed data-quality gate) fails the task at once, unretried, with the
    stage's last line (the termination message falls back to the log's tail), and so does a
    pod past the task's time limit (deleted first); SIGTERM or Ctrl-C under ``posttrain
    run`` deletes the pod and ends the task as stopped (``dags.execution.run_stoppably``);
    any other failure stays the provider's, which Airflow retries.

    The provider's cleanup (in its ``finally``) kept every pod that had not succeeded and
    labelled it checked, so the retry made a new one beside it: a pod still running when
    the time limit struck (and the cleanup's "returned a failure" replaced the timeout, so
    the task was retried), or one still Pending after the startup timeout (both ran once
    the node scaled up). Here a pod that has not terminated (Pending, Running, Unknown) is
    deleted (``on_kill``); only one that ran and failed is kept, for its logs."""

    def execute(self, context):
        from dags.execution import run_stoppably

        return run_stoppably(self, super().execute, context)

    def on_kill(self) -> None:
        if not self._killed:  # deleted once: by cleanup on an interruption, then by fail_timed_out / stopped
            super().on_kill()

    def _terminated(self, remote_pod) -> bool:
        """Whether the pod has terminated (read again: the provider's ``remote_pod`` is the
        one read at creation unless it waited for the pod's end); True for one that is gone."""
        from kubernetes.client.exceptions import ApiException

        phase = remote_pod.status.phase if remote_pod.status else None
        if phase in TERMINATED_PHASES:
            return True
        try:
            current = self.pod_manager.read_pod(remote_pod)
        except ApiException as exc:
            return str(exc.status) == "404"
        except Exception:  # noqa: BLE001 - the API server does not answer: delete what may still run
            return False
        return (current.status.phase if current.status else None) in TERMINATED_PHASES

    def cleanup(self, pod, remote_pod):
        from airflow.exceptions import AirflowException
        from airflow.sdk.exceptions import AirflowFailException, AirflowSkipException

        from dags.execution import interruption

        if not self._killed and remote_pod is not None and (
                interruption(sys.exc_info()[1]) is not None or not self._terminated(remote_pod)):
            self.log.info("Deleting pod %s: it has not terminated", remote_pod.metadata.name)
            self.on_kill()  # the exception in flight (time limit, stop, startup timeout, outage) is the task's
            return None
        try:
            return super().cleanup(pod, remote_pod)
        except AirflowException as exc:
            code = exit_code(remote_pod, self.base_container_name)
            if code in FAIL_NOW_EXIT_CODES and not isinstance(exc, (AirflowFailException, AirflowSkipException)):
                raise fail_now(code, last_line(remote_pod, self.base_container_name, str(exc)), self.task_id,
                               "pod") from exc
            raise
