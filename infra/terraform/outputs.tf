output "bucket" {
  description = "Name of the object-store bucket."
  value       = aws_s3_bucket.store.bucket
}

output "run_root" {
  description = "POSTTRAIN_RUN_ROOT for every stage: the run root inside the bucket."
  value       = local.run_root
}

output "kms_key_arn" {
  description = "KMS key that encrypts the bucket (and the MLflow database)."
  value       = aws_kms_key.store.arn
}

output "stage_role_arn" {
  description = "IAM role the stage service account assumes (IRSA)."
  value       = aws_iam_role.irsa["stage"].arn
}

output "airflow_role_arn" {
  description = "IAM role Airflow's task workers and DAG processor assume (IRSA): the plan task's lease and recipe in the store."
  value       = aws_iam_role.irsa["airflow"].arn
}

output "stage_configmap" {
  description = "Config map with the stage pods' environment."
  value       = kubernetes_config_map_v1.stage_env.metadata[0].name
}

output "mlflow_role_arn" {
  description = "IAM role the MLflow server assumes (IRSA)."
  value       = aws_iam_role.irsa["mlflow"].arn
}

output "namespace" {
  description = "Kubernetes namespace of the stage pods, MLflow and Airflow."
  value       = kubernetes_namespace_v1.posttrain.metadata[0].name
}

output "stage_service_account" {
  description = "Service account stage pods must run as."
  value       = kubernetes_service_account_v1.stage.metadata[0].name
}

output "kfp_run" {
  description = "Where and as whom to submit Kubeflow runs of the pipeline (create_run_from_pipeline_package's namespace and service_account); null without kfp_namespace."
  value = local.kfp_enabled ? {
    namespace       = var.kfp_namespace
    service_account = kubernetes_service_account_v1.kfp[0].metadata[0].name
  } : null
}

output "mlflow_tracking_uri" {
  description = "MLFLOW_TRACKING_URI inside the cluster."
  value       = local.mlflow_uri
}

output "node_groups" {
  description = "Managed node groups created here, by pool (empty when create_node_groups is false)."
  value       = { for k, g in aws_eks_node_group.pool : k => g.node_group_name }
}

output "airflow_release" {
  description = "Helm release name and chart version of Airflow."
  value       = "${helm_release.airflow.name}@${helm_release.airflow.version}"
}
