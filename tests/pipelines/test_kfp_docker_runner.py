"""The Kubeflow pipeline run by ``kfp.local.DockerRunner``: every task in its stage image,
through podman's Docker-compatible socket, against SeaweedFS and an MLflow server on
loopback. One iteration of the tiny recipe, from a recipe the test publishes into the
store (a container cannot see this machine's files; on a cluster it is the same).

The runner's container arguments: the host's network (the servers listen on loopback),
the store and tracking settings as environment, the flags of ``containers/podman-run-flags``
(ulimits, runtime, and the security options bubblewrap needs), and ``/usr/bin/env`` as the
entrypoint: KFP gives each container a full command, and on a cluster that command
replaces the image's ``posttrain stage <id>`` entrypoint, while docker's ``command`` only
appends to it. Slow: minutes.
"""

from __future__ import annotations

import pytest

from components.core.storage import Store
from tests.fixtures.runs import registry_versions_at
from tests.fixtures.s3 import unique_prefix

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600)]  # a cold image build when the sources changed


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_docker_runner_runs_one_iteration_in_the_stage_images(tmp_path, monkeypatch, s3_env, mlflow_server, podman_socket,
                                                              stage_images) -> None:
    import kfp.local

    from components.core.recipe import publish_recipe
    from pipelines import local
    from pipelines.post_training_iteration import make_pipeline
    from tests.fixtures.runs import TINY

    root = f"s3://{s3_env.bucket}/{unique_prefix('kfp-docker')}"
    recipe = publish_recipe(TINY, root)
    outputs = tmp_path / "kfp-root"
    outputs.mkdir()
    outputs.chmod(0o777)  # the images run as uid 10001 and write their outputs here
    monkeypatch.setenv("DOCKER_HOST", podman_socket)
    env = {**s3_env.env(), "MLFLOW_TRACKING_URI": mlflow_server.uri, "POSTTRAIN_RUN_ROOT": root}
    runner = kfp.local.DockerRunner(network_mode="host", environment=env, entrypoint=["/usr/bin/env"],
                                    **stage_images.docker_options())
    kfp.local.init(runner=runner, pipeline_root=str(outputs), raise_on_error=True)

    with local.process_state_restored():  # kfp.local's print wrapper must not outlive the run
        make_pipeline(image_prefix="localhost/")(recipe=recipe, run_root=root)  # no output: the iteration is in an exit handler

    store = Store(root)
    evaluation = store.read_json("tiny/iter-000001/evaluation/_MANIFEST.json")
    assert evaluation["iteration"] == 1 and evaluation["stage"] == "evaluation"
    for stage in ("rollout", "sandbox", "reward"):
        found = sorted(p.rsplit("/", 2)[-2] for p in store.glob(f"tiny/iter-000001/{stage}/*/_MANIFEST.json"))
        assert found == ["shard-00000-of-00002", "shard-00001-of-00002"], stage
    assert registry_versions_at(mlflow_server.uri) == {1: f"{root}/tiny/bootstrap/checkpoint",
                                                       2: f"{root}/tiny/iter-000001/trainer/checkpoint"}
    isolation = set()
    for i in range(2):
        meta = store.read_json(f"tiny/iter-000001/sandbox/shard-{i:05d}-of-00002/_MANIFEST.json")["outputs"]["executions"]
        isolation |= set(store.read_table(meta["path"]).column("isolation").to_pylist())
    assert isolation and all(s.startswith("bwrap:") and "WEAK" not in s for s in isolation), isolation
