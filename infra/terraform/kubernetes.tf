# The namespace every posttrain workload runs in, the stage service account that IRSA
# binds to the stage role, the stages' environment, and the RBAC that lets Airflow's
# workers start stage pods. Orchestrators start stage pods with
# serviceAccountName = var.stage_service_account in var.namespace. With var.kfp_namespace
# set, also what a Kubeflow run of the pipeline needs in that namespace (below).

locals {
  kfp_enabled = var.kfp_namespace != ""
}

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

# Kubeflow Pipelines (var.kfp_namespace set): the service account runs of the pipeline are
# submitted with, in the namespace KFP runs them in. Under KFP v2 on Argo every pod of a
# run runs as this account: KFP's driver, Argo's executor (the wait container) and KFP's
# launcher, which wraps each task's code in its main container. They call the API server
# (the launcher starts from rest.InClusterConfig()), so the token is mounted, and the Role
# below grants what they call. The stage code in the same pods reaches the store through
# IRSA: the stage role trusts this account too (iam.tf).
resource "kubernetes_service_account_v1" "kfp" {
  count = local.kfp_enabled ? 1 : 0

  metadata {
    name        = var.kfp_service_account
    namespace   = var.kfp_namespace
    annotations = { "eks.amazonaws.com/role-arn" = aws_iam_role.irsa["stage"].arn }
  }
  automount_service_account_token = true

  lifecycle {
    precondition {
      condition     = var.kfp_namespace != var.namespace
      error_message = "kfp_namespace equals namespace, where Airflow and MLflow run: KFP runs pipelines only in a Profile's namespace (multi-user) or its own (standalone), and a run's account may patch pods in its namespace. Set kfp_namespace to the namespace KFP runs the pipeline in."
    }
  }
}

# The stages' environment where KFP's pods can take it (a pod reads config maps of its
# own namespace only): the same data as stage_env.
resource "kubernetes_config_map_v1" "kfp_stage_env" {
  count = local.kfp_enabled ? 1 : 0

  metadata {
    name      = var.stage_configmap
    namespace = var.kfp_namespace
  }
  data = kubernetes_config_map_v1.stage_env.data
}

# What KFP's and Argo's parts of a run call, and nothing else (KFP's own pipeline-runner
# Role grants these among much more; Argo's workflow-rbac.md gives the executor's minimum).
resource "kubernetes_role_v1" "kfp_run" {
  count = local.kfp_enabled ? 1 : 0

  metadata {
    name      = "posttrain-kfp-run"
    namespace = var.kfp_namespace
  }
  # Argo 3.4+'s executor reports each step's outputs and exit as a WorkflowTaskResult
  rule {
    api_groups = ["argoproj.io"]
    resources  = ["workflowtaskresults"]
    verbs      = ["create", "patch"]
  }
  # Argo's executor before 3.4 reports them by patching its pod; get as in KFP's own Role
  rule {
    api_groups = [""]
    resources  = ["pods"]
    verbs      = ["get", "patch"]
  }
  # KFP's driver and launcher read the pipeline root and artifact-store settings here
  rule {
    api_groups     = [""]
    resources      = ["configmaps"]
    resource_names = ["kfp-launcher"]
    verbs          = ["get"]
  }
  # KFP's launcher opens the artifact store before each task, with the default store's keys
  rule {
    api_groups     = [""]
    resources      = ["secrets"]
    resource_names = ["mlpipeline-minio-artifact"]
    verbs          = ["get"]
  }
}

resource "kubernetes_role_binding_v1" "kfp_run" {
  count = local.kfp_enabled ? 1 : 0

  metadata {
    name      = "posttrain-kfp-run"
    namespace = var.kfp_namespace
  }
  role_ref {
    api_group = "rbac.authorization.k8s.io"
    kind      = "Role"
    name      = kubernetes_role_v1.kfp_run[0].metadata[0].name
  }
  subject {
    kind      = "ServiceAccount"
    name      = kubernetes_service_account_v1.kfp[0].metadata[0].name
    namespace = var.kfp_namespace
  }
}
