# The orchestrator: the official Apache Airflow Helm chart with the KubernetesExecutor,
# DAGs pulled from this repository by git-sync (dags/). In cluster mode the DAG's tasks
# start the stage images with KubernetesPodOperator in var.namespace as the stage
# service account; the POSTTRAIN_* variables below tell it where everything is.
# The chart's own Postgres holds Airflow's metadata database.

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
    nodeSelector             = local.cpu_pool

    # Helm hooks and Terraform's wait-for-ready deadlock; run the jobs as plain resources.
    createUserJob      = { useHelmHooks = false, applyCustomEnv = false }
    migrateDatabaseJob = { useHelmHooks = false, applyCustomEnv = false }

    dags = {
      gitSync = {
        enabled = true
        repo    = var.dags_git_repo
        branch  = var.dags_git_branch
        subPath = "dags"
      }
    }

    env = [
      { name = "POSTTRAIN_RUN_ROOT", value = local.run_root },
      { name = "MLFLOW_TRACKING_URI", value = local.mlflow_uri },
      { name = "POSTTRAIN_NAMESPACE", value = var.namespace },
      { name = "POSTTRAIN_STAGE_SERVICE_ACCOUNT", value = var.stage_service_account },
      { name = "POSTTRAIN_IMAGE_PREFIX", value = var.image_prefix },
      { name = "POSTTRAIN_IMAGE_VERSION", value = var.image_version },
      { name = "POSTTRAIN_SCHEDULE", value = var.schedule },
    ]
  })]

  depends_on = [kubernetes_service_v1.mlflow]
}
