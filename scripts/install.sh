#!/usr/bin/env bash
# Installs everything hookwidget needs on a fresh Debian machine: Debian's chromium (browser tests),
# the node modules (front-end build and vitest), and a virtual environment .venv with torch 2.13.0 (CPU)
# and hookwidget in editable mode with its test and benchmark extras.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v chromium >/dev/null 2>&1; then
  sudo=""; [ "$(id -u)" = 0 ] || sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq chromium >/dev/null
fi

npm ci --no-audit --no-fund
npm run build

[ -x .venv/bin/python ] || python3 -m venv .venv
# torch first and pinned: a bare "torch" requirement would pull a multi-GB CUDA build.
.venv/bin/pip install -q --disable-pip-version-check torch==2.13.0
.venv/bin/pip install -q --disable-pip-version-check -e ".[dev]" "torch==2.13.0"
# BackPACK (benchmarks) requires torchvision, which it uses only in backpack/utils/examples.py; pip would
# take a CUDA torchvision from PyPI that cannot import beside the CPU torch (and breaks packages that
# try it, e.g. transformers). So BackPACK comes without dependencies, and its real ones beside the pinned torch.
.venv/bin/pip install -q --disable-pip-version-check --no-deps "backpack-for-pytorch>=1.6,<2"
.venv/bin/pip install -q --disable-pip-version-check "einops>=0.3,<1" "unfoldNd>=0.2,<1" "torch==2.13.0"
if .venv/bin/pip show -q torchvision >/dev/null 2>&1; then  # pulled in by an older pyproject's bench extra
  .venv/bin/pip uninstall -q -y torchvision
fi
.venv/bin/python -c "import backpack, torchlens, opacus" || { echo "install: benchmark packages do not import" >&2; exit 1; }
# torchvision and timm, for the zoo of real models (tests/zoo_real.py). PyPI's torchvision for Linux is a CUDA build:
# its extension (detection ops only) cannot load beside the CPU torch, and `import torchvision` then stops at
# "operator torchvision::nms does not exist"; in site-packages it would also break transformers, which imports any
# torchvision it finds. So both go, without dependencies, into .venv/vision-packages, outside site-packages:
# tests/vision_shim.py puts that folder on sys.path and defines the two op schemas the import needs. torchvision
# 0.28.0 is the release built for torch 2.13.0; their real dependencies come beside the pinned torch.
.venv/bin/pip install -q --disable-pip-version-check --no-deps --upgrade --target .venv/vision-packages \
  "torchvision==0.28.0" "timm==1.0.31"
.venv/bin/pip install -q --disable-pip-version-check numpy pillow pyyaml huggingface_hub safetensors "torch==2.13.0"
.venv/bin/python -c "import sys; sys.path.insert(0, 'tests'); import vision_shim; vision_shim.import_timm()" \
  || { echo "install: torchvision/timm do not import through tests/vision_shim.py" >&2; exit 1; }
cuda_packages=$(.venv/bin/pip list --disable-pip-version-check 2>/dev/null | grep -iE '^(nvidia-|cuda-|triton )' || true)
if [ -n "$cuda_packages" ]; then
  echo "install: CUDA packages came in beside the CPU torch: $(echo "$cuda_packages" | awk '{print $1}' | tr '\n' ' ')" >&2
  exit 1
fi
echo "install: done ($(.venv/bin/python -c 'import torch, hookwidget; print("torch", torch.__version__, "hookwidget", hookwidget.__version__)'))"
