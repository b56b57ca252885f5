#!/usr/bin/env bash
# Build Horovod 0.28.1 (the last release) against the torch already in the venv, and cache
# the wheel keyed by torch version so a second set-up installs it in seconds.
# 0.28.1's CMake asks for C++14, which torch >= 2.1 headers reject: we patch it to C++17.
# pip's cmake 4.x rejects gloo's old cmake_minimum_required, so the system cmake is used.
set -euo pipefail
PY=$(realpath -s "${PY:-.venv/bin/python}")
HVD_VERSION=0.28.1
CACHE=${HOROVOD_WHEEL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/orchestrator/horovod}

if "$PY" -c "import horovod.torch as hvd; hvd.init(); hvd.shutdown()" >/dev/null 2>&1; then
  echo "horovod: already installed and working"
  exit 0
fi

TORCH_TAG=$("$PY" -c "import torch,sys; print(torch.__version__.replace('+','_') + '-py%d%d' % sys.version_info[:2])")
WHEEL_DIR="$CACHE/$TORCH_TAG"
if ls "$WHEEL_DIR"/horovod-*.whl >/dev/null 2>&1; then
  echo "horovod: installing cached wheel for torch $TORCH_TAG"
  "$PY" -m pip install -q --no-deps --force-reinstall "$WHEEL_DIR"/horovod-*.whl
else
  command -v cmake >/dev/null || { echo "horovod: needs cmake >= 3.13 (apt-get install cmake)" >&2; exit 1; }
  command -v g++ >/dev/null || { echo "horovod: needs a C++ compiler (apt-get install g++)" >&2; exit 1; }
  echo "horovod: building $HVD_VERSION against torch $TORCH_TAG (a few minutes, once)"
  BUILD=$(mktemp -d)
  trap 'rm -rf "$BUILD"' EXIT
  "$PY" -m pip download -q --no-deps --no-binary=:all: "horovod==$HVD_VERSION" -d "$BUILD"
  tar -xzf "$BUILD"/horovod-$HVD_VERSION.tar.gz -C "$BUILD"
  SRC="$BUILD/horovod-$HVD_VERSION"
  sed -i 's/CMAKE_CXX_STANDARD 14/CMAKE_CXX_STANDARD 17/' "$SRC/CMakeLists.txt" "$SRC/horovod/torch/CMakeLists.txt"
  grep -q "CMAKE_CXX_STANDARD 17" "$SRC/horovod/torch/CMakeLists.txt" || { echo "horovod: C++17 patch did not apply" >&2; exit 1; }
  # Horovod's own build deps, without build isolation so it compiles against our torch.
  "$PY" -m pip install -q "cloudpickle" "psutil" "pyyaml" "packaging" "wheel" "setuptools<81"
  mkdir -p "$WHEEL_DIR"
  ( cd "$SRC" && PATH="/usr/bin:$PATH" \
    HOROVOD_WITH_PYTORCH=1 HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 \
    HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MPI=1 MAKEFLAGS="-j$(nproc)" \
    "$PY" -m pip wheel -q --no-deps --no-build-isolation . -w "$WHEEL_DIR" )
  "$PY" -m pip install -q --no-deps "$WHEEL_DIR"/horovod-*.whl
  "$PY" -m pip install -q "cloudpickle" "psutil" "pyyaml" "packaging"
fi
"$PY" -c "import horovod.torch as hvd; hvd.init(); print('horovod', __import__('horovod').__version__, 'ok, gloo built:', hvd.gloo_built())"
