# Two managed node groups on the existing cluster, created when var.create_node_groups:
#   cpu - taskgen, sandbox, reward, validation, MLflow and Airflow
#   gpu - bootstrap, rollout, trainer and evaluation (the stages with gpus > 0 in
#         components/core/stages.py); tainted so only pods that tolerate
#         nvidia.com/gpu land there, and able to scale to zero between iterations.
# The sandbox needs unprivileged user namespaces (bubblewrap); AL2023 allows them by default.

locals {
  pools = var.create_node_groups ? {
    cpu = {
      ami_type       = "AL2023_x86_64_STANDARD"
      instance_types = var.cpu_instance_types
      scaling        = var.cpu_scaling
      disk_size      = 100
      taints         = []
    }
    gpu = {
      ami_type       = "AL2023_x86_64_NVIDIA"
      instance_types = var.gpu_instance_types
      scaling        = var.gpu_scaling
      disk_size      = 200
      taints         = [{ key = "nvidia.com/gpu", value = "true", effect = "NO_SCHEDULE" }]
    }
  } : {}
  node_policies = toset(["AmazonEKSWorkerNodePolicy", "AmazonEKS_CNI_Policy", "AmazonEC2ContainerRegistryReadOnly"])
}

data "aws_iam_policy_document" "node_trust" {
  statement {
    actions = ["sts:AssumeRole"]
    principals {
      type        = "Service"
      identifiers = ["ec2.amazonaws.com"]
    }
  }
}

resource "aws_iam_role" "node" {
  count = var.create_node_groups ? 1 : 0

  name               = "${var.name}-node"
  description        = "${var.name}: EKS worker nodes of the cpu and gpu pools"
  assume_role_policy = data.aws_iam_policy_document.node_trust.json
}

resource "aws_iam_role_policy_attachment" "node" {
  for_each = var.create_node_groups ? local.node_policies : toset([])

  role       = aws_iam_role.node[0].name
  policy_arn = "arn:${data.aws_partition.current.partition}:iam::aws:policy/${each.value}"
}

resource "aws_launch_template" "pool" {
  for_each = local.pools

  name_prefix = "${var.name}-${each.key}-"
  description = "${var.name}: ${each.key} pool nodes (IMDSv2 only, encrypted root volume)"

  metadata_options {
    http_endpoint               = "enabled"
    http_tokens                 = "required"
    http_put_response_hop_limit = 1
  }

  block_device_mappings {
    device_name = "/dev/xvda"
    ebs {
      volume_size           = each.value.disk_size
      volume_type           = "gp3"
      encrypted             = true
      delete_on_termination = true
    }
  }
}

resource "aws_eks_node_group" "pool" {
  for_each = local.pools

  cluster_name    = var.cluster_name
  node_group_name = "${var.name}-${each.key}"
  node_role_arn   = aws_iam_role.node[0].arn
  subnet_ids      = var.subnet_ids
  ami_type        = each.value.ami_type
  capacity_type   = "ON_DEMAND"
  instance_types  = each.value.instance_types

  launch_template {
    id      = aws_launch_template.pool[each.key].id
    version = aws_launch_template.pool[each.key].latest_version
  }

  scaling_config {
    min_size     = each.value.scaling.min
    desired_size = each.value.scaling.desired
    max_size     = each.value.scaling.max
  }

  update_config {
    max_unavailable = 1
  }

  labels = { "posttrain.io/pool" = each.key }

  dynamic "taint" {
    for_each = each.value.taints
    content {
      key    = taint.value.key
      value  = taint.value.value
      effect = taint.value.effect
    }
  }

  lifecycle {
    # the cluster autoscaler owns the current size
    ignore_changes = [scaling_config[0].desired_size]

    precondition {
      condition     = length(var.subnet_ids) > 0
      error_message = "subnet_ids is empty: node groups need the cluster's private subnets (or set create_node_groups = false)."
    }
  }

  depends_on = [aws_iam_role_policy_attachment.node]
}
