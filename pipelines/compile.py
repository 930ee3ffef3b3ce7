"""Compile the Kubeflow pipeline to the checked-in YAML.

    python pipelines/compile.py                                   # rewrite pipelines/post_training_iteration.yaml
    python pipelines/compile.py --image-prefix registry.example.com/ml/ --output /tmp/pti.yaml

The checked-in YAML uses unprefixed image names (``posttrain-<stage>:<version>``), as
``containers/build.sh`` tags them; a cluster that pulls from a registry compiles its own
copy with ``--image-prefix``. This writes a file and nothing else: it does not upload or
submit the pipeline (use the KFP UI or ``kfp.Client().create_run_from_pipeline_package``).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from kfp import compiler

from pipelines.post_training_iteration import make_pipeline

COMPILED = Path(__file__).resolve().parent / "post_training_iteration.yaml"


def compile_pipeline(output: Path | str = COMPILED, image_prefix: str = "") -> Path:
    compiler.Compiler().compile(pipeline_func=make_pipeline(image_prefix), package_path=str(output))
    return Path(output)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", default=str(COMPILED), help="YAML to write (default: %(default)s)")
    parser.add_argument("--image-prefix", default="", help="registry prefix for the stage images, ending in '/'")
    args = parser.parse_args(argv)
    print(compile_pipeline(args.output, args.image_prefix))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
