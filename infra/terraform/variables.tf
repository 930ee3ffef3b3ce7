variable "name" {
  description = "Deployment name: prefixes the bucket, IAM role, node groups and Kubernetes namespace."
  type        = string
  default     = "posttrain"

  validation {
    condition     = can(regex("^[a-z][a-z0-9-]{1,30}[a-z0-9]$", var.name))
    error_message = "name must be 3-32 characters of lowercase letters, digits and '-', starting with a letter."
  }
}

variable "region" {
  description = "AWS region of the cluster and the bucket."
  type        = string
  default     = "us-east-1"
}

variable "tags" {
  description = "Extra tags for every AWS resource."
  type        = map(string)
  default     = {}
}

variable "cluster_name" {
  description = "Name of the existing EKS cluster (with an IAM OIDC provider registered for IRSA)."
  type        = string
}

variable "subnet_ids" {
  description = "Private subnets for the node groups and the optional RDS instance."
  type        = list(string)
  default     = []
}

variable "create_node_groups" {
  description = "Create the CPU and GPU managed node groups; false when the cluster already has pools for the stages."
  type        = bool
  default     = true
}

variable "cpu_instance_types" {
  description = "Instance types of the CPU pool (taskgen, sandbox, reward, validation, orchestrator, MLflow)."
  type        = list(string)
  default     = ["m6i.2xlarge"]
}

variable "cpu_scaling" {
  description = "min, desired and max size of the CPU pool."
  type        = object({ min = number, desired = number, max = number })
  default     = { min = 1, desired = 2, max = 10 }
}

variable "gpu_instance_types" {
  description = "Instance types of the GPU pool (bootstrap, rollout, trainer, evaluation: the stages with gpus > 0 in the stage registry)."
  type        = list(string)
  default     = ["g5.2xlarge"]
}

variable "gpu_scaling" {
  description = "min, desired and max size of the GPU pool; min 0 lets it scale to zero between iterations, which needs a node autoscaler on the cluster (README: GPU pool) to scale it up again."
  type        = object({ min = number, desired = number, max = number })
  default     = { min = 0, desired = 0, max = 4 }
}

variable "namespace" {
  description = "Kubernetes namespace for the stage pods, MLflow and Airflow."
  type        = string
  default     = "posttrain"
}

variable "stage_configmap" {
  description = "Config map with the stage pods' environment (POSTTRAIN_RUN_ROOT, MLFLOW_TRACKING_URI, AWS_REGION): POSTTRAIN_STAGE_CONFIGMAP."
  type        = string
  default     = "posttrain-stage-env"
}

variable "sandbox_runtime_class" {
  description = "RuntimeClass of the sandboxed stages' pods (bootstrap, rollout, sandbox, evaluation), e.g. \"gvisor\"; it must exist on the cluster. Empty: the default runtime."
  type        = string
  default     = ""
}

variable "gpu_node_selector" {
  description = "Node selector of the GPU stages' pods, key=value[,key=value]; the default matches the gpu pool created here. Empty: none (the nvidia.com/gpu toleration and limit still apply)."
  type        = string
  default     = "posttrain.io/pool=gpu"
}

variable "recipe" {
  description = "POSTTRAIN_RECIPE: the recipe every scheduled run uses, a path inside posttrain-base (/opt/posttrain/recipes/...) or an s3:// URI in the bucket."
  type        = string
  default     = "/opt/posttrain/recipes/demo.yaml"
}

variable "stage_service_account" {
  description = "Kubernetes service account the stage pods run as; IRSA binds it to the stage IAM role."
  type        = string
  default     = "posttrain-stage"
}

variable "kfp_namespace" {
  description = "Namespace Kubeflow Pipelines runs the pipeline in, which must exist and not be var.namespace: a Kubeflow Profile's namespace (multi-user KFP) or KFP's own, e.g. kubeflow (standalone KFP). The run service account, its Role and a copy of the stage config map go there. Empty: no Kubeflow setup."
  type        = string
  default     = ""

  validation {
    condition     = var.kfp_namespace == "" || can(regex("^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$", var.kfp_namespace))
    error_message = "kfp_namespace must be a Kubernetes namespace name (at most 63 lowercase letters, digits and '-') or empty."
  }
}

variable "kfp_service_account" {
  description = "Service account Kubeflow runs of the pipeline are submitted with (create_run_from_pipeline_package(..., service_account=...)), in var.kfp_namespace: its token mounted for KFP's driver and launcher and Argo's executor; IRSA binds it to the stage IAM role."
  type        = string
  default     = "posttrain-kfp"
}

variable "store_prefix" {
  description = "Key prefix of the run root inside the bucket: POSTTRAIN_RUN_ROOT = s3://<bucket>/<store_prefix>."
  type        = string
  default     = "store"
}

variable "noncurrent_version_days" {
  description = "Days a replaced or deleted object version is kept before it expires."
  type        = number
  default     = 30
}

variable "image_prefix" {
  description = "Registry prefix of the posttrain images, ending in '/', e.g. 123456789012.dkr.ecr.us-east-1.amazonaws.com/ (containers/build.sh PREFIX)."
  type        = string
}

variable "image_version" {
  description = "Tag of the posttrain images (project.version in pyproject.toml): POSTTRAIN_IMAGE_TAG for the stage pods, and the tag of the posttrain-base image Airflow and MLflow run."
  type        = string
  default     = "0.1.0"
}

variable "schedule" {
  description = "POSTTRAIN_SCHEDULE for the DAG: a cron expression, a preset (@daily, @continuous), asset:champion, or empty for manual runs."
  type        = string
  default     = "0 2 * * *"
}

variable "mlflow_database" {
  description = "MLflow backend store: \"sqlite\" (a file on a persistent volume, one replica) or \"postgres\" (an RDS instance created here)."
  type        = string
  default     = "sqlite"

  validation {
    condition     = contains(["sqlite", "postgres"], var.mlflow_database)
    error_message = "mlflow_database must be \"sqlite\" or \"postgres\"."
  }
}

variable "mlflow_db_instance_class" {
  description = "RDS instance class when mlflow_database = \"postgres\"."
  type        = string
  default     = "db.t4g.medium"
}

variable "mlflow_storage_class" {
  description = "StorageClass of the MLflow volume when mlflow_database = \"sqlite\"."
  type        = string
  default     = "gp3"
}

variable "airflow_chart_version" {
  description = "Version of the official Apache Airflow Helm chart."
  type        = string
  default     = "1.22.0"
}

variable "airflow_image" {
  description = "The official Airflow image that runs the metadata-database migrations (the components run posttrain-base); its tag must be the Airflow version installed in posttrain-base."
  type        = object({ repository = string, tag = string })
  default     = { repository = "apache/airflow", tag = "3.3.2" }
}
