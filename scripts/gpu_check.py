"""The GPU check's steps (scripts/gpu_check.sh runs this): each one a subprocess with its
own time limit, its status, seconds and output's tail recorded in one JSON report; a failed
step does not stop the others. Under 8 minutes in all on one GPU."""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TESTS = ["tests/unit/test_kernels.py", "tests/unit/test_kernels_errors.py",
         "tests/unit/test_staging.py", "tests/cuda"]
RANKS = 3
# MNIST's 1.0M-parameter CNN (4 MB commits): big enough for where the global model lives to
# show in the server's commit latency, short enough for two runs in the check's 8 minutes
RUN = ["--model", "mnistnet", "--dataset", "mnist", "--target-accuracy", "0.95",
       "--max-seconds", "45"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--report", required=True, help="directory of the report")
    p.add_argument("--allow-cpu", action="store_true",
                   help="no GPU here: run every step on the CPU (the CUDA tests skip)")
    args = p.parse_args()
    out = Path(args.report).resolve()
    out.mkdir(parents=True, exist_ok=True)
    log = (out / "gpu_check.log").open("w")
    report = {"started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "host": platform.node(),
              "allow_cpu": args.allow_cpu, "steps": {}}
    device = "cpu" if args.allow_cpu else "cuda"
    started = time.monotonic()

    def step(name: str, cmd: list, timeout: float, env: dict | None = None) -> str:
        t0 = time.monotonic()
        try:
            proc = subprocess.run([str(c) for c in cmd], cwd=ROOT, capture_output=True,
                                  text=True, timeout=timeout, env={**os.environ, **(env or {})})
            status, text = proc.returncode, proc.stdout + proc.stderr
        except subprocess.TimeoutExpired as exc:
            status = "timeout"
            text = f"{_text(exc.stdout)}{_text(exc.stderr)}\n(killed after {timeout:g} s)"
        log.write(f"===== {name}: {' '.join(map(str, cmd))}\n{text}\n")
        log.flush()
        report["steps"][name] = {"status": status, "seconds": round(time.monotonic() - t0, 1),
                                 "tail": text[-2500:]}
        print(f"gpu_check: {name}: {status} ({report['steps'][name]['seconds']} s)", flush=True)
        return text if status == 0 else ""

    report["environment"] = environment()
    step("build", [sys.executable, "setup.py", "-q", "build_ext", "--inplace"], 360,
         {"ASHL_WITH_CUDA": "auto" if args.allow_cpu else "on"})
    probe = step("probe", [sys.executable, "-c", PROBE], 60)
    report["ashl"] = json.loads(probe.strip().splitlines()[-1]) if probe else None
    tests = step("tests", [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           *TESTS], 300)
    report["tests"] = pytest_counts(tests or report["steps"]["tests"]["tail"])
    bench_json = out / f"kernels-{device}.json"
    step("kernel_bench", [sys.executable, "-m", "ashl.bench", "kernels", "--device", device,
                          "--repeat", "10", *(["--quick"] if args.allow_cpu else []),
                          "--json", bench_json], 240)
    report["kernel_bench"] = bench_summary(bench_json)
    runs = Path(tempfile.mkdtemp(prefix="ashl-gpu-check-"))   # the report: 3 files alone
    # The global model in host memory (the default) and on the GPU: the numbers that
    # decide the default (time to target, the server's commit latency and busy fraction).
    for memory in ("host", "device"):
        name = f"ranks_global_model_on_{memory}"
        step(name, [*mpiexec(RANKS), sys.executable, "-m", "ashl.train", "--strategy", "ashl",
                    "--device", "auto" if args.allow_cpu else "cuda", "--global-model-on", memory,
                    *RUN, "--out", runs / name,
                    "--no-progress", *([] if zmq_available() else ["--transport", "mpi"])], 120,
             {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
              "OMP_NUM_THREADS": "1"})
        report[name] = ranks_summary(runs / name / "summary.json")
    report["seconds"] = round(time.monotonic() - started, 1)
    finished = [report[f"ranks_global_model_on_{m}"] for m in ("host", "device")]
    report["ok"] = (all(s["status"] == 0 for s in report["steps"].values())
                    and (args.allow_cpu or bool(report["ashl"] and report["ashl"]["cuda"]))
                    and all(r is not None and r["ranks"] == RANKS for r in finished))
    (out / "gpu_check.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"gpu_check: {'passed' if report['ok'] else 'FAILED'} in {report['seconds']} s; "
          f"report {out / 'gpu_check.json'}", flush=True)
    return 0 if report["ok"] else 1


# What ashl sees once built: its CUDA kernels, the device, the MPI under mpi4py.
PROBE = """
import json, torch, ashl.kernels as k
from mpi4py import MPI
print(json.dumps({"cuda": k.cuda_available(), "torch": torch.__version__,
                  "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
                  "mpi": MPI.Get_library_version().strip("\\x00 \\n").splitlines()[0]}))
"""


def _text(x) -> str:
    return x.decode(errors="replace") if isinstance(x, bytes) else (x or "")


def environment() -> dict:
    import torch
    nvcc = shutil.which("nvcc")
    return {"python": platform.python_version(), "torch": torch.__version__,
            "torch_cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available(),
            "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
            if torch.cuda.is_available() else [],
            "nvcc": subprocess.run([nvcc, "--version"], capture_output=True, text=True)
            .stdout.strip().splitlines()[-1] if nvcc else None,
            "mpiexec": shutil.which("mpiexec") or shutil.which("mpirun")}


def mpiexec(n: int) -> list:
    """The launcher found here, with Open MPI's flags only where it is Open MPI's."""
    exe = shutil.which("mpiexec") or shutil.which("mpirun") or "mpiexec"
    version = subprocess.run([exe, "--version"], capture_output=True, text=True).stdout \
        if shutil.which(exe) else ""
    extra = ["--oversubscribe", "--bind-to", "none"] if "Open MPI" in version or \
        "OpenRTE" in version else []
    return [exe, "-n", str(n), *extra]


def zmq_available() -> bool:
    try:
        import zmq  # noqa: F401
    except ImportError:
        return False
    return True


def pytest_counts(text: str) -> dict:
    """passed/failed/skipped/errors from pytest's last line."""
    counts = {k: 0 for k in ("passed", "failed", "skipped", "error")}
    for number, what in re.findall(r"(\d+) (passed|failed|skipped|errors?)", text):
        counts["error" if what.startswith("error") else what] = int(number)
    return counts


def bench_summary(path: Path) -> dict | None:
    """The benchmark, kept short: the device, its copy bandwidth, and per case ashl's
    bandwidth fraction and speed-ups over torch._foreach_* and one flat torch op."""
    if not path.exists():
        return None
    data = json.loads(path.read_text())
    keep = ("op", "tensors", "bandwidth_fraction", "speedup_vs_foreach", "speedup_vs_flat")
    return {"device": data["device"], "bandwidth_gbps": data["bandwidth_gbps"],
            "reliable": data["reliable"],
            "cases": [{k: row.get(k) for k in keep} for row in data["cases"]]}


def ranks_summary(path: Path) -> dict | None:
    if not path.exists():
        return None
    s = json.loads(path.read_text())
    server = s["per_rank"][0]["counters"].get("server", {})
    return {k: s.get(k) for k in ("strategy", "ranks", "final_accuracy", "time_to_target_s",
                                  "wall_s", "utilization", "stop_reason")} | {
        "server": {k: server.get(k) for k in ("merged", "busy_fraction", "commit_latency")},
        "per_rank": [{"device": r.get("device"), "staging": r["counters"].get("staging"),
                      "commits": r["counters"].get("commits")} for r in s["per_rank"]]}


if __name__ == "__main__":
    sys.exit(main())
