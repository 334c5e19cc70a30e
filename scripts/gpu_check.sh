#!/usr/bin/env bash
# The GPU check, for a machine with an NVIDIA GPU (README "On a GPU"). From the repository's
# root, with the wheels `make gpu-wheels` put in .whl/ when that machine has no package
# registry (mpi4py, an MPI, pyzmq, psutil and mlxtend, for its Python):
#
#     bash scripts/gpu_check.sh [REPORT_DIR]        # default: $OUT, else out/gpu-check
#
# Builds ashl._C with CUDA against the python3 and torch found there (not this project's
# pinned ones), runs the CUDA kernel and staging tests, the device kernel benchmark and two
# 3-rank `ashl` runs on one GPU (the global model in host memory, then on the GPU), and
# writes REPORT_DIR/gpu_check.json (with the benchmark's kernels-cuda.json and one log).
# Exit status 0 when every part passed. `--allow-cpu` after REPORT_DIR runs the same steps
# on a machine without a GPU (the CUDA tests skip, the benchmark and the runs use the CPU):
# the check of the check.
set -uo pipefail
cd "$(dirname "$0")/.."
REPORT=${1:-${OUT:-out/gpu-check}}
PY=${PYTHON:-python3}
mkdir -p "$REPORT"
if compgen -G ".whl/*.whl" > /dev/null; then
    # a prefix of their own (not --target, which drops MPICH's lib/), ahead of what is
    # installed: mpi4py then finds MPICH's libmpi, and its mpiexec launches the ranks
    SITE=${TMPDIR:-/tmp}/ashl-gpu-site
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
        --ignore-installed --prefix "$SITE" .whl/*.whl \
        || { echo "gpu_check: the wheels in .whl/ did not install" >&2; exit 1; }
    PACKAGES=$("$PY" -c 'import sys, sysconfig
print(sysconfig.get_paths(vars={"base": sys.argv[1], "platbase": sys.argv[1]})["purelib"])' "$SITE")
    export PYTHONPATH="$PACKAGES${PYTHONPATH:+:$PYTHONPATH}" PATH="$SITE/bin:$PATH"
    export LD_LIBRARY_PATH="$SITE/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
exec "$PY" scripts/gpu_check.py --report "$REPORT" "${@:2}"
