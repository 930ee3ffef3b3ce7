#!/usr/bin/env bash
# Regenerate containers/constraints.txt, the image's lock, from the venv the tests run in
# (PYTHON, default .venv/bin/python). Run it after pyproject.toml's pins move and
# `make setup CONSTRAINTS=` installed them without the old lock; tests/containers/test_lock.py fails until then.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-.venv/bin/python}"
tmp="$(mktemp containers/constraints.txt.XXXXXX)"
trap 'rm -f "$tmp"' EXIT
"$PYTHON" containers/lock.py >"$tmp"
chmod 644 "$tmp"
mv "$tmp" containers/constraints.txt
trap - EXIT
echo "containers/constraints.txt: $(grep -c '==' containers/constraints.txt) packages pinned"
