"""``python -m ashl.bench e2e``: option checks, the report's pieces, a failing launcher
reported without ending the benchmark, and a small real comparison under mpirun."""

import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

import _util  # noqa: E402

from ashl.bench import SUBCOMMANDS, e2e  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def bench(*args, timeout=120):
    return _util.bench("e2e", *args, timeout=timeout)


def test_registered_as_a_bench_subcommand():
    assert SUBCOMMANDS["e2e"][0] == "ashl.bench.e2e"


def test_default_strategies_are_the_known_ones_ashl_first():
    names = e2e.default_strategies()
    from ashl.strategies import STRATEGIES
    assert set(names) == set(STRATEGIES) and names[0] == "ashl"


def test_default_cluster_per_rank_count():
    assert e2e.default_factors(4) == [1, 1, 2, 4]
    assert e2e.default_factors(6) == [1, 1, 2, 4, 1, 1]
    assert e2e.default_factors(2) == [1, 4] and e2e.default_factors(1) == [1]
    assert e2e.rank_factors("--x", "1,2", 4) == [1, 2, 1, 1]
    assert e2e.rank_factors("--x", None, 4) == e2e.default_factors(4)


def test_homogeneous_scenario_sets_every_factor_to_one(tmp_path):
    out = tmp_path / "e2e.json"
    proc = bench("--ranks", "3", "--homogeneous", "--strategies", "ashl", "--mpirun", "false",
                 "--mpirun-args", "", "--json", out, timeout=60)
    assert proc.returncode == 1
    sc = json.loads(out.read_text())["scenario"]
    assert sc["name"] == "homogeneous"
    assert sc["compute_slowdown"] == [1, 1, 1] and sc["link_slowdown"] == [1, 1, 1]
    log = (tmp_path / "ashl" / "log.txt").read_text()
    assert "--compute-slowdown 1,1,1 --link-slowdown 1,1,1" in log


@pytest.mark.parametrize("args,needle", [
    (["--strategies", "ashl,nope"], "'nope'"),
    (["--strategies", "ashl,ashl"], "twice"),
    (["--ranks", "2", "--compute-slowdown", "1,2,3"], "--compute-slowdown '1,2,3'"),
    (["--link-slowdown", "1,x"], "--link-slowdown '1,x'"),
    (["--max-seconds", "0"], "--max-seconds"),
    (["--target-accuracy", "95"], "--target-accuracy"),
    (["--transport", "tcp"], "--transport 'tcp'"),
])
def test_bad_options_exit_2_with_one_line(args, needle, tmp_path):
    _util.check_bad_bench_option("e2e", args, needle, tmp_path)


def fake(strategy, ttt, wall=10.0, status="ok", **kw):
    r = {"strategy": strategy, "status": status, "time_to_target_s": ttt, "final_accuracy": 0.95,
         "utilization": [0.9, 0.5], "bytes_sent": 2_000_000, "commits": 40, "wall_s": wall}
    r.update(kw)
    return r


def test_speedups_and_table():
    results = [fake("ashl", 2.0), fake("bsp", 5.0), fake("asp", None, wall=30.0),
               {"strategy": "ssp", "status": "failed", "error": "exit status 1"}]
    exact, at_least = e2e.speedups(results, "ashl")
    assert exact == {"bsp": 2.5, "asp": None, "ssp": None}
    assert at_least == {"asp": 15.0}
    md = e2e.table(results, 0.93, "ashl", exact, at_least)
    lines = md.splitlines()
    assert lines[0].startswith("| strategy | time to 0.93 [s]") and len(lines) == 2 + 4
    assert "| bsp | 5.00 |" in md and "2.50x" in md and "> 15.00x" in md
    assert "| asp | missed |" in md and "| ssp | FAILED |" in md
    assert "70%" in md   # mean utilisation
    assert "| busy min |" in lines[0] and "| 70% | 50% | - |" in md   # no busy figures here


def test_the_speedup_interval_is_a_deterministic_bootstrap_of_the_ratio_of_medians():
    same = e2e.speedup_interval([2.0] * 5, [3.0] * 4)
    assert same == (1.5, 1.5)                                 # no spread: the ratio itself
    assert e2e.speedup_interval([1.0, 2.0], [3.0] * 5) is None     # fewer than 3 seeds
    mine, other = [30.0, 35.0, 28.0, 41.0, 33.0], [37.0, 31.0, 55.0, 44.0, 36.0]
    lo, hi = e2e.speedup_interval(mine, other)
    assert lo < 37.0 / 33.0 < hi and lo < 1.0 < hi            # this spread covers 1
    assert e2e.speedup_interval(mine, other) == (lo, hi)       # the same every time
    # a missed seed is the slowest; a resample whose medians both missed counts as 1
    lo, hi = e2e.speedup_interval([1.0, math.inf, math.inf], [math.inf] * 3)
    assert lo == 1.0 and hi == math.inf


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(1.0, 100.0), min_size=3, max_size=8),
       st.lists(st.floats(1.0, 100.0), min_size=3, max_size=8), st.floats(0.5, 4.0))
def test_the_speedup_interval_is_ordered_and_scales_with_the_times(mine, other, c):
    lo, hi = e2e.speedup_interval(mine, other)
    assert 0 < lo <= hi
    assert min(other) / max(mine) <= lo and hi <= max(other) / min(mine)
    slo, shi = e2e.speedup_interval(mine, [c * t for t in other])   # the same resamples
    assert slo == pytest.approx(c * lo) and shi == pytest.approx(c * hi)


def test_the_table_and_report_give_the_interval_of_a_strategy_with_3_seeds_or_more():
    def seeded(name, times):
        runs = [dict(fake(name, t), run_dir="x") for t in times]
        return e2e.combine_seeds(runs)

    results = [seeded("ashl", [2.0, 2.2, 1.8]), seeded("adsp", [3.0, 2.4, 2.6]),
               fake("bsp", 5.0)]
    exact, at_least = e2e.speedups(results, "ashl")
    intervals = e2e.speedup_intervals(results, "ashl")
    assert set(intervals) == {"adsp"}                          # bsp ran one seed
    lo, hi = intervals["adsp"]
    assert lo <= exact["adsp"] <= hi
    md = e2e.table(results, 0.93, "ashl", exact, at_least, intervals)
    assert f"{exact['adsp']:.2f}x [{lo:.2f}-{hi:.2f}]" in md and "| 2.50x |" in md


def test_seeds_combine_into_medians_with_their_range():
    runs = [fake("ashl", 2.0, final_accuracy=0.95, utilization=[0.8, 0.4], busy=[0.9, 0.4]),
            fake("ashl", None, final_accuracy=0.90, utilization=[0.6, 0.2], busy=[0.7, 0.2]),
            fake("ashl", 1.0, final_accuracy=0.97, utilization=[0.9, 0.5], busy=[0.95, 0.5])]
    for r in runs:
        r["run_dir"] = "x"
    r = e2e.combine_seeds(runs)
    # the missed seed counts as the slowest: the median of (1, 2, missed) is 2
    assert r["time_to_target_s"] == 2.0 and r["time_to_target_range"] == [1.0, None]
    assert r["missed_seeds"] == 1 and r["seeds_ok"] == 3
    assert r["final_accuracy"] == 0.95 and r["final_accuracy_range"] == [0.90, 0.97]
    assert r["utilization"] == [0.8, 0.4] and r["busy"] == [0.9, 0.4]
    assert e2e._time_cell(r) == "2.00 [1.00-missed]"
    two_missed = e2e.combine_seeds([dict(runs[1]), dict(runs[1]), dict(runs[2])])
    assert two_missed["time_to_target_s"] is None            # most seeds missed
    crashed = dict(runs[0], status="timeout", time_to_target_s=None)
    r = e2e.combine_seeds([crashed, dict(runs[0]), dict(runs[2])])   # a crash counts as missed
    assert r["time_to_target_s"] == 2.0 and r["time_to_target_range"] == [1.0, None]
    assert e2e._time_cell(r) == "2.00 [1.00-missed] (1 of 3 seeds failed)"
    assert e2e.combine_seeds(runs[:1]) is runs[0]             # one seed: as it is
    failed = e2e.combine_seeds([{"strategy": "ashl", "status": "failed", "error": "e",
                                 "run_dir": "x"}] * 2)
    assert failed["status"] == "failed" and failed["seeds_ok"] == 0


def test_seeds_and_variants_are_checked_and_reach_the_command_line(tmp_path):
    assert e2e.parse_seeds(None, 7) == [7] and e2e.parse_seeds("0,1,2", 7) == [0, 1, 2]
    for text in ("0,x", "1,1", "-1", ","):
        with pytest.raises(e2e.OptionError, match="--seeds"):
            e2e.parse_seeds(text, 0)
    assert e2e.run_dir_name("ashl+nesterov(0.7, 0.5)", 3, [3]) == "ashl+nesterov_0.7_0.5"
    assert e2e.run_dir_name("ashl", 3, [2, 3]) == "ashl/seed3"
    out = tmp_path / "e2e.json"
    proc = bench("--ranks", "2", "--strategies", "ashl+delayed-nesterov(0.5, 0.5),diloco",
                 "--seeds", "4,5", "--mpirun", "false", "--mpirun-args", "", "--json", out,
                 timeout=60)
    assert proc.returncode == 1
    log = (tmp_path / "ashl+delayed-nesterov_0.5_0.5" / "seed5" / "log.txt").read_text()
    assert "--strategy ashl --outer-optimizer 'delayed-nesterov(0.5, 0.5)'" in log
    assert "--seed 5" in log
    report = json.loads(out.read_text())
    assert report["scenario"]["seeds"] == [4, 5]
    assert [r["strategy"] for r in report["results"]] == ["ashl+delayed-nesterov(0.5, 0.5)",
                                                          "diloco"]
    assert [len(r["seeds"]) for r in report["results"]] == [2, 2]


def test_a_transport_reaches_the_parameter_server_strategies_only(tmp_path):
    out = tmp_path / "e2e.json"
    proc = bench("--ranks", "2", "--strategies", "asp,localsgd", "--transport", "mpi",
                 "--mpirun", "false", "--mpirun-args", "", "--json", out, timeout=60)
    assert proc.returncode == 1
    assert "--transport mpi" in (tmp_path / "asp" / "log.txt").read_text()
    assert "--transport" not in (tmp_path / "localsgd" / "log.txt").read_text()
    assert json.loads(out.read_text())["scenario"]["transport"] == "mpi"


def test_a_variant_has_one_spelling():
    assert e2e.parse_strategies("ashl+nesterov, ashl+delayed-nesterov(0.5,0.5, 3)", []) == [
        "ashl+nesterov(0.7, 0.9)", "ashl+delayed-nesterov(0.5, 0.5, 3)"]
    with pytest.raises(e2e.OptionError, match="named twice"):
        e2e.parse_strategies("ashl+nesterov(0.7, 0.5),ashl+nesterov(0.7,0.5)", [])


@pytest.mark.parametrize("text, needle", [
    ("bsp+nesterov", "'bsp+nesterov': strategy bsp averages gradients every step"),
    ("ashl+adam", "'ashl+adam': expected none, nesterov(lr, momentum)"),
    ("nope+nesterov", "unknown 'nope+nesterov'"),
])
def test_a_bad_variant_is_an_option_error(text, needle):
    with pytest.raises(e2e.OptionError, match=re.escape(needle)):
        e2e.parse_strategies(text, [])


def test_a_failing_launcher_is_reported_and_the_rest_still_runs(tmp_path):
    """Every run fails (the launcher is `false`): each is reported, the JSON, table and plot
    are still written, and the exit status says something failed."""
    out = tmp_path / "e2e.json"
    proc = bench("--ranks", "2", "--strategies", "ashl,ashl-sync", "--mpirun", "false",
                 "--mpirun-args", "", "--max-seconds", "5", "--json", out, timeout=60)
    assert proc.returncode == 1, proc.stderr
    report = json.loads(out.read_text())
    assert [r["strategy"] for r in report["results"]] == ["ashl", "ashl-sync"]
    assert all(r["status"] == "failed" and "exit status" in r["error"] for r in report["results"])
    assert "FAILED" in (tmp_path / "e2e.md").read_text()
    assert "2 strategies failed" in proc.stderr


def test_a_run_past_its_timeout_is_killed_and_reported(tmp_path):
    hang = tmp_path / "hang.sh"
    hang.write_text("#!/bin/sh\nsleep 60 &\nwait\n")   # a launcher whose child hangs too
    hang.chmod(0o755)
    out = tmp_path / "e2e.json"
    t0 = time.monotonic()
    proc = bench("--ranks", "1", "--strategies", "ashl", "--mpirun", hang, "--mpirun-args", "",
                 "--timeout", "2", "--json", out, timeout=60)
    assert proc.returncode == 1
    r, = json.loads(out.read_text())["results"]
    assert r["status"] == "timeout" and "killed after 2 s" in r["error"]
    assert time.monotonic() - t0 < 30


def _alive(pid: int) -> bool:
    """Running (a zombie whose parent has gone is dead, whether or not init reaps it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def test_a_benchmark_ended_by_sigterm_ends_the_run_it_launched(tmp_path):
    """A killed benchmark leaves no launcher and no rank behind (they are in their own process
    group, which the benchmark kills on its way out)."""
    pids = tmp_path / "pids"
    hang = tmp_path / "hang.sh"
    hang.write_text(f"#!/bin/sh\nsleep 60 &\necho $$ $! > {pids}\nwait\n")
    hang.chmod(0o755)
    proc = subprocess.Popen([sys.executable, "-m", "ashl.bench", "e2e", "--ranks", "1",
                             "--strategies", "ashl", "--mpirun", str(hang), "--mpirun-args", "",
                             "--json", str(tmp_path / "e2e.json")], env=_util.mpi_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not (pids.exists() and len(pids.read_text().split()) == 2):
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr
        time.sleep(0.1)
    launcher, child = map(int, pids.read_text().split())
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 128 + signal.SIGTERM
    while (_alive(launcher) or _alive(child)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(launcher) and not _alive(child)


@pytest.mark.mpi
@pytest.mark.skipif(_util.skip_reason() is not None, reason=_util.skip_reason() or "")
def test_two_strategies_on_two_ranks(tmp_path):
    """The default scenario (MNIST, mnistnet, GPU-like steps, the matched link), shortened."""
    out = tmp_path / "bench" / "e2e.json"
    t0 = time.monotonic()
    proc = bench("--ranks", "2", "--strategies", "ashl,ashl-sync", "--compute-slowdown", "1,3",
                 "--link-slowdown", "1,2", "--step-time", "0.01", "--max-seconds", "30",
                 "--target-accuracy", "0.9", "--timeout", "60", "--json", out, timeout=160)
    took = time.monotonic() - t0
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    report = json.loads(out.read_text())
    sc = report["scenario"]
    assert sc["ranks"] == 2 and sc["compute_slowdown"] == [1.0, 3.0]
    assert sc["link_slowdown"] == [1.0, 2.0] and sc["target_accuracy"] == 0.9
    assert sc["name"] == "heterogeneous"
    assert (sc["model"], sc["dataset"], sc["step_time_s"]) == ("mnistnet", "mnist", 0.01)
    # the factor-1 link moves the 4 MB model in 0.72 steps (and its 0.5 ms latency)
    assert sc["comm_compute_ratio"] == pytest.approx(0.72 + 0.05, abs=0.01)
    assert [r["strategy"] for r in report["results"]] == ["ashl", "ashl-sync"]
    for r in report["results"]:
        assert r["status"] == "ok", r
        for key in ("time_to_target_s", "final_accuracy", "utilization", "bytes_sent", "commits"):
            assert key in r, key
        assert r["time_to_target_s"] is not None and r["time_to_target_s"] > 0
        assert r["final_accuracy"] >= 0.9
        assert len(r["utilization"]) == 2 and all(0 < u <= 1.05 for u in r["utilization"])
        assert r["busy"][0] > r["utilization"][0]    # rank 0 also evaluates
        assert r["bytes_sent"] > 0 and r["commits"] > 0
        assert (Path(r["run_dir"]) / "summary.json").exists()
        # ranks of factors 1 and 3 at 10 ms a step: 32 x (100 + 33.3) samples/s at best
        assert r["ideal_samples_per_s"] == pytest.approx(32 * (100 + 100 / 3))
        assert 0 < r["throughput_fraction"] <= 1.05
        assert r["emulated_steps"] > 0 and 0 <= r["overruns"] <= r["emulated_steps"]
    assert report["speedup_of"] == "ashl"
    assert set(report["speedup_vs"]) == {"ashl-sync"} and report["speedup_vs"]["ashl-sync"] > 0
    assert set(report["speedups"]) == {"ashl", "ashl-sync"}
    md = (out.parent / "e2e.md").read_text()
    assert "| ashl |" in md and "| ashl-sync |" in md
    assert "| strategy |" in proc.stdout
    for png in ("e2e.png", "e2e.utilization.png", "e2e.rounds.png"):
        assert (out.parent / png).read_bytes()[:8] == PNG_MAGIC
        assert f"plot:    {out.parent / png}" in proc.stdout
    assert "| of ideal |" in md
    print(f"e2e with 2 strategies on 2 ranks: {took:.0f} s")


def test_scale_writes_its_report_where_json_says_even_when_out_is_elsewhere(tmp_path, monkeypatch):
    """The report's folder is made before the runs (a missing one lost every run's result
    after the last); the runs themselves are replaced here: only the report is under test."""
    import argparse
    from ashl.bench import scale
    p = argparse.ArgumentParser()
    scale.add_arguments(p)
    json_path = tmp_path / "report" / "nested" / "scale.json"
    args = p.parse_args(["--strategies", "ashl", "--ranks", "4,8", "--out", str(tmp_path / "runs"),
                         "--json", str(json_path)])
    from ashl.bench import scenario
    assert args.step_time == scenario.STEP_TIME_S   # the e2e scenario, at every rank count
    seen = []

    def fake_run_all(a, setup, out):
        seen.append((a.ranks, out))
        return [{"strategy": "ashl", "status": "ok", "throughput_fraction": 0.9,
                 "samples_per_s": 100.0 * a.ranks, "ideal_samples_per_s": 111.0 * a.ranks,
                 "utilization": [0.9] * a.ranks, "final_accuracy": 0.97, "overruns": 0,
                 "emulated_steps": 10, "run_dir": out}]

    monkeypatch.setattr(scale.e2e, "run_all", fake_run_all)
    assert scale.run(args) == 0
    assert [n for n, _ in seen] == [4, 8] and all(o.startswith(str(tmp_path / "runs"))
                                                  for _, o in seen)
    report = json.loads(json_path.read_text())
    assert [r["ranks"] for r in report["rows"]] == [4, 8]
    assert "| ashl | 8 | 90% | 800 |" in (json_path.with_suffix(".md")).read_text()
