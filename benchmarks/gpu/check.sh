#!/usr/bin/env bash
# One iteration of SmolLM2-135M on one GPU: vLLM rollout and a bf16 FSDP2 trainer; prints
# rollout and trainer tokens/s and the trainer's MFU (benchmarks/gpu/check.py), then runs
# the `gpu`-marked tests. Needs a CUDA machine; the venv gets vLLM beside posttrain
# (VLLM_SPEC overrides the requirement, e.g. a version built for this torch).
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV="${VENV:-.venv}"
make setup models VENV="$VENV"
"$VENV/bin/python" -c 'import vllm' 2>/dev/null || "$VENV/bin/pip" install -q "${VLLM_SPEC:-vllm}"
"$VENV/bin/python" benchmarks/gpu/check.py "$@"
"$VENV/bin/python" -m pytest -q -m gpu
