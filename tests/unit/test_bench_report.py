"""The benchmark's scenario arithmetic, its throughput against the ideal, its figures and the
scale report: pure functions over summaries and traces."""

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ashl.bench import e2e, report, scale, scenario
from ashl.cli import OptionError

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def rank(steps, factor, step_s, overruns=0):
    emulation = {"factor": factor, "step_s": step_s, "steps": steps, "overruns": overruns}
    return {"counters": {"local_steps": steps, "emulation": emulation}}


def test_the_comm_compute_ratio_is_resnet18_on_v100s_over_10_gbit():
    assert scenario.RESNET18_BYTES / scenario.TEN_GBIT_BYTES_PER_S == pytest.approx(0.03576, rel=1e-3)
    assert scenario.V100_RESNET18_STEP_S == pytest.approx(0.0494, rel=1e-2)
    assert scenario.COMM_COMPUTE_RATIO == pytest.approx(0.72, abs=0.01)


@given(nbytes=st.integers(1, 10**9), step=st.floats(1e-4, 10), ratio=st.floats(0.01, 100))
def test_the_matched_link_moves_the_model_in_ratio_steps(nbytes, step, ratio):
    link = scenario.matched_link(nbytes, step, ratio, latency_s=0.0)
    assert link.delay(nbytes) == pytest.approx(ratio * step, rel=1e-9)


@pytest.mark.parametrize("args", [(0, 0.1), (10, 0), (10, 0.1, -1)])
def test_the_matched_link_refuses_nonsense(args):
    with pytest.raises(ValueError):
        scenario.matched_link(*args)


def test_the_default_scenario_is_a_million_parameter_model_on_mnist():
    assert scenario.model_bytes(scenario.MODEL, scenario.DATASET) == 4 * 1_021_034


def test_throughput_against_the_sum_of_every_ranks_own_speed():
    s = {"batch_size": 32, "wall_s": 10.0,
         "per_rank": [rank(400, 1, 0.025), rank(100, 4, 0.025, overruns=5)]}
    t = report.throughput(s)
    assert t["samples_per_s"] == pytest.approx(500 * 32 / 10)
    assert t["ideal_samples_per_s"] == pytest.approx(32 * (40 + 10))
    assert t["throughput_fraction"] == pytest.approx(1600 / 1600)
    assert t["emulated_steps"] == 500 and t["overruns"] == 5


def test_without_emulated_step_times_there_is_no_ideal():
    s = {"batch_size": 32, "wall_s": 2.0,
         "per_rank": [{"counters": {"local_steps": 10, "emulation": {"factor": 2, "steps": 10,
                                                                      "overruns": 0}}}]}
    t = report.throughput(s)
    assert t["samples_per_s"] == 160 and t["ideal_samples_per_s"] is None
    assert t["throughput_fraction"] is None
    assert report.throughput({})["samples_per_s"] is None


def span(name, pid, ts, dur):
    return {"name": name, "ph": "X", "pid": pid, "tid": 0, "ts": ts, "dur": dur}


def test_the_round_window_covers_the_slowest_ranks_round():
    spans = [span("compute", 0, 0, 100), span("commit", 0, 100, 10),
             span("compute", 0, 110, 100), span("commit", 0, 210, 10),
             span("compute", 1, 0, 400), span("commit", 1, 400, 50),
             span("compute", 1, 450, 400), span("commit", 1, 850, 50)]
    lo, hi = report.round_window(spans, at=0.5)
    assert lo == pytest.approx(450) and hi - lo == pytest.approx(450)
    assert report.round_window([]) is None


def test_the_figures_are_written(tmp_path):
    trace = tmp_path / "timeline.json"
    trace.write_text(json.dumps({"traceEvents": [span("compute", 0, 0, 100),
                                                 span("commit", 0, 100, 30),
                                                 {"name": "eval", "ph": "i", "pid": 0}]}))
    report.plot_accuracy([("a", [{"t": 0, "accuracy": 0.1}, {"t": 1, "accuracy": 0.9}])],
                         str(tmp_path / "acc.png"), 0.9, "t")
    report.plot_utilization([("a", [0.5, 0.9]), ("b", [])], str(tmp_path / "u.png"), "t")
    report.plot_round_timelines([("a", str(trace)), ("gone", str(tmp_path / "no.json"))],
                                str(tmp_path / "r.png"), "t")
    for name in ("acc.png", "u.png", "r.png"):
        assert (tmp_path / name).read_bytes()[:8] == PNG_MAGIC


def test_seeds_combine_throughput_as_medians_and_overruns_as_sums():
    runs = [{"strategy": "ashl", "status": "ok", "run_dir": "x", "time_to_target_s": t,
             "final_accuracy": 0.95, "throughput_fraction": f, "samples_per_s": 100 * f,
             "emulated_steps": 100, "overruns": o}
            for t, f, o in ((1.0, 0.8, 1), (2.0, 0.9, 0), (3.0, 0.7, 2))]
    r = e2e.combine_seeds(runs)
    assert r["throughput_fraction"] == 0.8 and r["throughput_fraction_range"] == [0.7, 0.9]
    assert r["emulated_steps"] == 300 and r["overruns"] == 3
    assert e2e._fraction_cell(r) == "80% [70%-90%]" and e2e._overrun_cell(r) == "1.0%"


def test_scale_counts_are_checked():
    assert scale.parse_counts("4,8,16") == [4, 8, 16]
    for bad in ("", "4,x", "0,4", "4,4"):
        with pytest.raises(OptionError, match="--ranks"):
            scale.parse_counts(bad)


def test_scale_reads_the_servers_figures_and_tabulates(tmp_path):
    (tmp_path / "summary.json").write_text(json.dumps(
        {"server": {"busy_fraction": 0.25, "commit_latency_ms": {"median": 1.5, "p95": 4.0}}}))
    r = {"strategy": "ashl", "status": "ok", "run_dir": str(tmp_path), "utilization": [0.9, 0.8],
         "throughput_fraction": 0.85, "samples_per_s": 1000.0, "final_accuracy": 0.9,
         "emulated_steps": 1000, "overruns": 0}
    x = scale.row(8, r)
    assert x["server_busy_fraction"] == 0.25 and x["commit_latency_ms_p95"] == 4.0
    assert x["utilization_min"] == 0.8
    failed = scale.row(16, {"strategy": "bsp", "status": "timeout"})
    assert failed["commit_latency_ms_median"] is None
    md = scale.table([x, failed])
    assert "| ashl | 8 | 85% | 1000 | 85% | 80% | 1.5 / 4.0 | 25% | 0.0% | 0.9000 |" in md
    assert "| bsp | 16 | TIMEOUT |" in md
    scale.plot([x, failed], str(tmp_path / "s.png"), "t")
    assert (tmp_path / "s.png").read_bytes()[:8] == PNG_MAGIC
