"""scripts/gpu_check.py's own logic, without a GPU, MPI or torch: every step records its
status, seconds and output's tail; a failed, missing or hung step does not stop the others;
the budget cuts a step's time; the report is written whatever happens; the carried wheels'
prefix is found whatever its layout."""
import importlib.util
import json
import os
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
gpu_check = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpu_check)

PY = sys.executable


def test_step_timeout_is_cut_to_the_budget_left_after_the_later_steps_reserve():
    assert gpu_check.step_timeout(240, now=0, deadline=450, kept_back=250) == 200
    assert gpu_check.step_timeout(60, now=0, deadline=450, kept_back=250) == 60
    assert gpu_check.step_timeout(60, now=449, deadline=450, kept_back=0) == 1
    assert gpu_check.step_timeout(60, now=500, deadline=450, kept_back=10) == 0


def test_each_step_is_recorded_and_a_failed_one_does_not_stop_the_rest(tmp_path):
    limits = {"ok": (20, 0), "missing": (20, 0), "fails": (20, 0), "hangs": (1.5, 0),
              "after": (20, 0)}
    check = gpu_check.Check(tmp_path, budget=60, limits=limits)
    check.step("ok", [PY, "-c", "print('hello'); import sys; print('warn', file=sys.stderr)"])
    check.step("missing", [str(tmp_path / "no-such-program"), "--version"])
    check.step("fails", [PY, "-c", "import sys; print('boom'); sys.exit(3)"])
    # a hung step whose child holds the output open: the whole group is killed in time
    pid_file = tmp_path / "grandchild.pid"
    t0 = time.monotonic()
    check.step("hangs", [PY, "-c", "import subprocess, sys, time; "
                         "p = subprocess.Popen([sys.executable, '-c', 'import time; "
                         "time.sleep(60)']); "
                         f"open({str(pid_file)!r}, 'w').write(str(p.pid)); time.sleep(60)"])
    assert time.monotonic() - t0 < 15
    check.step("after", [PY, "-c", "print('still ran')"])

    report = json.loads((tmp_path / "gpu_check.json").read_text())
    steps = report["steps"]
    assert [steps[n]["status"] for n in limits] == ["ok", "error", "failed", "timeout", "ok"]
    assert "hello" in steps["ok"]["tail"] and "warn" in steps["ok"]["tail"]
    assert "no-such-program" in steps["missing"]["tail"]
    assert steps["fails"]["returncode"] == 3 and "boom" in steps["fails"]["tail"]
    assert "killed after" in steps["hangs"]["tail"]
    assert "still ran" in steps["after"]["tail"]
    for entry in steps.values():
        assert {"status", "returncode", "seconds", "timeout_s", "tail"} <= set(entry)
    assert not _running(int(pid_file.read_text()))
    ok, failed = gpu_check.verdict(report, allow_cpu=True, run_names=[])
    assert not ok and failed == ["missing", "fails", "hangs"]


def test_a_step_past_its_time_is_interrupted_first_so_it_can_say_where_it_was(tmp_path):
    # 4 s: time to start Python and enter the try. Under `nohup ... &` this test process
    # has SIGINT ignored, and so would the child without the check's reset.
    check = gpu_check.Check(tmp_path, budget=60, limits={"slow": (4, 0)})
    entry = check.step("slow", [PY, "-c", "import sys, time\ntry:\n    time.sleep(60)\n"
                                "except KeyboardInterrupt:\n    print('3 passed, 1 failed')\n"
                                "    sys.exit(2)"])
    assert entry["status"] == "timeout" and "3 passed, 1 failed" in entry["tail"]
    assert entry["seconds"] < 30


def test_a_step_past_the_budget_is_skipped_and_fails_the_check(tmp_path):
    now = [0.0]
    check = gpu_check.Check(tmp_path, budget=100, clock=lambda: now[0],
                            limits={"first": (50, 0), "second": (50, 30)})
    assert check.timeout_for("first") == 50
    now[0] = 40.0
    assert check.timeout_for("first") == 30          # 30 s kept back for "second"
    now[0] = 99.0
    entry = check.step("first", [PY, "-c", "pass"])
    assert entry["status"] == "skipped"
    assert gpu_check.verdict(check.report, True, [])[1] == ["first"]
    # a budget smaller than all the reserves: they keep back half, the first step still runs
    small = gpu_check.Check(tmp_path, budget=30, clock=lambda: 0.0,
                            limits={"first": (50, 0), "second": (50, 60)})
    assert small.timeout_for("first") == 15


def test_a_task_that_raises_is_an_error_with_its_traceback(tmp_path):
    check = gpu_check.Check(tmp_path, budget=60, limits={"t": (10, 0)})

    def broken(timeout):
        raise FileNotFoundError("no .whl here")
    assert check.task("t", broken)["status"] == "error"
    assert "FileNotFoundError: no .whl here" in check.report["steps"]["t"]["tail"]
    check.attach("summary", lambda: json.loads("not json"))
    assert check.report["summary"] is None
    assert "JSONDecodeError" in check.report["errors"]["summary"]


def test_the_report_is_written_when_the_steps_themselves_break(tmp_path, monkeypatch):
    def run_steps(check, args, out, run_names):
        check.step("probe", [PY, "-c", "pass"])
        raise RuntimeError("something nobody expected")
    monkeypatch.setattr(gpu_check, "run_steps", run_steps)
    assert gpu_check.main(["--report", str(tmp_path), "--allow-cpu"]) == 1
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["ok"] is False and report["complete"] is False
    assert "something nobody expected" in report["aborted"]
    assert report["steps"]["probe"]["status"] == "ok"
    assert report["steps"]["ranks_global_model_on_device"]["status"] == "not run"
    assert "ranks_global_model_on_device" in report["failed_steps"]
    assert (tmp_path / "gpu_check.log").exists()


def _running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's reaper may be slow to collect it)."""
    for _ in range(20):
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return False
        if state in ("Z", "X"):
            return False
        time.sleep(0.1)
    return True


def _elf(path, size=64):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"\x7fELF" + bytes(size))


@pytest.mark.parametrize("site", ["lib/python3.12/site-packages",
                                  "local/lib/python3.12/dist-packages",
                                  "lib64/python3.12/site-packages"])
def test_the_prefix_layout_is_found_wherever_pip_put_it(tmp_path, site):
    data = tmp_path / ("local" if site.startswith("local") else "")
    (tmp_path / site / "mpi4py-4.1.2.dist-info").mkdir(parents=True)
    (tmp_path / site / "mpi4py").mkdir()
    _elf(data / "bin" / "mpiexec")
    (data / "lib").mkdir(parents=True, exist_ok=True)
    (data / "lib" / "libmpi.so").write_text("INPUT(libmpi.so.12)\n")   # a linker script
    _elf(data / "lib" / "libmpi.so.12")
    layout = gpu_check.prefix_layout(tmp_path)
    assert layout["site"] == [str(tmp_path / site)]
    assert layout["mpiexec"] == str(data / "bin" / "mpiexec")
    assert layout["libmpi"] == str(data / "lib" / "libmpi.so.12")

    env = gpu_check.layout_env(layout, {"PATH": "/usr/bin", "PYTHONPATH": "/old"}, True)
    assert env["PYTHONPATH"].split(os.pathsep) == [str(ROOT / "src"), str(tmp_path / site),
                                                   "/old"]
    assert env["PATH"].split(os.pathsep)[0] == str(data / "bin")
    assert env["LD_LIBRARY_PATH"] == str(data / "lib")
    assert env["MPI4PY_LIBMPI"] == layout["libmpi"]
    # the MPI found here instead: the prefix's packages only
    assert set(gpu_check.layout_env(layout, {}, False)) == {"PYTHONPATH"}


def test_pytest_counts_from_junit_else_from_the_output(tmp_path):
    junit = tmp_path / "t.xml"
    junit.write_text('<testsuites><testsuite tests="10" failures="1" errors="2" skipped="3">'
                     '</testsuite></testsuites>')
    counts = gpu_check.pytest_counts(junit, "")
    assert (counts["passed"], counts["failed"], counts["error"], counts["skipped"]) == (4, 1, 2, 3)
    counts = gpu_check.pytest_counts(tmp_path / "none.xml", "WARNING x\n5 passed, 2 skipped in 1s")
    assert (counts["passed"], counts["skipped"], counts["source"]) == (5, 2, "output")


def test_verdict_needs_cuda_and_every_run_with_all_its_ranks():
    steps = {"build": {"status": "ok"}, "wheels": {"status": "off"}}
    runs = {"r": {"ranks": gpu_check.RANKS}}
    assert gpu_check.verdict({"steps": steps, "ashl": {"cuda": True}, **runs}, False, ["r"])[0]
    assert not gpu_check.verdict({"steps": steps, "ashl": {"cuda": False}, **runs}, False,
                                 ["r"])[0]
    assert gpu_check.verdict({"steps": steps, "ashl": {"cuda": False}, **runs}, True, ["r"])[0]
    assert not gpu_check.verdict({"steps": steps, "r": {"ranks": 2}}, True, ["r"])[0]
    assert not gpu_check.verdict({"steps": steps, "r": None}, True, ["r"])[0]
