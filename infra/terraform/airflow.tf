# The orchestrator: the official Apache Airflow Helm chart with the KubernetesExecutor,
# running the DAG post_training_iteration in its kubernetes mode (POSTTRAIN_EXECUTION):
# each stage task is a pod in the stage's image in var.namespace, as the stage service
# account (dags/execution/kubernetes.py).
#
# Image: every Airflow component runs posttrain-base (the project, its Airflow and the
# cncf-kubernetes provider installed), so the DAG processor and the task workers import
# components/ and dags/ at the version of the stage images. The DAGs come from that image
# (/opt/posttrain/dags), not git-sync: a DAG file synced from a branch would drift from the
# components it imports. posttrain-base's entrypoint is `posttrain`, and the chart passes
# Airflow commands as container args, so its containers start them through
# /usr/bin/env; the probes call airflow directly (the chart's default probes go through
# the official image's /entrypoint); the log-groomer sidecars (/clean-logs, official image
# only) are off. Database migrations run in the official image var.airflow_image
# (images.useDefaultImageForMigration), whose tag must be the Airflow in posttrain-base.
# The chart's own Postgres holds Airflow's metadata database.

locals {
  airflow_worker_sa        = "airflow-worker"
  airflow_dag_processor_sa = "airflow-dag-processor"
  airflow_home             = "/opt/airflow"
  posttrain_dags           = "/opt/posttrain/dags"
  via_env                  = ["/usr/bin/env"]
  airflow_irsa             = { "eks.amazonaws.com/role-arn" = aws_iam_role.irsa["airflow"].arn }
}

resource "helm_release" "airflow" {
  name       = "airflow"
  repository = "https://airflow.apache.org"
  chart      = "airflow"
  version    = var.airflow_chart_version
  namespace  = kubernetes_namespace_v1.posttrain.metadata[0].name
  timeout    = 900

  values = [yamlencode({
    executor                 = "KubernetesExecutor"
    airflowVersion           = var.airflow_image.tag
    defaultAirflowRepository = var.airflow_image.repository
    defaultAirflowTag        = var.airflow_image.tag
    images = {
      airflow                     = { repository = "${var.image_prefix}posttrain-base", tag = var.image_version, pullPolicy = "IfNotPresent" }
      pod_template                = { repository = "${var.image_prefix}posttrain-base", tag = var.image_version, pullPolicy = "IfNotPresent" }
      useDefaultImageForMigration = true
    }
    uid          = 10001 # the images' user posttrain
    gid          = 10001
    airflowHome  = local.airflow_home
    nodeSelector = local.cpu_pool

    # AIRFLOW_HOME is not set in posttrain-base; an emptyDir makes it writable (the API
    # server writes its generated admin password there).
    volumes      = [{ name = "airflow-home", emptyDir = {} }]
    volumeMounts = [{ name = "airflow-home", mountPath = local.airflow_home }]

    config = {
      core = { dags_folder = local.posttrain_dags, load_examples = "False" }
    }
    dags = { gitSync = { enabled = false } }

    scheduler = {
      command           = local.via_env
      logGroomerSidecar = { enabled = false }
      livenessProbe     = { command = ["sh", "-c", "AIRFLOW__LOGGING__LOGGING_LEVEL=ERROR exec airflow jobs check --job-type SchedulerJob --local"] }
      startupProbe      = { command = ["sh", "-c", "AIRFLOW__LOGGING__LOGGING_LEVEL=ERROR exec airflow jobs check --job-type SchedulerJob --local"] }
    }
    dagProcessor = {
      enabled           = true
      command           = local.via_env
      logGroomerSidecar = { enabled = false }
      livenessProbe     = { command = ["sh", "-c", "AIRFLOW__LOGGING__LOGGING_LEVEL=ERROR exec airflow jobs check --job-type DagProcessorJob --local"] }
      # DAG-level failure callbacks run here: run_failed hands the iteration's lease back in the store
      serviceAccount = { create = true, name = local.airflow_dag_processor_sa, annotations = local.airflow_irsa }
    }
    apiServer = { command = local.via_env }
    triggerer = { enabled = false } # the stage pods are watched synchronously (no deferrable tasks)
    workers = {
      command = local.via_env
      # the plan task (store lease, recipe publishing, MLflow) and the pod launches run as this account
      serviceAccount = { create = true, name = local.airflow_worker_sa, annotations = local.airflow_irsa }
    }
    webserver = { defaultUser = { enabled = false } } # Airflow 3's simple auth manager has its own users

    # Helm hooks and Terraform's wait-for-ready deadlock; run the jobs as plain resources.
    createUserJob      = { useHelmHooks = false, applyCustomEnv = false }
    migrateDatabaseJob = { useHelmHooks = false, applyCustomEnv = false }

    # Every POSTTRAIN_* here is read by the DAG (components/core/settings.py, dags/wiring.py,
    # dags/execution/); tests/infra/test_terraform.py checks both ways.
    env = [
      { name = "AIRFLOW_HOME", value = local.airflow_home },
      { name = "POSTTRAIN_EXECUTION", value = "kubernetes" },
      { name = "POSTTRAIN_RECIPE", value = var.recipe },
      { name = "POSTTRAIN_RUN_ROOT", value = local.run_root },
      { name = "POSTTRAIN_SCHEDULE", value = var.schedule },
      { name = "POSTTRAIN_IMAGE_PREFIX", value = var.image_prefix },
      { name = "POSTTRAIN_IMAGE_TAG", value = var.image_version },
      { name = "POSTTRAIN_NAMESPACE", value = kubernetes_namespace_v1.posttrain.metadata[0].name },
      { name = "POSTTRAIN_STAGE_SERVICE_ACCOUNT", value = kubernetes_service_account_v1.stage.metadata[0].name },
      { name = "POSTTRAIN_STAGE_CONFIGMAP", value = kubernetes_config_map_v1.stage_env.metadata[0].name },
      { name = "POSTTRAIN_SANDBOX_RUNTIME_CLASS", value = var.sandbox_runtime_class },
      { name = "POSTTRAIN_GPU_NODE_SELECTOR", value = var.gpu_node_selector },
      { name = "MLFLOW_TRACKING_URI", value = local.mlflow_uri },
      { name = "AWS_REGION", value = var.region },
    ]
  })]

  depends_on = [kubernetes_service_v1.mlflow, kubernetes_role_binding_v1.stage_pods]
}
