#!/usr/bin/env bash
# Sets up everything ashl needs on a fresh Debian machine, idempotently:
# Open MPI, a .venv with pinned torch and the Python tools, Horovod 0.28.1 built
# from its sdist with the C++17 patch (wheel cached outside the checkout), and
# ashl itself in editable mode (which builds the native module ashl._C).
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
VENV=${ASHL_VENV:-$ROOT/.venv}
PY=${PYTHON:-python3.11}
TORCH_VERSION=2.13.0
HOROVOD_VERSION=0.28.1
CACHE=${ASHL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/ashl}

log() { printf '[bootstrap] %s\n' "$*"; }

# --- Open MPI from Debian ------------------------------------------------------
if ! command -v mpirun >/dev/null 2>&1 || ! command -v mpicc >/dev/null 2>&1; then
    log "installing Open MPI (openmpi-bin libopenmpi-dev)"
    SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq openmpi-bin libopenmpi-dev >/dev/null
fi
OMPI_VERSION=$(mpirun --version 2>/dev/null | head -n1 | grep -oE '[0-9]+\.[0-9]+(\.[0-9]+)?' | head -n1)

# --- virtual environment -------------------------------------------------------
if [ ! -x "$VENV/bin/python" ]; then
    log "creating $VENV"
    "$PY" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
if ! "$VENV/bin/python" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$TORCH_VERSION')" 2>/dev/null; then
    log "installing torch==$TORCH_VERSION"
    "${PIP[@]}" install "torch==$TORCH_VERSION"
fi
TOOLS=(numpy pybind11 ninja "cmake>=3.27,<4" scikit-learn matplotlib tqdm pytest pytest-timeout
       hypothesis packaging wheel "setuptools>=64" psutil cloudpickle pyyaml cffi atheris pyzmq
       mlxtend)
TOOL_MODULES="numpy, pybind11, ninja, cmake, sklearn, matplotlib, tqdm, pytest, pytest_timeout"
TOOL_MODULES+=", hypothesis, packaging, wheel, setuptools, psutil, cloudpickle, yaml, cffi, atheris, zmq"
TOOL_MODULES+=", mlxtend"
if ! "$VENV/bin/python" -c "import $TOOL_MODULES" 2>/dev/null; then
    log "installing the Python tools"
    "${PIP[@]}" install "${TOOLS[@]}"
fi

# --- wheels built from source, cached outside the checkout ----------------------
PYTAG=$("$VENV/bin/python" -c 'import sys; print(f"py{sys.version_info[0]}{sys.version_info[1]}")')
build_cached_wheel() {  # name key build-command...
    local name=$1 key=$2; shift 2
    local dir="$CACHE/wheels/$key"
    if ! ls "$dir"/*.whl >/dev/null 2>&1; then
        log "building $name wheel into $dir (cached for next time)"
        mkdir -p "$dir"
        local tmp; tmp=$(mktemp -d)
        if ! "$@" "$tmp" "$dir"; then rm -rf "$tmp" "$dir"; log "building $name failed"; exit 1; fi
        rm -rf "$tmp"
    fi
    "${PIP[@]}" install --no-deps --force-reinstall "$dir"/*.whl
}

build_mpi4py() {  # tmp out
    "${PIP[@]}" wheel --no-deps --no-binary=mpi4py -w "$2" mpi4py
}
build_horovod() {  # tmp out
    local tmp=$1 out=$2
    "${PIP[@]}" download --no-deps --no-binary=:all: -d "$tmp" "horovod==$HOROVOD_VERSION"
    tar -xzf "$tmp"/horovod-"$HOROVOD_VERSION".tar.gz -C "$tmp"
    local src="$tmp/horovod-$HOROVOD_VERSION"
    # torch >= 2.1 needs C++17; the fix never reached a horovod release.
    sed -i 's/set(CMAKE_CXX_STANDARD 14)/set(CMAKE_CXX_STANDARD 17)/' \
        "$src/CMakeLists.txt" "$src/horovod/torch/CMakeLists.txt"
    grep -q 'CMAKE_CXX_STANDARD 17' "$src/CMakeLists.txt"
    (cd "$src" && PATH="$VENV/bin:$PATH" \
        HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_MPI=1 HOROVOD_WITH_GLOO=1 \
        HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 HOROVOD_CPU_OPERATIONS=MPI \
        CMAKE_POLICY_VERSION_MINIMUM=3.5 \
        MAKEFLAGS="-j$(nproc)" \
        "$VENV/bin/python" -m pip --disable-pip-version-check wheel --no-build-isolation --no-deps -w "$out" .)
}

if ! "$VENV/bin/python" -c "import mpi4py" 2>/dev/null; then
    build_cached_wheel mpi4py "mpi4py-$PYTAG-ompi$OMPI_VERSION" build_mpi4py
fi
if ! "$VENV/bin/python" -c "import horovod.torch" 2>/dev/null; then
    build_cached_wheel horovod "horovod-$HOROVOD_VERSION-torch$TORCH_VERSION-$PYTAG-ompi$OMPI_VERSION" build_horovod
fi

# --- ashl itself ---------------------------------------------------------------
# Editable install once; after that `make build` rebuilds ashl._C incrementally.
if ! (cd / && "$VENV/bin/python" -c "import ashl._C") 2>/dev/null; then
    log "building ashl (editable)"
    "${PIP[@]}" install --no-build-isolation --no-deps -e "$ROOT"
fi
log "ready: $("$VENV/bin/python" -c 'import torch, horovod, mpi4py, ashl; print(f"torch {torch.__version__}, horovod {horovod.__version__}, mpi4py {mpi4py.__version__}, ashl {ashl.__version__}")')"
