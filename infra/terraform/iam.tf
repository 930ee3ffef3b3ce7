# IRSA: the Kubernetes service accounts below assume an IAM role through the cluster's
# OIDC provider, so pods get short-lived credentials and no static keys.
#   stage   - the stage pods, and the pods of Kubeflow runs (var.kfp_namespace set):
#             read/write the run root, read MLflow's artifacts
#   airflow - Airflow's task workers and DAG processor: the plan task leases the iteration
#             and publishes the recipe in the run root, a failed run hands its lease back
#   mlflow  - the tracking server: read/write its artifacts, read checkpoints in the run root

locals {
  oidc_issuer   = replace(data.aws_eks_cluster.this.identity[0].oidc[0].issuer, "https://", "")
  oidc_provider = "arn:${data.aws_partition.current.partition}:iam::${data.aws_caller_identity.current.account_id}:oidc-provider/${local.oidc_issuer}"

  irsa = {
    stage = {
      service_accounts = [var.stage_service_account]
      write_prefixes   = [var.store_prefix]
      read_prefixes    = [var.store_prefix, local.mlflow_artifacts]
    }
    airflow = {
      service_accounts = [local.airflow_worker_sa, local.airflow_dag_processor_sa]
      write_prefixes   = [var.store_prefix]
      read_prefixes    = [var.store_prefix]
    }
    mlflow = {
      service_accounts = ["mlflow"]
      write_prefixes   = [local.mlflow_artifacts]
      read_prefixes    = [local.mlflow_artifacts, var.store_prefix]
    }
  }
  # namespace/name of the account of Kubeflow runs of the pipeline (kubernetes.tf), which
  # the stage role trusts too when var.kfp_namespace is set.
  kfp_run_accounts = local.kfp_enabled ? ["${var.kfp_namespace}/${var.kfp_service_account}"] : []
}

data "aws_iam_policy_document" "irsa_trust" {
  for_each = local.irsa

  statement {
    actions = ["sts:AssumeRoleWithWebIdentity"]
    principals {
      type        = "Federated"
      identifiers = [local.oidc_provider]
    }
    condition {
      test     = "StringEquals"
      variable = "${local.oidc_issuer}:sub"
      values   = [for sa in each.value.service_accounts : "system:serviceaccount:${var.namespace}:${sa}"]
    }
    condition {
      test     = "StringEquals"
      variable = "${local.oidc_issuer}:aud"
      values   = ["sts.amazonaws.com"]
    }
  }
  # The stage role only: the same statement for the Kubeflow run account, sub and aud pinned
  # alike (a statement of its own rather than a longer list above: checkov evaluates this
  # document, and expands local.irsa, only while those stay plain lists).
  dynamic "statement" {
    for_each = each.key == "stage" ? local.kfp_run_accounts : []
    content {
      actions = ["sts:AssumeRoleWithWebIdentity"]
      principals {
        type        = "Federated"
        identifiers = [local.oidc_provider]
      }
      condition {
        test     = "StringEquals"
        variable = "${local.oidc_issuer}:sub"
        values   = ["system:serviceaccount:${replace(statement.value, "/", ":")}"]
      }
      condition {
        test     = "StringEquals"
        variable = "${local.oidc_issuer}:aud"
        values   = ["sts.amazonaws.com"]
      }
    }
  }
}

data "aws_iam_policy_document" "irsa_access" {
  for_each = local.irsa

  statement {
    sid       = "ListOwnPrefixes"
    actions   = ["s3:ListBucket"]
    resources = [aws_s3_bucket.store.arn]
    condition {
      test     = "StringLike"
      variable = "s3:prefix"
      values   = flatten([for p in each.value.read_prefixes : [p, "${p}/*"]])
    }
  }
  statement {
    sid       = "Read"
    actions   = ["s3:GetObject", "s3:GetObjectVersion"]
    resources = [for p in each.value.read_prefixes : "${aws_s3_bucket.store.arn}/${p}/*"]
  }
  statement {
    sid       = "Write"
    actions   = ["s3:PutObject", "s3:DeleteObject", "s3:AbortMultipartUpload"]
    resources = [for p in each.value.write_prefixes : "${aws_s3_bucket.store.arn}/${p}/*"]
  }
  statement {
    sid       = "UseStoreKey"
    actions   = ["kms:Decrypt", "kms:Encrypt", "kms:GenerateDataKey"]
    resources = [aws_kms_key.store.arn]
  }
}

resource "aws_iam_role" "irsa" {
  for_each = local.irsa

  name               = "${var.name}-${each.key}"
  description        = "${var.name}: assumed by ${join(", ", concat([for sa in each.value.service_accounts : "${var.namespace}/${sa}"], each.key == "stage" ? local.kfp_run_accounts : []))}"
  assume_role_policy = data.aws_iam_policy_document.irsa_trust[each.key].json
}

resource "aws_iam_role_policy" "irsa" {
  for_each = local.irsa

  name   = "${var.name}-${each.key}-store"
  role   = aws_iam_role.irsa[each.key].id
  policy = data.aws_iam_policy_document.irsa_access[each.key].json
}
