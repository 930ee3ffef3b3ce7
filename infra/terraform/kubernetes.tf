# The namespace every posttrain workload runs in, the stage service account that IRSA
# binds to the stage role, the stages' environment, and the RBAC that lets Airflow's
# workers start stage pods. Orchestrators start stage pods with
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

# Where the stages' store and tracking server are, for pods that take it with envFrom
# (the DAG's kubernetes mode) or key by key (the Kubeflow pipeline).
resource "kubernetes_config_map_v1" "stage_env" {
  metadata {
    name      = var.stage_configmap
    namespace = kubernetes_namespace_v1.posttrain.metadata[0].name
  }
  data = {
    POSTTRAIN_RUN_ROOT  = local.run_root
    MLFLOW_TRACKING_URI = local.mlflow_uri
    AWS_REGION          = var.region
  }
}

# Airflow's task workers run the KubernetesPodOperator: they create the stage pods, follow
# their logs and events, and delete the pods that succeeded. Nothing else.
resource "kubernetes_role_v1" "stage_pods" {
  metadata {
    name      = "posttrain-stage-pods"
    namespace = kubernetes_namespace_v1.posttrain.metadata[0].name
  }
  rule {
    api_groups = [""]
    resources  = ["pods"]
    verbs      = ["create", "get", "list", "watch", "patch", "delete"]
  }
  rule {
    api_groups = [""]
    resources  = ["pods/log"]
    verbs      = ["get"]
  }
  rule {
    api_groups = [""]
    resources  = ["events"]
    verbs      = ["get", "list", "watch"]
  }
}

resource "kubernetes_role_binding_v1" "stage_pods" {
  metadata {
    name      = "posttrain-stage-pods"
    namespace = kubernetes_namespace_v1.posttrain.metadata[0].name
  }
  role_ref {
    api_group = "rbac.authorization.k8s.io"
    kind      = "Role"
    name      = kubernetes_role_v1.stage_pods.metadata[0].name
  }
  subject {
    kind      = "ServiceAccount"
    name      = local.airflow_worker_sa
    namespace = kubernetes_namespace_v1.posttrain.metadata[0].name
  }
}
