#!/usr/bin/env bash
# The GPU check, for a machine with an NVIDIA GPU (README "On a GPU"). From the repository's
# root, with the wheels `make gpu-wheels` put in .whl/ when that machine has no package
# registry (mpi4py, MPICH, pyzmq, psutil and mlxtend, for its Python):
#
#     bash scripts/gpu_check.sh [REPORT_DIR] [OPTIONS]    # default: $OUT, else out/gpu-check
#
# Installs the carried wheels into a fresh prefix of its own (MPICH's mpiexec and libmpi
# found wherever pip put them, and used when they installed), builds ashl._C with CUDA
# against the python3 and torch found there (not this project's pinned ones), runs the CUDA
# kernel and staging tests, the device kernel benchmark and two 3-rank `ashl` runs on one
# GPU (the global model in host memory, then on the GPU), and writes
# REPORT_DIR/gpu_check.json (with the benchmark's kernels-cuda.json and one log): each
# step's status, seconds and output's tail; a failed step does not stop the others, and the
# report is written whatever happens, within 8 minutes. Exit status 0 when every part passed.
# OPTIONS (scripts/gpu_check.py --help):
#   --allow-cpu            the same steps without a GPU (the CUDA tests skip, the benchmark
#                          and the runs use the CPU): the check of the check
#   --mpi auto|carried|system   whose MPI: the carried wheel's when it installed (auto),
#                          that one or a failure (carried), the one found here (system)
#   --wheels DIR|none      the wheels' folder (default .whl/)
#   --budget SECONDS       the whole check's wall-clock budget (default 440)
# PYTHON=... picks the interpreter (default python3).
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
if [ $# -gt 0 ] && [[ $1 != -* ]]; then
    REPORT=$1; shift; [[ $REPORT == /* ]] || REPORT=$PWD/$REPORT
else
    REPORT=${OUT:-$ROOT/out/gpu-check}
fi
cd "$ROOT"
PY=${PYTHON:-python3}
mkdir -p "$REPORT"
rm -f "$REPORT/gpu_check.json"
# a safety net past the script's own budget: SIGTERM, which it answers by writing the report
LIMIT=${GPU_CHECK_TIMEOUT:-465}
if command -v timeout >/dev/null 2>&1; then GUARD=(timeout -k 10 "$LIMIT"); else GUARD=(); fi
PYTHONUNBUFFERED=1 ${GUARD[@]+"${GUARD[@]}"} "$PY" scripts/gpu_check.py --report "$REPORT" "$@"
rc=$?
if [ ! -s "$REPORT/gpu_check.json" ]; then
    printf '{"complete": false, "ok": false, "error": "%s exited %s without a report"}\n' \
        "$PY scripts/gpu_check.py" "$rc" > "$REPORT/gpu_check.json"
    echo "gpu_check: $PY exited $rc without a report; wrote $REPORT/gpu_check.json" >&2
    [ "$rc" -eq 0 ] && rc=1
fi
exit "$rc"
