# The MLflow tracking server: one Deployment running `mlflow server` from the posttrain
# base image (the clients' MLflow version, plus boto3 and psycopg2), proxying artifacts
# to s3://<bucket>/mlflow-artifacts under its own IRSA role. Backend store:
#   sqlite   - a file on a persistent volume; one replica, Recreate on update
#   postgres - an RDS instance created here (Multi-AZ, encrypted, TLS only)

locals {
  mlflow_host     = "mlflow.${var.namespace}.svc.cluster.local"
  mlflow_uri      = "http://${local.mlflow_host}:5000"
  mlflow_postgres = var.mlflow_database == "postgres"
  mlflow_hosts = join(",", flatten([
    for h in ["mlflow", "mlflow.${var.namespace}", "mlflow.${var.namespace}.svc", local.mlflow_host, "localhost"] : [h, "${h}:5000"]
  ]))
  cpu_pool = var.create_node_groups ? { "posttrain.io/pool" = "cpu" } : {}
}

# ---- optional RDS backend --------------------------------------------------------

resource "random_password" "mlflow_db" {
  count   = local.mlflow_postgres ? 1 : 0
  length  = 32
  special = false
}

resource "aws_db_subnet_group" "mlflow" {
  count      = local.mlflow_postgres ? 1 : 0
  name       = "${var.name}-mlflow"
  subnet_ids = var.subnet_ids
}

resource "aws_security_group" "mlflow_db" {
  count       = local.mlflow_postgres ? 1 : 0
  name        = "${var.name}-mlflow-db"
  description = "${var.name}: Postgres for MLflow, reachable from the cluster only"
  vpc_id      = data.aws_eks_cluster.this.vpc_config[0].vpc_id

  ingress {
    description     = "Postgres from the EKS cluster security group"
    from_port       = 5432
    to_port         = 5432
    protocol        = "tcp"
    security_groups = [data.aws_eks_cluster.this.vpc_config[0].cluster_security_group_id]
  }
}

resource "aws_db_parameter_group" "mlflow" {
  count  = local.mlflow_postgres ? 1 : 0
  name   = "${var.name}-mlflow-pg16"
  family = "postgres16"

  parameter {
    name  = "rds.force_ssl"
    value = "1"
  }
  parameter {
    name  = "log_statement"
    value = "ddl"
  }
  parameter {
    name  = "log_min_duration_statement"
    value = "1000"
  }
}

resource "aws_db_instance" "mlflow" {
  #checkov:skip=CKV_AWS_118:Enhanced monitoring needs its own IAM role; Performance Insights and exported logs cover MLflow's small database.
  count = local.mlflow_postgres ? 1 : 0

  identifier                          = "${var.name}-mlflow"
  engine                              = "postgres"
  engine_version                      = "16"
  instance_class                      = var.mlflow_db_instance_class
  allocated_storage                   = 20
  max_allocated_storage               = 200
  storage_type                        = "gp3"
  storage_encrypted                   = true
  kms_key_id                          = aws_kms_key.store.arn
  db_name                             = "mlflow"
  username                            = "mlflow"
  password                            = random_password.mlflow_db[0].result
  db_subnet_group_name                = aws_db_subnet_group.mlflow[0].name
  vpc_security_group_ids              = [aws_security_group.mlflow_db[0].id]
  parameter_group_name                = aws_db_parameter_group.mlflow[0].name
  multi_az                            = true
  publicly_accessible                 = false
  iam_database_authentication_enabled = true
  backup_retention_period             = 7
  copy_tags_to_snapshot               = true
  deletion_protection                 = true
  skip_final_snapshot                 = false
  final_snapshot_identifier           = "${var.name}-mlflow-final"
  auto_minor_version_upgrade          = true
  performance_insights_enabled        = true
  performance_insights_kms_key_id     = aws_kms_key.store.arn
  enabled_cloudwatch_logs_exports     = ["postgresql", "upgrade"]
}

resource "kubernetes_secret_v1" "mlflow_db" {
  count = local.mlflow_postgres ? 1 : 0
  metadata {
    name      = "mlflow-backend-store"
    namespace = kubernetes_namespace_v1.posttrain.metadata[0].name
  }
  data = {
    uri = "postgresql://mlflow:${random_password.mlflow_db[0].result}@${aws_db_instance.mlflow[0].endpoint}/mlflow?sslmode=require"
  }
}

# ---- sqlite backend --------------------------------------------------------------

resource "kubernetes_persistent_volume_claim_v1" "mlflow" {
  count = local.mlflow_postgres ? 0 : 1
  metadata {
    name      = "mlflow-backend-store"
    namespace = kubernetes_namespace_v1.posttrain.metadata[0].name
  }
  spec {
    access_modes       = ["ReadWriteOnce"]
    storage_class_name = var.mlflow_storage_class
    resources {
      requests = { storage = "20Gi" }
    }
  }
  wait_until_bound = false # gp3 binds when the pod is scheduled
}

# ---- the server ------------------------------------------------------------------

resource "kubernetes_service_account_v1" "mlflow" {
  metadata {
    name        = "mlflow"
    namespace   = kubernetes_namespace_v1.posttrain.metadata[0].name
    annotations = { "eks.amazonaws.com/role-arn" = aws_iam_role.irsa["mlflow"].arn }
  }
  automount_service_account_token = false
}

resource "kubernetes_deployment_v1" "mlflow" {
  #checkov:skip=CKV_K8S_43:The image is pinned by its release tag (image_version), which containers/build.sh and the KFP pipeline share; digests change per build.
  metadata {
    name      = "mlflow"
    namespace = kubernetes_namespace_v1.posttrain.metadata[0].name
    labels    = { "app.kubernetes.io/name" = "mlflow" }
  }

  spec {
    replicas = local.mlflow_postgres ? 2 : 1
    selector {
      match_labels = { "app.kubernetes.io/name" = "mlflow" }
    }
    strategy {
      # a ReadWriteOnce volume cannot be attached to the old and the new pod at once
      type = local.mlflow_postgres ? "RollingUpdate" : "Recreate"
    }

    template {
      metadata {
        labels = { "app.kubernetes.io/name" = "mlflow" }
      }

      spec {
        service_account_name            = kubernetes_service_account_v1.mlflow.metadata[0].name
        automount_service_account_token = false
        node_selector                   = local.cpu_pool

        security_context {
          run_as_non_root = true
          run_as_user     = 10001
          run_as_group    = 10001
          fs_group        = 10001
          seccomp_profile {
            type = "RuntimeDefault"
          }
        }

        container {
          name              = "mlflow"
          image             = "${var.image_prefix}posttrain-base:${var.image_version}"
          image_pull_policy = "Always"
          command           = ["mlflow", "server"]
          args = [
            "--host", "0.0.0.0",
            "--port", "5000",
            "--workers", "2",
            "--backend-store-uri", local.mlflow_postgres ? "$(MLFLOW_BACKEND_STORE_URI)" : "sqlite:////mlflow/mlflow.db",
            "--artifacts-destination", "s3://${aws_s3_bucket.store.bucket}/${local.mlflow_artifacts}",
            "--allowed-hosts", local.mlflow_hosts,
          ]

          env {
            name  = "AWS_REGION"
            value = var.region
          }
          env {
            name  = "HOME"
            value = "/tmp"
          }
          dynamic "env" {
            for_each = local.mlflow_postgres ? [1] : []
            content {
              name = "MLFLOW_BACKEND_STORE_URI"
              value_from {
                secret_key_ref {
                  name = kubernetes_secret_v1.mlflow_db[0].metadata[0].name
                  key  = "uri"
                }
              }
            }
          }

          port {
            name           = "http"
            container_port = 5000
          }

          readiness_probe {
            http_get {
              path = "/health"
              port = "http"
            }
            period_seconds = 10
          }
          liveness_probe {
            http_get {
              path = "/health"
              port = "http"
            }
            initial_delay_seconds = 30
            period_seconds        = 20
          }

          resources {
            requests = { cpu = "500m", memory = "1Gi" }
            limits   = { cpu = "2", memory = "4Gi" }
          }

          security_context {
            allow_privilege_escalation = false
            read_only_root_filesystem  = true
            privileged                 = false
            capabilities {
              drop = ["ALL"]
            }
          }

          volume_mount {
            name       = "tmp"
            mount_path = "/tmp"
          }
          dynamic "volume_mount" {
            for_each = local.mlflow_postgres ? [] : [1]
            content {
              name       = "backend-store"
              mount_path = "/mlflow"
            }
          }
        }

        volume {
          name = "tmp"
          empty_dir {}
        }
        dynamic "volume" {
          for_each = local.mlflow_postgres ? [] : [1]
          content {
            name = "backend-store"
            persistent_volume_claim {
              claim_name = kubernetes_persistent_volume_claim_v1.mlflow[0].metadata[0].name
            }
          }
        }
      }
    }
  }
}

resource "kubernetes_service_v1" "mlflow" {
  metadata {
    name      = "mlflow"
    namespace = kubernetes_namespace_v1.posttrain.metadata[0].name
  }
  spec {
    selector = { "app.kubernetes.io/name" = "mlflow" }
    port {
      name        = "http"
      port        = 5000
      target_port = "http"
    }
  }
}
