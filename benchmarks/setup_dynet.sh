#!/usr/bin/env bash
# Install DyNet 2.1.2 (CPU) into the project's .venv from its PyPI sdist, for benchmarks/vs_dynet.py.
#
# DyNet is optional: nothing in src/ or tests/ imports it. Recipe from ../shared/REFERENCES.md §2:
# Debian libeigen3-dev, cython<3 + numpy + wheel, then an sdist build without build isolation with
# EIGEN3_INCLUDE_DIR set; if packaging fails on a missing LICENSE.txt, copy the sdist's LICENSE.txt
# into build/py3.11-64bit/python/ and install again from there. Takes ~10 minutes on 2 cores.
#
# Usage: benchmarks/setup_dynet.sh            (idempotent; exits 0 at once if dynet imports)
# Env:   DYNET_BUILD_DIR (default /tmp/dynet-build; never inside the checkout, never committed)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="$ROOT/.venv/bin/python"
PIP=("$PY" -m pip)
BUILD_DIR="${DYNET_BUILD_DIR:-/tmp/dynet-build}"
DYNET_VERSION=2.1.2
EIGEN_DIR=/usr/include/eigen3

check() {
    # autobatch must be configured before the first `import dynet`.
    "$PY" -c "import dynet_config; dynet_config.set(autobatch=1); import dynet; \
print('dynet', getattr(dynet, '__version__', '$DYNET_VERSION'), 'imports')" 2>/dev/null
}

if [ ! -x "$PY" ]; then
    echo "error: $PY not found; run 'make test' (or create .venv) first" >&2
    exit 1
fi
if check; then
    exit 0
fi

if [ ! -f "$EIGEN_DIR/Eigen/Core" ]; then
    echo "== installing libeigen3-dev (apt-get)"
    SUDO=""
    [ "$(id -u)" -ne 0 ] && SUDO="sudo"
    $SUDO apt-get update -q
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q libeigen3-dev
fi

echo "== build tools into .venv (pinned in constraints.txt)"
"${PIP[@]}" install -q -c "$ROOT/constraints.txt" 'cython<3' numpy wheel

echo "== fetching dynet==$DYNET_VERSION sdist into $BUILD_DIR"
mkdir -p "$BUILD_DIR"
cd "$BUILD_DIR"
SRC="$(ls -d "$BUILD_DIR"/[dD]y[nN][eE][tT]-"$DYNET_VERSION" 2>/dev/null | head -n1 || true)"
if [ -z "$SRC" ]; then
    # --no-binary for dynet only: ':all:' would also build cython/setuptools from source.
    "${PIP[@]}" download -q --no-deps --no-build-isolation --no-binary dynet \
        -c "$ROOT/constraints.txt" "dynet==$DYNET_VERSION" -d "$BUILD_DIR"
    # The sdist is named dyNET-<version>.tar.gz.
    tar xzf "$(ls "$BUILD_DIR"/*-"$DYNET_VERSION".tar.gz | head -n1)"
    SRC="$(ls -d "$BUILD_DIR"/[dD]y[nN][eE][tT]-"$DYNET_VERSION" | head -n1)"
fi

export EIGEN3_INCLUDE_DIR="$EIGEN_DIR"
export MAKEFLAGS="-j$(nproc)"
echo "== building (~10 min on 2 cores)"
cd "$SRC"
if ! "${PIP[@]}" install -v --no-build-isolation . ; then
    # Known packaging failure: setup.py looks for LICENSE.txt next to the generated python package.
    PYDIR="$(ls -d "$SRC"/build/py*-64bit/python 2>/dev/null | head -n1)"
    if [ -z "$PYDIR" ]; then
        echo "error: build failed before the python package was generated; see the log above" >&2
        exit 1
    fi
    echo "== retrying from $PYDIR with LICENSE.txt copied in"
    cp "$SRC/LICENSE.txt" "$PYDIR/"
    cd "$PYDIR"
    "${PIP[@]}" install -v --no-build-isolation .
fi

cd "$ROOT"
if ! check; then
    echo "error: dynet installed but does not import" >&2
    exit 1
fi
