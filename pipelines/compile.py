"""Compile the Kubeflow pipeline to the checked-in YAML.

    python pipelines/compile.py                                   # rewrite pipelines/post_training_iteration.yaml
    python pipelines/compile.py --image-prefix registry.example.com/ml/ --output /tmp/pti.yaml
    python pipelines/compile.py --config-map stage-env --s3-secret '' --gpu-node-selector '' --output /tmp/pti.yaml

The checked-in YAML uses unprefixed image names (``posttrain-<stage>:<version>``), as
``containers/build.sh`` tags them, and the names ``infra/terraform/`` creates (config map
``posttrain-stage-env``, GPU nodes labelled ``posttrain.io/pool=gpu``) plus the optional
secret ``posttrain-s3``; a cluster that differs compiles its own copy with the options
below. This writes a file and nothing else: it does not upload or
submit the pipeline (use the KFP UI or ``kfp.Client().create_run_from_pipeline_package``).
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from kfp import compiler

from components.core.errors import UserError
from pipelines.post_training_iteration import CONFIG_MAP, GPU_NODE_SELECTOR, S3_SECRET, make_pipeline

COMPILED = Path(__file__).resolve().parent / "post_training_iteration.yaml"


IMAGE_PREFIX = re.compile(r"[a-z0-9][a-z0-9._:/-]*/")
"""A registry prefix that an image reference can start with (Docker's references are lowercase)."""


def compile_pipeline(output: Path | str = COMPILED, image_prefix: str = "", config_map: str = CONFIG_MAP,
                     s3_secret: str = S3_SECRET, gpu_node_selector: str = GPU_NODE_SELECTOR) -> Path:
    pipeline = make_pipeline(image_prefix, config_map=config_map, s3_secret=s3_secret, gpu_node_selector=gpu_node_selector)
    compiler.Compiler().compile(pipeline_func=pipeline, package_path=str(output))
    return Path(output)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", default=str(COMPILED), help="YAML to write (default: %(default)s)")
    parser.add_argument("--image-prefix", default="", help="registry prefix for the stage images, ending in '/'")
    parser.add_argument("--config-map", default=CONFIG_MAP, help="config map with the stages' environment (default: %(default)s)")
    parser.add_argument("--s3-secret", default=S3_SECRET,
                        help="optional secret with AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY; '' for none (default: %(default)s)")
    parser.add_argument("--gpu-node-selector", default=GPU_NODE_SELECTOR,
                        help="key=value[,key=value] of the GPU nodes; '' for none (default: %(default)s)")
    args = parser.parse_args(argv)
    if args.image_prefix and not IMAGE_PREFIX.fullmatch(args.image_prefix):
        parser.error(f"--image-prefix={args.image_prefix!r}: not a registry path ending in '/' (lowercase letters, "
                     "digits, '.', '_', '-', ':' and '/'); e.g. registry.example.com/ml/")
    if not Path(args.output).resolve().parent.is_dir():
        parser.error(f"--output={args.output!r}: its folder does not exist; create it or write elsewhere")
    try:
        path = compile_pipeline(args.output, args.image_prefix, args.config_map, args.s3_secret, args.gpu_node_selector)
    except UserError as exc:  # a plug-in stage the pipeline cannot run
        parser.error(exc.line())
    except ValueError as exc:
        parser.error(str(exc))
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
