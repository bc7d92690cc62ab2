#!/usr/bin/env bash
# The one prepared GPU check (issue 20): run on a lent GPU machine from the repository root,
#   bash tests/gpu/check.sh
# It needs what a PyTorch CUDA image has (torch, numpy, pytest, hypothesis, rich; no streamlit)
# and no install of dplab: the package is put on PYTHONPATH from this checkout. One table at the end.
set -uo pipefail
cd "$(dirname "$0")/../.."
pkg="$(mktemp -d)"
trap 'rm -rf "$pkg"' EXIT
mkdir -p "$pkg/dplab"
for d in reference backends viz lessons; do ln -s "$PWD/$d" "$pkg/dplab/$d"; done
export PYTHONPATH="$pkg${PYTHONPATH:+:$PYTHONPATH}"
exec timeout 540 python tests/gpu/check.py "$@"
