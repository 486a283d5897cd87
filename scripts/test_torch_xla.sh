#!/usr/bin/env bash
# Opt-in check of the DLPack bridge with PyTorch/XLA tensors (not part of CI).
#
# torch_xla pins its own torch (2.9) and jax (0.7.1), which conflict with this project's
# environment, so this builds a throwaway virtualenv (about 7 GB: torch 2.9's PyPI wheel is the
# CUDA build), installs this project into it *without* dependencies, and runs
# scripts/torch_xla_check.py on XLA:CPU (PJRT_DEVICE=CPU): both XLA routes of the bridge, DLPack
# (XLA:CPU/CUDA) and torch_xla's call_jax (TPU; forced onto XLA:CPU for the check).
#
#   scripts/test_torch_xla.sh            # build the venv if needed, then run the checks
#   TORCH_XLA_VENV=/path scripts/...     # venv location (default /tmp/ejkernel-torch-xla-venv)
#   REBUILD=1 scripts/test_torch_xla.sh  # start from a fresh venv
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${TORCH_XLA_VENV:-/tmp/ejkernel-torch-xla-venv}
PYTHON=${PYTHON:-python3.11}
TORCH_XLA_VERSION=${TORCH_XLA_VERSION:-2.9.0}
TORCH_VERSION=${TORCH_VERSION:-2.9.0}
JAX_VERSION=${JAX_VERSION:-0.7.1}

if [[ -n "${REBUILD:-}" ]]; then rm -rf "$VENV"; fi
if [[ ! -f "$VENV/.ready" ]]; then
  echo "== building $VENV (torch $TORCH_VERSION, torch_xla $TORCH_XLA_VERSION, jax $JAX_VERSION)"
  rm -rf "$VENV"
  "$PYTHON" -m venv "$VENV"
  # A machine-wide pip constraint file may cap or pin torch; this venv has its own pins.
  PIP_CONSTRAINT="" "$VENV/bin/pip" install --quiet --upgrade pip
  # flax: torchax (shipped in the torch_xla wheel, needed by its call_jax) imports it.
  PIP_CONSTRAINT="" "$VENV/bin/pip" install --quiet \
    "torch==$TORCH_VERSION" "torch_xla==$TORCH_XLA_VERSION" \
    "jax==$JAX_VERSION" "jaxlib==$JAX_VERSION" numpy flax
  touch "$VENV/.ready"
fi

echo "== installing this project without dependencies"
PIP_CONSTRAINT="" "$VENV/bin/pip" install --quiet --no-deps --force-reinstall "$ROOT"

echo "== versions"
"$VENV/bin/python" - <<'EOF'
import importlib.metadata as md
for name in ("torch", "torch_xla", "jax", "jaxlib", "numpy"):
    print(f"  {name:10s} {md.version(name)}")
EOF

echo "== running scripts/torch_xla_check.py on XLA:CPU"
cd /tmp  # import the installed package, not the checkout
PJRT_DEVICE=CPU JAX_PLATFORMS=cpu "$VENV/bin/python" "$ROOT/scripts/torch_xla_check.py"
