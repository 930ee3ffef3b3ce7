# Two managed node groups on the existing cluster, created when var.create_node_groups:
#   cpu - taskgen, sandbox, reward, validation, MLflow and Airflow
#   gpu - bootstrap, rollout, trainer and evaluation (the stages with gpus > 0 in
#         components/core/stages.py); tainted so only pods that tolerate
#         nvidia.com/gpu land there, and able to scale to zero between iterations.
# The sandbox needs unprivileged user namespaces (bubblewrap); AL2023 allows them by default.
# Nothing here changes a pool's size: a node autoscaler on the cluster does (README: GPU
# pool), and the gpu pool starts at zero nodes.

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

  # The Cluster Autoscaler's node-template tags on each pool's Auto Scaling group: the
  # label and taints a new node of the pool will have. At zero nodes it has no node to
  # copy them from, and without them (or eks:DescribeNodegroup) it finds no group whose
  # nodes fit a pod that selects posttrain.io/pool=gpu, so it never scales the pool up.
  taint_effects = { NO_SCHEDULE = "NoSchedule", NO_EXECUTE = "NoExecute", PREFER_NO_SCHEDULE = "PreferNoSchedule" }
  autoscaler_tags = merge({}, [for pool, p in local.pools : merge(
    { "${pool}/label/posttrain.io/pool" = { pool = pool, key = "k8s.io/cluster-autoscaler/node-template/label/posttrain.io/pool", value = pool } },
    { for t in p.taints : "${pool}/taint/${t.key}" => {
      pool  = pool
      key   = "k8s.io/cluster-autoscaler/node-template/taint/${t.key}"
      value = "${t.value}:${local.taint_effects[t.effect]}"
    } },
  )]...)
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

# Tags on the Auto Scaling group EKS made for each managed node group (a node group's own
# tags do not reach it); not copied to the instances.
resource "aws_autoscaling_group_tag" "node_template" {
  for_each = local.autoscaler_tags

  autoscaling_group_name = aws_eks_node_group.pool[each.value.pool].resources[0].autoscaling_groups[0].name

  tag {
    key                 = each.value.key
    value               = each.value.value
    propagate_at_launch = false
  }
}
