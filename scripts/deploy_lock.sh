#!/usr/bin/env bash
# Regenerate deploy/requirements-{cuda,cpu}.lock: every package the container
# image installs, pinned to one version with its PyPI sha256 hashes, so that
# `pip install --require-hashes` in deploy/Dockerfile refuses any file whose
# bytes differ from those resolved here (docs/operations.md, "Container image").
#
#   scripts/deploy_lock.sh            # needs the PyPI index; writes both locks
#
# The image is Linux x86_64 with Python 3.11 (deploy/Dockerfile's PYTHON_IMAGE),
# whatever this machine is. The cuda lock holds torch and torchvision from PyPI
# (with their CUDA runtime wheels); the cpu lock leaves out torch, torchvision
# and what only they pull in for CUDA, because the image installs that pair from
# PyTorch's CPU wheel index, pinned by version (not by hash: see the Dockerfile).
# uv does the resolving, from a throw-away virtual environment.
set -euo pipefail
cd "$(dirname "$0")/.."

dockerarg() { sed -n "s/^ARG $1=//p" deploy/Dockerfile | head -1; }
torch=$(dockerarg TORCH_VERSION)
torchvision=$(dockerarg TORCHVISION_VERSION)
[ -n "$torch" ] && [ -n "$torchvision" ] || { echo "deploy/Dockerfile has no TORCH_VERSION/TORCHVISION_VERSION" >&2; exit 1; }

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 -m venv "$work/venv"
"$work/venv/bin/pip" install --quiet --index-url https://pypi.org/simple uv
uv="$work/venv/bin/uv"

# What the image installs besides pyproject.toml's dependencies: the build
# backend for `pip install --no-build-isolation /src`, and the torch pair.
build=$(python3 -c 'import tomllib; print("\n".join(tomllib.load(open("pyproject.toml","rb"))["build-system"]["requires"]))')
printf '%s\ntorch==%s\ntorchvision==%s\n' "$build" "$torch" "$torchvision" > "$work/image.in"

compile() {
  "$uv" pip compile pyproject.toml "$work/image.in" \
    --python-version 3.11 --python-platform x86_64-manylinux_2_28 \
    --index-url https://pypi.org/simple --generate-hashes --no-header --annotate \
    "$@"
}
compile -o "$work/cuda.lock"
only_torch=$(grep -oE '^(torch|torchvision|triton|nvidia-[a-z0-9-]+|cuda-[a-z0-9-]+)==' "$work/cuda.lock" | sed 's/==$//')
excl=()
for name in $only_torch; do excl+=(--no-emit-package "$name"); done
compile "${excl[@]}" -o "$work/cpu.lock"

for variant in cuda cpu; do
  {
    echo "# deploy/requirements-$variant.lock: written by scripts/deploy_lock.sh, do not edit."
    echo "# Linux x86_64, Python 3.11; torch $torch, torchvision $torchvision."
    cat "$work/$variant.lock"
  } > "deploy/requirements-$variant.lock"
  echo "deploy/requirements-$variant.lock: $(grep -c '==' "deploy/requirements-$variant.lock") packages"
done
