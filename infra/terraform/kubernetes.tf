# The namespace every posttrain workload runs in, and the stage service account that
# IRSA binds to the stage role. Orchestrators start stage pods with
# serviceAccountName = var.stage_service_account in var.namespace.

resource "kubernetes_namespace_v1" "posttrain" {
  metadata {
    name   = var.namespace
    labels = { "app.kubernetes.io/part-of" = "posttrain" }
  }
}

resource "kubernetes_service_account_v1" "stage" {
  metadata {
    name        = var.stage_service_account
    namespace   = kubernetes_namespace_v1.posttrain.metadata[0].name
    annotations = { "eks.amazonaws.com/role-arn" = aws_iam_role.irsa["stage"].arn }
  }
  automount_service_account_token = false
}

# Where the stages' store and tracking server are, for pods that mount it with envFrom.
resource "kubernetes_config_map_v1" "stage_env" {
  metadata {
    name      = "posttrain-stage-env"
    namespace = kubernetes_namespace_v1.posttrain.metadata[0].name
  }
  data = {
    POSTTRAIN_RUN_ROOT  = local.run_root
    MLFLOW_TRACKING_URI = local.mlflow_uri
    AWS_REGION          = var.region
  }
}
