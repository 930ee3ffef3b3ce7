# The object store: one private, versioned, KMS-encrypted bucket. The run root lives
# under var.store_prefix (stage outputs, checkpoints), MLflow's artifacts under
# mlflow-artifacts/.

locals {
  bucket_name      = "${var.name}-${data.aws_caller_identity.current.account_id}-${var.region}"
  mlflow_artifacts = "mlflow-artifacts"
  run_root         = "s3://${aws_s3_bucket.store.bucket}/${var.store_prefix}"
}

data "aws_iam_policy_document" "store_key" {
  #checkov:skip=CKV_AWS_109:A key policy's "*" resource is the key itself; this is AWS's default statement delegating access to IAM policies.
  #checkov:skip=CKV_AWS_111:Same statement: the account root administers its own key, as in AWS's default key policy.
  #checkov:skip=CKV_AWS_356:Same statement: "*" in a key policy cannot name any resource but this key.
  statement {
    sid       = "AccountAdministers"
    actions   = ["kms:*"]
    resources = ["*"]
    principals {
      type        = "AWS"
      identifiers = ["arn:${data.aws_partition.current.partition}:iam::${data.aws_caller_identity.current.account_id}:root"]
    }
  }
}

resource "aws_kms_key" "store" {
  description             = "${var.name}: encrypts the posttrain object store"
  enable_key_rotation     = true
  deletion_window_in_days = 30
  policy                  = data.aws_iam_policy_document.store_key.json
}

resource "aws_kms_alias" "store" {
  name          = "alias/${var.name}-store"
  target_key_id = aws_kms_key.store.key_id
}

resource "aws_s3_bucket" "store" {
  #checkov:skip=CKV_AWS_144:Cross-region replication doubles storage cost; checkpoints are reproducible from seeds and versioning covers accidental deletes.
  #checkov:skip=CKV_AWS_18:Access logging needs a second log bucket; CloudTrail data events are the audit trail where required.
  #checkov:skip=CKV2_AWS_62:No consumer of object events; stages find new data through manifests, not notifications.
  bucket = local.bucket_name
}

resource "aws_s3_bucket_ownership_controls" "store" {
  bucket = aws_s3_bucket.store.id
  rule {
    object_ownership = "BucketOwnerEnforced"
  }
}

resource "aws_s3_bucket_public_access_block" "store" {
  bucket                  = aws_s3_bucket.store.id
  block_public_acls       = true
  block_public_policy     = true
  ignore_public_acls      = true
  restrict_public_buckets = true
}

resource "aws_s3_bucket_versioning" "store" {
  bucket = aws_s3_bucket.store.id
  versioning_configuration {
    status = "Enabled"
  }
}

resource "aws_s3_bucket_server_side_encryption_configuration" "store" {
  bucket = aws_s3_bucket.store.id
  rule {
    apply_server_side_encryption_by_default {
      sse_algorithm     = "aws:kms"
      kms_master_key_id = aws_kms_key.store.arn
    }
    bucket_key_enabled = true
  }
}

resource "aws_s3_bucket_lifecycle_configuration" "store" {
  bucket = aws_s3_bucket.store.id

  rule {
    id     = "expire-old-versions"
    status = "Enabled"
    filter {}
    noncurrent_version_expiration {
      noncurrent_days = var.noncurrent_version_days
    }
    abort_incomplete_multipart_upload {
      days_after_initiation = 7
    }
  }

  depends_on = [aws_s3_bucket_versioning.store]
}

data "aws_iam_policy_document" "store_tls_only" {
  statement {
    sid       = "DenyInsecureTransport"
    effect    = "Deny"
    actions   = ["s3:*"]
    resources = [aws_s3_bucket.store.arn, "${aws_s3_bucket.store.arn}/*"]
    principals {
      type        = "*"
      identifiers = ["*"]
    }
    condition {
      test     = "Bool"
      variable = "aws:SecureTransport"
      values   = ["false"]
    }
  }
}

resource "aws_s3_bucket_policy" "store" {
  bucket     = aws_s3_bucket.store.id
  policy     = data.aws_iam_policy_document.store_tls_only.json
  depends_on = [aws_s3_bucket_public_access_block.store]
}
