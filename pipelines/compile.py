"""Compile the Kubeflow pipeline to the checked-in YAML.

    python pipelines/compile.py                                   # rewrite pipelines/post_training_iteration.yaml
    python pipelines/compile.py --image-prefix registry.example.com/ml/ --output /tmp/pti.yaml
    python pipelines/compile.py --config-map stage-env --s3-secret '' --gpu-node-selector '' --output /tmp/pti.yaml

The checked-in YAML uses unprefixed image names (``posttrain-<stage>:<version>``), as
``containers/build.sh`` tags them, and the names ``infra/terraform/`` creates (config map
``posttrain-stage-env``, GPU nodes labelled ``posttrain.io/pool=gpu``) plus the optional
secret ``posttrain-s3``; a cluster that differs compiles its own copy with the options
below. Each option is checked before anything is written, with the DAG's own checks of the
same settings (``dags/execution/cluster.py``'s ``check_config_map``, ``check_secret`` and
``parse_node_selector``, ``dags.execution.check_image_prefix``), given the option's value
(no environment variable is read or set): a bad one is one line naming the option and exit
2, as the DAG refuses ``POSTTRAIN_STAGE_CONFIGMAP``, ``POSTTRAIN_STAGE_SECRET``,
``POSTTRAIN_GPU_NODE_SELECTOR`` or ``POSTTRAIN_IMAGE_PREFIX``.
The YAML is written to a temporary file beside ``--output`` and renamed onto it, so an
interrupted compile leaves the old file whole. This writes a file and nothing else: it
does not upload or submit the pipeline (use the KFP UI or
``kfp.Client().create_run_from_pipeline_package``; infra/terraform/README.md says with
which namespace and service account).
"""

from __future__ import annotations

import argparse
import os
import re
import stat
import tempfile
from pathlib import Path

from kfp import compiler

from components import STAGES
from components.core.errors import UserError
from dags.execution import check_image_prefix, cluster
from pipelines.post_training_iteration import CONFIG_MAP, GPU_NODE_SELECTOR, S3_SECRET, make_pipeline

COMPILED = Path(__file__).resolve().parent / "post_training_iteration.yaml"
SUFFIXES = (".yaml", ".yml")  # kfp writes YAML by the name's suffix; its JSON cannot hold the platform settings


IMAGE_PREFIX = re.compile(r"[a-z0-9][a-z0-9._:/-]*/")
"""A registry prefix that an image reference can start with (Docker's references are lowercase)."""


def compile_pipeline(output: Path | str = COMPILED, image_prefix: str = "", config_map: str = CONFIG_MAP,
                     s3_secret: str = S3_SECRET, gpu_node_selector: str = GPU_NODE_SELECTOR) -> Path:
    """Compile to ``output`` (a .yaml file; a link's target is what gets replaced) through a
    temporary file in its folder, renamed onto it once complete; the file keeps its mode
    (a new one gets the umask's). A UserError for a bad name (``make_pipeline``)."""
    if not str(output).endswith(SUFFIXES):
        raise ValueError(f"{output}: the output must be a .yaml file")
    pipeline = make_pipeline(image_prefix, config_map=config_map, s3_secret=s3_secret, gpu_node_selector=gpu_node_selector)
    target = Path(output).resolve()
    fd, temporary = tempfile.mkstemp(prefix=f".{target.name}.", suffix=target.suffix, dir=target.parent)
    os.close(fd)
    try:
        compiler.Compiler().compile(pipeline_func=pipeline, package_path=temporary)
        os.chmod(temporary, _mode(target))
        os.replace(temporary, target)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    return Path(output)


def _mode(path: Path) -> int:
    """The permission bits a file written to ``path`` should have: those of the file there, or
    what ``open`` would give a new one (0o666 less the umask; mkstemp's are 0o600)."""
    try:
        return stat.S_IMODE(path.stat().st_mode)
    except FileNotFoundError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask


def _check_options(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Every option as the DAG checks the same setting (its check, given the option's value
    and name), one ``parser.error`` line naming the option (exit 2), before anything is written."""
    if args.image_prefix and not IMAGE_PREFIX.fullmatch(args.image_prefix):
        parser.error(f"--image-prefix={args.image_prefix!r}: not a registry path ending in '/' (lowercase letters, "
                     "digits, '.', '_', '-', ':' and '/'); e.g. registry.example.com/ml/")
    try:
        for stage in STAGES:  # plan, shards and hand-back run in taskgen's image
            check_image_prefix("--image-prefix", args.image_prefix, stage)
        cluster.check_config_map("--config-map", args.config_map)
        cluster.parse_node_selector("--gpu-node-selector", args.gpu_node_selector)
        cluster.check_secret("--s3-secret", args.s3_secret)
    except UserError as exc:
        parser.error(exc.line())
    output = Path(args.output)
    if output.is_dir():
        parser.error(f"--output={args.output!r}: is a folder; name the file to write in it, e.g. "
                     f"{str(output / COMPILED.name)!r}")
    if not output.resolve().parent.is_dir():
        parser.error(f"--output={args.output!r}: its folder does not exist; create it or write elsewhere")
    if not args.output.endswith(SUFFIXES):
        parser.error(f"--output={args.output!r}: not a .yaml file (kfp writes the pipeline as YAML by the name); "
                     "e.g. /tmp/pti.yaml")
    if output.exists() and not output.resolve().is_file():
        parser.error(f"--output={args.output!r}: not a regular file (it would be replaced); write to a file")


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
    _check_options(parser, args)
    try:
        path = compile_pipeline(args.output, args.image_prefix, args.config_map, args.s3_secret, args.gpu_node_selector)
    except UserError as exc:  # a plug-in stage the pipeline cannot run
        parser.error(exc.line())
    except OSError as exc:  # the folder is not writable, the disk is full
        parser.error(f"--output={args.output!r}: cannot write it: {exc.strerror or exc}")
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
