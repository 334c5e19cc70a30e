"""The GPU check's steps (scripts/gpu_check.sh runs this): each one a subprocess with its
own time limit, its status, seconds and output's tail recorded in one JSON report; a failed
step does not stop the others, and the report is written after every step and once more at
the end, whatever happens. Under 8 minutes in all on one GPU (--budget).

Steps, in order: wheels (the carried wheels into a fresh prefix of their own), environment,
build (ashl._C with CUDA; without it, once more, should that fail), probe, mpi_hello, the two
3-rank runs (first: they are the numbers the check is for), cuda_tests, staging_tests and
kernel_bench. Every JSON a step hands back comes through a file it
writes, never its standard output (a warning printed there must not break the parse)."""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
import traceback
import xml.etree.ElementTree as ElementTree
from pathlib import Path
from typing import Callable, Optional, Sequence

ROOT = Path(__file__).resolve().parents[1]
# The kernel tests' CUDA cases (marker cuda: the CPU ones run everywhere else) and
# tests/cuda; then the staging tests, whose CUDA ones are skipif-guarded rather than marked.
CUDA_TESTS = ["-m", "cuda", "tests/unit/test_kernels.py", "tests/unit/test_kernels_errors.py",
              "tests/cuda"]
STAGING_TESTS = ["tests/unit/test_staging.py"]
RANKS = 3
# MNIST's 1.0M-parameter CNN (4 MB commits): big enough for where the global model lives to
# show in the server's commit latency, short enough for two runs in the check's 8 minutes
RUN = ["--model", "mnistnet", "--dataset", "mnist", "--target-accuracy", "0.95",
       "--max-seconds", "45"]
# The whole check's wall-clock budget, the shell wrapper's own seconds left out of it.
BUDGET_S = 440.0
# Each step: (its own time limit, the seconds kept back for it while earlier steps run).
# A step gets min(limit, budget left - what the later steps keep back), so a slow build
# cannot starve the runs; one left with under MIN_STEP_S is skipped, and says so.
# On the GPU machine a step takes about (s): wheels 5, environment 10, build 60-120 (one
# .cu file for sm_80 and sm_90), probe 5, mpi_hello 2, the tests 30-90, the benchmark 30-90,
# each run 20-60 (--max-seconds 45 or the 0.95 target, whichever first).
LIMITS = {"wheels": (90, 0), "environment": (60, 15), "build": (240, 0),
          "build_without_cuda": (150, 0), "probe": (45, 10), "mpi_hello": (40, 10),
          "ranks_global_model_on_host": (110, 60), "ranks_global_model_on_device": (110, 60),
          "cuda_tests": (180, 45), "staging_tests": (60, 15), "kernel_bench": (120, 40)}
MIN_STEP_S = 5.0
INTERRUPT_GRACE_S = 5.0
TAIL_CHARS = 3000
# Carried wheels that make up the MPI: left out under --mpi system.
MPI_WHEELS = ("mpi4py", "mpich")
MPI_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
           "OMP_NUM_THREADS": "1"}


# --- the step runner: pure enough to test without a GPU, MPI or torch ---------------------

def step_timeout(limit: float, now: float, deadline: float, kept_back: float) -> float:
    """Seconds a step may run: its own limit, cut to what the budget leaves once the later
    steps' reserve is kept back (0 when nothing is left)."""
    return max(0.0, min(float(limit), deadline - now - kept_back))


def tail(text: str, n: int = TAIL_CHARS) -> str:
    return text if len(text) <= n else "..." + text[-n:]


def run_command(cmd: Sequence, timeout: float, env: Optional[dict] = None,
                cwd: Path = ROOT) -> tuple:
    """(status, returncode, output) of `cmd` run in a process group of its own, its
    stdout and stderr into one temporary file (no pipe that a grandchild could hold open);
    past `timeout` the whole group is interrupted (SIGINT: pytest still writes its summary
    and JUnit file), then killed (SIGTERM, SIGKILL: mpiexec's ranks too).
    status: "ok", "failed" (a non-zero exit), "timeout", "interrupted" (this check was
    stopped meanwhile) or "error" (it could not start)."""
    with tempfile.TemporaryFile(mode="w+b") as out:
        try:
            proc = subprocess.Popen([str(c) for c in cmd], cwd=cwd, stdout=out,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env=env, start_new_session=True,
                                    preexec_fn=_interruptible)
        except (OSError, ValueError) as exc:
            return "error", None, f"could not start {cmd[0]}: {exc!r}"
        try:
            rc = proc.wait(timeout=timeout)
            status = "ok" if rc == 0 else "failed"
        except subprocess.TimeoutExpired:
            rc, status = None, "timeout"
            _kill_group(proc, interrupt=True)
        except KeyboardInterrupt:          # this check's own SIGTERM or ^C: the caller says
            rc, status = None, "interrupted"
            _kill_group(proc, interrupt=True)
        finally:
            _kill_group(proc)   # also after a normal exit: nothing it started outlives it
        out.seek(0)
        text = out.read().decode(errors="replace").replace("\x00", "")
    if status == "timeout":
        text += f"\n(killed after {timeout:g} s)"
    return status, rc, text


def _interruptible() -> None:
    """In the child: SIGINT back to its default. A check started in the background by a
    non-interactive shell (nohup ... &) inherits SIGINT ignored, and a Python child that
    starts with it ignored never raises KeyboardInterrupt: pytest would be killed without
    writing its summary."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _kill_group(proc: subprocess.Popen, interrupt: bool = False) -> None:
    signals = ((signal.SIGINT, INTERRUPT_GRACE_S),) if interrupt else ()
    for sig, wait in (*signals, (signal.SIGTERM, 3.0), (signal.SIGKILL, 3.0)):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            break
        try:
            proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            continue
        if not _group_alive(proc.pid):
            break
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


class Check:
    """Runs the steps and keeps the report: every step records its status, return code,
    seconds, time limit, command and output's tail; the report is rewritten after each."""

    def __init__(self, out: Path, budget: float = BUDGET_S, limits: Optional[dict] = None,
                 clock: Callable[[], float] = time.monotonic):
        self.out = out
        self.clock = clock
        self.started = clock()
        self.deadline = self.started + budget
        self.limits = dict(LIMITS if limits is None else limits)
        self.env = dict(os.environ)
        self.report: dict = {"started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                             "host": platform.node(), "complete": False, "ok": False,
                             "budget_s": budget, "steps": {}}
        self.log = None
        self.work: Optional[Path] = None

    # the seconds the steps still to come keep back: their reserves, but never more than
    # half of what is left (a budget too small for them all still runs the first steps)
    def kept_back(self, name: str) -> float:
        names = list(self.limits)
        later = names[names.index(name) + 1:] if name in names else []
        reserve = sum(self.limits[n][1] for n in later if n not in self.report["steps"])
        return float(min(reserve, max(0.0, self.deadline - self.clock()) / 2))

    def timeout_for(self, name: str) -> float:
        limit = self.limits.get(name, (60, 0))[0]
        return step_timeout(limit, self.clock(), self.deadline, self.kept_back(name))

    def starved(self, name: str, timeout: float) -> bool:
        return timeout < min(MIN_STEP_S, self.limits.get(name, (60, 0))[0])

    def _record(self, name: str, entry: dict, text: str) -> dict:
        self.report["steps"][name] = entry
        if self.log is not None:
            self.log.write(f"===== {name}: {entry['status']} ({entry['seconds']} s)"
                           f"{' ' + entry['command'] if entry.get('command') else ''}\n"
                           f"{text}\n")
            self.log.flush()
        print(f"gpu_check: {name}: {entry['status']} ({entry['seconds']} s)", flush=True)
        self.write()
        return entry

    def skip(self, name: str, why: str, status: str = "skipped") -> dict:
        """A step not run: "skipped" (no time left: a failure) or "off" (asked for)."""
        return self._record(name, {"status": status, "returncode": None, "seconds": 0.0,
                                   "timeout_s": 0.0, "tail": why}, why)

    def step(self, name: str, cmd: Sequence, env: Optional[dict] = None) -> dict:
        """One subprocess step; its entry in the report (status "ok" when it exited 0)."""
        timeout = self.timeout_for(name)
        if self.starved(name, timeout):
            return self.skip(name, f"skipped: {timeout:.0f} s of the budget left for it")
        t0 = self.clock()
        status, rc, text = run_command(cmd, timeout, {**self.env, **(env or {})})
        entry = self._record(name, {"status": status, "returncode": rc,
                                    "seconds": round(self.clock() - t0, 1),
                                    "timeout_s": round(timeout, 1),
                                    "command": " ".join(map(str, cmd)), "tail": tail(text)},
                             text)
        if status == "interrupted":
            raise KeyboardInterrupt(f"interrupted during {name}")
        return entry

    def task(self, name: str, fn: Callable[[float], tuple]) -> dict:
        """One step done here: fn(timeout) returns (ok, text); an exception is a failure
        with its traceback."""
        timeout = self.timeout_for(name)
        if self.starved(name, timeout):
            return self.skip(name, f"skipped: {timeout:.0f} s of the budget left for it")
        t0 = self.clock()
        try:
            ok, text = fn(timeout)
            status = "ok" if ok else "failed"
        except Exception:  # noqa: BLE001 - the report says what it was
            status, text = "error", traceback.format_exc()
        return self._record(name, {"status": status, "returncode": None,
                                   "seconds": round(self.clock() - t0, 1),
                                   "timeout_s": round(timeout, 1), "tail": tail(text)}, text)

    def attach(self, key: str, fn: Callable[[], object]) -> None:
        """report[key] = fn(), or None and the error under report["errors"][key]."""
        try:
            self.report[key] = fn()
        except Exception as exc:  # noqa: BLE001
            self.report[key] = None
            self.report.setdefault("errors", {})[key] = f"{type(exc).__name__}: {exc}"

    def write(self) -> None:
        self.report["seconds"] = round(self.clock() - self.started, 1)
        self.out.mkdir(parents=True, exist_ok=True)
        tmp = self.out / "gpu_check.json.tmp"
        tmp.write_text(json.dumps(self.report, indent=2, default=str) + "\n")
        os.replace(tmp, self.out / "gpu_check.json")


def verdict(report: dict, allow_cpu: bool, run_names: Sequence[str]) -> tuple:
    """(ok, the steps not ok): every step "ok" or "off" (one skipped for want of time,
    failed, timed out or not started fails the check),
    ashl built with CUDA (unless allow_cpu), every run finished with all its ranks."""
    failed = [n for n, s in report.get("steps", {}).items()
              if s.get("status") not in ("ok", "off")]
    probe = report.get("ashl") or {}
    cuda = allow_cpu or bool(probe.get("cuda"))
    runs = [report.get(n) for n in run_names]
    ranks = all(r is not None and r.get("ranks") == RANKS for r in runs)
    return (not failed and cuda and ranks and bool(run_names)), failed


# --- where the carried wheels land ----------------------------------------------------------

def wheel_name(path: Path) -> str:
    return path.name.split("-")[0].lower().replace("_", "-")


def prefix_layout(prefix: Path) -> dict:
    """Where `pip install --prefix` put things, found rather than assumed (distros and
    Pythons differ: lib/pythonX.Y/site-packages, lib64, local/, dist-packages): the
    import folders (Python's own purelib and platlib of that prefix first, then every
    folder holding a *.dist-info), the launcher and the MPI library."""
    prefix = Path(prefix)
    site: list = []
    for key in ("purelib", "platlib"):
        try:
            p = Path(sysconfig.get_path(key, vars={"base": str(prefix),
                                                   "platbase": str(prefix)}))
        except (KeyError, ValueError):
            continue
        if p.is_dir() and any(p.glob("*.dist-info")) and str(p) not in site:
            site.append(str(p))
    for info in sorted(prefix.rglob("*.dist-info")):
        if info.is_dir() and str(info.parent) not in site:
            site.append(str(info.parent))
    mpiexec = None
    for name in ("mpiexec", "mpiexec.hydra", "mpirun"):
        found = sorted(p for p in prefix.rglob(name)
                       if p.is_file() and p.parent.name == "bin")
        if found:
            mpiexec = str(found[0])
            break
    libmpi = None
    # libmpi.so in a wheel is a linker script (INPUT(libmpi.so.12)): dlopen needs the ELF
    for pattern in ("libmpi.so.12", "libmpi.so.[0-9]*", "libmpi.so"):
        found = sorted(p for p in prefix.rglob(pattern) if p.is_file() and _is_elf(p))
        if found:
            libmpi = str(found[0])
            break
    return {"site": site, "mpiexec": mpiexec, "libmpi": libmpi,
            "bin": str(Path(mpiexec).parent) if mpiexec else None,
            "lib": str(Path(libmpi).parent) if libmpi else None}


def _is_elf(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"\x7fELF"
    except OSError:
        return False


def layout_env(layout: dict, base: dict, use_mpi: bool) -> dict:
    """The variables the steps need to see the prefix: its import folders on PYTHONPATH
    (after src/), and, when its MPI is the one to use, its launcher on PATH, its library
    on LD_LIBRARY_PATH and named to mpi4py (MPI4PY_LIBMPI: mpi4py >= 4 dlopens it)."""
    def join(*parts):
        return os.pathsep.join(p for p in parts if p)
    env = {"PYTHONPATH": join(str(ROOT / "src"), *layout.get("site", []),
                              base.get("PYTHONPATH", ""))}
    if use_mpi and layout.get("mpiexec") and layout.get("libmpi"):
        env["PATH"] = join(layout["bin"], base.get("PATH", ""))
        env["LD_LIBRARY_PATH"] = join(layout["lib"], base.get("LD_LIBRARY_PATH", ""))
        env["MPI4PY_LIBMPI"] = layout["libmpi"]
        env["MPI4PY_MPIABI"] = "mpich"
        env["HYDRA_LAUNCHER"] = "fork"     # one host: no ssh
    return env


def mpiexec_command(exe: Optional[str], n: int, env: dict) -> list:
    """The launcher, with Open MPI's flags only where it is Open MPI's."""
    exe = exe or shutil.which("mpiexec", path=env.get("PATH")) or \
        shutil.which("mpirun", path=env.get("PATH")) or "mpiexec"
    version = launcher_version(exe, env)
    extra = ["--oversubscribe", "--bind-to", "none"] if ("Open MPI" in version or
                                                          "OpenRTE" in version) else []
    return [exe, "-n", str(n), *extra]


def launcher_version(exe: str, env: dict) -> str:
    status, _, text = run_command([exe, "--version"], 15, env)
    return text.strip() if status == "ok" else ""


# --- what the steps' files say ------------------------------------------------------------

def read_json(path: Path):
    return json.loads(Path(path).read_text()) if Path(path).exists() else None


def pytest_counts(junit: Path, text: str) -> dict:
    """passed/failed/skipped/error from pytest's JUnit XML, else its last line."""
    counts = {k: 0 for k in ("passed", "failed", "skipped", "error")}
    try:
        root = ElementTree.parse(junit).getroot()
        suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
        for s in suites:
            tests, failures = int(s.get("tests", 0)), int(s.get("failures", 0))
            errors, skipped = int(s.get("errors", 0)), int(s.get("skipped", 0))
            counts["failed"] += failures
            counts["error"] += errors
            counts["skipped"] += skipped
            counts["passed"] += tests - failures - errors - skipped
        counts["source"] = "junit"
        return counts
    except (OSError, ElementTree.ParseError, ValueError):
        pass
    for number, what in re.findall(r"(\d+) (passed|failed|skipped|errors?)", text):
        counts["error" if what.startswith("error") else what] = int(number)
    counts["source"] = "output"
    return counts


def bench_summary(path: Path) -> Optional[dict]:
    """The benchmark, kept short: the device, its copy bandwidth, and per case ashl's
    bandwidth fraction and speed-ups over torch._foreach_* and one flat torch op."""
    data = read_json(path)
    if data is None:
        return None
    keep = ("op", "tensors", "bandwidth_fraction", "speedup_vs_foreach", "speedup_vs_flat")
    return {"device": data.get("device"), "bandwidth_gbps": data.get("bandwidth_gbps"),
            "reliable": data.get("reliable"),
            "cases": [{k: row.get(k) for k in keep} for row in data.get("cases", [])]}


def ranks_summary(path: Path) -> Optional[dict]:
    s = read_json(path)
    if s is None:
        return None
    per_rank = s.get("per_rank") or []
    server = (per_rank[0].get("counters") or {}).get("server", {}) if per_rank else {}
    return {k: s.get(k) for k in ("strategy", "ranks", "final_accuracy", "time_to_target_s",
                                  "wall_s", "utilization", "stop_reason")} | {
        "server": {k: server.get(k) for k in ("merged", "busy_fraction", "commit_latency")},
        "per_rank": [{"device": r.get("device"),
                      "staging": (r.get("counters") or {}).get("staging"),
                      "commits": (r.get("counters") or {}).get("commits")} for r in per_rank]}


# What the Python there sees, and (after the build) what ashl sees: each part on its own, an
# error in one recorded beside the others; written to the file named by argv[1].
ENVIRONMENT = r"""
import json, os, platform, shutil, subprocess, sys
r = {"python": platform.python_version(), "executable": sys.executable}
try:
    import torch
    r.update(torch=torch.__version__, torch_cuda=torch.version.cuda,
             cuda_available=torch.cuda.is_available(),
             gpus=[torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
             if torch.cuda.is_available() else [])
except Exception as exc:
    r["torch_error"] = repr(exc)
nvcc = shutil.which("nvcc")
try:
    r["nvcc"] = subprocess.run([nvcc, "--version"], capture_output=True, text=True,
                               timeout=20).stdout.strip().splitlines()[-1] if nvcc else None
except Exception as exc:
    r["nvcc"] = repr(exc)
for name in ("numpy", "pybind11", "cmake", "ninja", "pytest", "hypothesis", "mpi4py", "zmq",
             "psutil", "mlxtend"):
    try:
        m = __import__(name)
        r.setdefault("modules", {})[name] = [getattr(m, "__version__", "?"),
                                             os.path.dirname(m.__file__)]
    except Exception as exc:
        r.setdefault("modules", {})[name] = repr(exc)
open(sys.argv[1], "w").write(json.dumps(r))
print(json.dumps(r))
"""

PROBE = r"""
import json, sys
r = {}
try:
    import torch, ashl, ashl.kernels as k
    r.update(ashl=ashl.__file__, cuda=bool(k.cuda_available()), torch=torch.__version__,
             device=torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)
    import ashl._C as C
    r["ashl_C"] = C.__file__
except Exception as exc:
    r["ashl_error"] = repr(exc)
try:
    import mpi4py
    mpi4py.rc.initialize = False          # the library's name needs no MPI_Init
    from mpi4py import MPI
    r.update(mpi4py=mpi4py.__version__, mpi4py_path=mpi4py.__file__,
             mpi=MPI.Get_library_version().strip("\x00 \n").splitlines()[0])
except Exception as exc:
    r["mpi_error"] = repr(exc)
try:
    import zmq
    r["zmq"] = zmq.__version__
except Exception as exc:
    r["zmq"] = None
    r["zmq_error"] = repr(exc)
open(sys.argv[1], "w").write(json.dumps(r))
print(json.dumps(r))
sys.exit(0 if "ashl_error" not in r and "mpi_error" not in r else 1)
"""

MPI_HELLO = r"""
from mpi4py import MPI
c = MPI.COMM_WORLD
total = c.allreduce(c.rank)
assert total == c.size * (c.size - 1) // 2, total
name = MPI.Get_library_version().strip("\x00 \n").splitlines()[0]
print(f"rank {c.rank} of {c.size}: allreduce {total}: {name}")
"""


# --- the check ----------------------------------------------------------------------------

def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--report", required=True, help="directory of the report")
    p.add_argument("--allow-cpu", action="store_true",
                   help="no GPU here: run every step on the CPU (the CUDA tests skip)")
    p.add_argument("--wheels", default=str(ROOT / ".whl"),
                   help="folder of the carried wheels (default .whl/; 'none': install none)")
    p.add_argument("--mpi", choices=("auto", "carried", "system"), default="auto",
                   help="auto: the carried MPICH wheel's when it installed, else the one "
                        "found here; carried: that wheel's (a failure if it did not "
                        "install); system: the one here (the mpi4py and mpich wheels are "
                        "left out)")
    p.add_argument("--prefix", default=None,
                   help="where the wheels go (default: a fresh temporary folder)")
    p.add_argument("--keep", action="store_true",
                   help="keep the temporary folder (the prefix, the runs' outputs)")
    p.add_argument("--budget", type=float, default=BUDGET_S,
                   help=f"seconds for the whole check (default {BUDGET_S:g})")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    out = Path(args.report).resolve()
    out.mkdir(parents=True, exist_ok=True)
    check = Check(out, budget=args.budget)
    check.work = Path(tempfile.mkdtemp(prefix="ashl-gpu-check-"))
    check.report.update(allow_cpu=args.allow_cpu, options={
        "wheels": args.wheels, "mpi": args.mpi, "python": sys.executable})
    run_names = [f"ranks_global_model_on_{m}" for m in ("host", "device")]

    def on_signal(signum, frame):     # the caller's timeout: still write the report
        raise KeyboardInterrupt(f"signal {signum}")
    previous = signal.signal(signal.SIGTERM, on_signal)
    try:
        with (out / "gpu_check.log").open("w") as check.log:
            run_steps(check, args, out, run_names)
    except BaseException as exc:  # noqa: BLE001 - the report says what stopped it
        check.report["aborted"] = f"{type(exc).__name__}: {exc}"
        check.report["traceback"] = traceback.format_exc()[-TAIL_CHARS:]
    finally:
        signal.signal(signal.SIGTERM, previous)
        check.log = None
        if args.keep:
            check.report["work"] = str(check.work)
        else:
            shutil.rmtree(check.work, ignore_errors=True)
        if "aborted" in check.report:     # the steps it never reached, named as such
            for name in check.limits:
                if name not in check.report["steps"] and name != "build_without_cuda":
                    check.report["steps"][name] = {"status": "not run", "returncode": None,
                                                   "seconds": 0.0, "timeout_s": 0.0,
                                                   "tail": check.report["aborted"]}
        ok, failed = verdict(check.report, args.allow_cpu, run_names)
        check.report.update(ok=ok and "aborted" not in check.report, failed_steps=failed,
                            complete="aborted" not in check.report)
        check.write()
        print(f"gpu_check: {'passed' if check.report['ok'] else 'FAILED'} in "
              f"{check.report['seconds']} s; report {out / 'gpu_check.json'}"
              f"{'' if not failed else '; not ok: ' + ', '.join(failed)}", flush=True)
    return 0 if check.report["ok"] else 1


def run_steps(check: Check, args, out: Path, run_names: Sequence[str]) -> None:
    py = sys.executable
    device = "cpu" if args.allow_cpu else "cuda"
    work = check.work                  # the runs' folders, the prefix: the report 3 files alone
    prefix = Path(args.prefix) if args.prefix else work / "prefix"
    layout: dict = {"site": [], "mpiexec": None, "libmpi": None}
    check.report["mpi"] = {"wanted": args.mpi, "carried": False}

    # 1. the carried wheels, one pip call each (one that does not fit this Python must not
    # keep the others out), into a prefix of their own
    def install_wheels(timeout: float) -> tuple:
        folder = Path(args.wheels)
        wheels = sorted(folder.glob("*.whl")) if folder.is_dir() else []
        if args.mpi == "system":
            wheels = [w for w in wheels if wheel_name(w) not in MPI_WHEELS]
        if not wheels:
            return False, f"no wheels in {folder}{'' if folder.is_dir() else ' (no such folder)'}"
        lines, ok, end = [], True, check.clock() + timeout
        env = {**check.env, "PIP_ROOT_USER_ACTION": "ignore"}   # pip warns root otherwise
        check.report["wheels"] = {}
        for w in wheels:
            left = end - check.clock()
            status, _, text = run_command(
                [py, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-index",
                 "--no-deps", "--no-compile", "--no-cache-dir", "--ignore-installed",
                 "--prefix", prefix, w], max(left, 1.0), env)
            check.report["wheels"][w.name] = status
            ok &= status == "ok"
            lines.append(f"{w.name}: {status}\n{text.strip()}")
        layout.update(prefix_layout(prefix))
        lines.append(f"layout: {json.dumps(layout)}")
        if args.mpi == "carried" and not (layout["mpiexec"] and layout["libmpi"]):
            ok = False
            lines.append("--mpi carried: no mpiexec and libmpi in the prefix")
        return ok, "\n".join(lines)

    if args.wheels.lower() == "none":
        check.skip("wheels", "--wheels none", "off")
    else:
        check.task("wheels", install_wheels)
    carried = args.mpi != "system" and bool(layout.get("mpiexec") and layout.get("libmpi"))
    if args.mpi == "carried" and not carried:
        check.report["mpi"]["error"] = "the carried MPI did not install; the MPI found here"
    check.env.update(layout_env(layout, check.env, carried))
    check.env.update(PYTHONUNBUFFERED="1", PIP_ROOT_USER_ACTION="ignore")
    check.report["mpi"].update(carried=carried, prefix=str(prefix), layout=layout,
                               env={k: check.env.get(k) for k in (
                                   "PYTHONPATH", "PATH", "LD_LIBRARY_PATH", "MPI4PY_LIBMPI",
                                   "MPI4PY_MPIABI", "HYDRA_LAUNCHER")})
    launcher = mpiexec_command(layout["mpiexec"] if carried else None, RANKS, check.env)
    check.report["mpi"].update(mpiexec=launcher,
                               version=launcher_version(launcher[0], check.env)[:400])

    # 2. what is here
    env_json = work / "environment.json"
    check.step("environment", [py, "-c", ENVIRONMENT, env_json])
    check.attach("environment", lambda: read_json(env_json))

    # 3. ashl._C: with CUDA; should that fail, without it, so that the rest still runs
    build = check.step("build", [py, "setup.py", "-q", "build_ext", "--inplace"],
                       {"ASHL_WITH_CUDA": "auto" if args.allow_cpu else "on"})
    if build["status"] != "ok" and not args.allow_cpu:
        check.step("build_without_cuda", [py, "setup.py", "-q", "build_ext", "--inplace"],
                   {"ASHL_WITH_CUDA": "off"})

    # 4. what ashl sees once built: its CUDA kernels, the device, the MPI under mpi4py, zmq
    probe_json = work / "probe.json"
    check.step("probe", [py, "-c", PROBE, probe_json])
    check.attach("ashl", lambda: read_json(probe_json))

    # 5. the MPI starts its ranks and they talk
    check.step("mpi_hello", [*launcher, py, "-c", MPI_HELLO], MPI_ENV)

    # 6. the global model in host memory (the default) and on the GPU: the numbers that
    # decide the default (time to target, the server's commit latency and busy fraction)
    zmq = (check.report.get("ashl") or {}).get("zmq") is not None \
        or check.report.get("ashl") is None
    for name, memory in zip(run_names, ("host", "device")):
        check.step(name, [*launcher, py, "-m", "ashl.train", "--strategy", "ashl",
                          "--device", "auto" if args.allow_cpu else "cuda",
                          "--global-model-on", memory, *RUN, "--out", work / name,
                          "--no-progress", *([] if zmq else ["--transport", "mpi"])], MPI_ENV)
        check.attach(name, lambda n=name: ranks_summary(work / n / "summary.json"))

    # 7. the CUDA kernel tests, then the staging tests
    # a hung test fails alone (pytest-timeout, loaded by its entry point where installed)
    per_test = ["--timeout", "90"] if _importable("pytest_timeout") else []
    check.report["tests"] = {}
    for name, selection in (("cuda_tests", CUDA_TESTS), ("staging_tests", STAGING_TESTS)):
        junit = work / f"{name}.xml"
        entry = check.step(name, [py, "-m", "pytest", "-q", "-p", "no:cacheprovider", *per_test,
                                  f"--junitxml={junit}", *selection])
        try:
            check.report["tests"][name] = pytest_counts(junit, entry.get("tail", ""))
        except Exception as exc:  # noqa: BLE001
            check.report["tests"][name] = {"error": repr(exc)}

    # 8. the device kernel benchmark
    bench_json = out / f"kernels-{device}.json"
    check.step("kernel_bench", [py, "-m", "ashl.bench", "kernels", "--device", device,
                                "--repeat", "10", *(["--quick"] if args.allow_cpu else []),
                                "--json", bench_json])
    check.attach("kernel_bench", lambda: bench_summary(bench_json))


def _importable(module: str) -> bool:
    import importlib.util
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


if __name__ == "__main__":
    sys.exit(main())
