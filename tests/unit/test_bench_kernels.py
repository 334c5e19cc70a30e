"""Smoke test of ``python -m ashl.bench kernels --quick``: it runs, checks every torch variant
against ashl (inside the benchmark) and writes JSON of the documented schema."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from ashl.bench import shapes
from ashl.bench.kernels import BANDWIDTH_DRIFT, LISTS, OPS, bandwidth_drift, make_row

CASE_KEYS = {"op": str, "tensors": str, "numel": int, "ashl_s": float,
             "foreach_s": (float, type(None)), "flat_s": float,
             "speedup_vs_foreach": (float, type(None)), "speedup_vs_flat": float,
             "ashl_median_s": float, "flat_median_s": float, "speedup_vs_flat_median": float,
             "bandwidth_fraction": float}


def test_model_shapes():
    s = shapes.model_shapes()
    assert shapes.numel(s["vgg16"]) == 14_728_266  # kuangliu VGG16 (BN, Linear(512, 10))
    assert shapes.numel(s["resnet18"]) == 11_173_962  # kuangliu ResNet18
    assert 20_000_000 <= shapes.numel(s["transformer"]) <= 30_000_000
    assert 150 <= len(s["transformer"]) <= 400
    # the same tensors, a seventh of the elements: the list where a cost per tensor shows
    assert len(s["transformer-small"]) == len(s["transformer"])
    assert shapes.numel(s["transformer-small"]) < shapes.numel(s["transformer"]) // 5
    for lst in s.values():
        assert all(isinstance(n, str) and all(d > 0 for d in shape) for n, shape in lst)
        assert len({n for n, _ in lst}) == len(lst)  # unique names


def test_cli_help():
    r = subprocess.run([sys.executable, "-m", "ashl.bench", "--help"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0 and "kernels" in r.stdout
    r = subprocess.run([sys.executable, "-m", "ashl.bench"], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2 and "COMMAND" in r.stderr


@pytest.mark.timeout(120)
@pytest.mark.parametrize("storage", ["flat", "separate"])
def test_kernels_quick_json(tmp_path, storage):
    """Every variant checked against ashl's result in the run itself (check_case), for a model
    stored either way."""
    path = tmp_path / "out" / "kernels.json"
    env = dict(os.environ, OMP_NUM_THREADS="1")  # a smoke test: don't fight other jobs for cores
    r = subprocess.run([sys.executable, "-m", "ashl.bench", "kernels", "--quick", "--repeat", "1",
                        "--warmup", "1", "--storage", storage, "--json", str(path)],
                       capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "x foreach" in r.stdout and f"storage: {storage}" in r.stdout  # the table
    data = json.loads(path.read_text())
    assert data["storage"] == storage
    assert data["bandwidth_gbps"] == max(data["bandwidth_before_gbps"], data["bandwidth_after_gbps"])
    assert data["reliable"] == (data["bandwidth_drift"] <= BANDWIDTH_DRIFT)
    assert ("UNRELIABLE" in r.stdout) == (not data["reliable"])
    assert isinstance(data["device"], str) and data["device"].startswith("cpu")
    assert isinstance(data["threads"], int) and data["threads"] >= 1
    cases = data["cases"]
    assert {(c["op"], c["tensors"]) for c in cases} == {(o, t) for o in OPS for t in LISTS}
    for c in cases:
        for k, typ in CASE_KEYS.items():
            assert isinstance(c[k], typ), (k, c)
        assert c["ashl_s"] > 0 and c["flat_s"] > 0 and c["bandwidth_fraction"] > 0
        assert (c["foreach_s"] is None) == (c["op"] == "merge_sparse")
        if c["foreach_s"] is not None:
            assert c["speedup_vs_foreach"] == pytest.approx(c["foreach_s"] / c["ashl_s"])
        assert c["speedup_vs_flat"] == pytest.approx(c["flat_s"] / c["ashl_s"])
        assert c["ashl_median_s"] >= c["ashl_s"] and c["flat_median_s"] >= c["flat_s"]


def test_a_row_compares_minimums_and_reports_medians_beside_them():
    class Case:
        op, tensors, numel, bytes, notes = "pack_delta", "vgg16", 10, 1200, ""
    row = make_row(Case, {"ashl": [3.0, 1.0, 2.0], "flat": [2.0, 4.0, 6.0], "foreach": [9.0]},
                   bandwidth=1000.0, n_tensors=2)
    assert (row["ashl_s"], row["ashl_median_s"], row["flat_median_s"]) == (1.0, 2.0, 4.0)
    assert row["speedup_vs_flat"] == 2.0 and row["speedup_vs_flat_median"] == 2.0
    assert row["bandwidth_fraction"] == pytest.approx(1.2)


def test_bandwidth_readings_far_apart_are_flagged():
    assert bandwidth_drift(50.0, 50.0) == 0.0
    assert bandwidth_drift(50.0, 45.0) == pytest.approx(0.10)
    assert bandwidth_drift(40.0, 50.0) == pytest.approx(0.2) and BANDWIDTH_DRIFT < 0.2


def test_cuda_refused_without_gpu(tmp_path):
    import torch
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    r = subprocess.run([sys.executable, "-m", "ashl.bench", "kernels", "--quick", "--device",
                        "cuda"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "cuda" in r.stderr


def test_sparse_merge_runs_at_the_default_plans_ratio_or_the_one_asked(capsys):
    import torch

    from ashl.bench import kernels as bench_kernels
    from ashl.bench.__main__ import build_parser

    from ashl.bench.kernels import SPARSE_RATIO, ListData, build_case
    import ashl.kernels as K
    from ashl.planner import PlannerConfig
    assert SPARSE_RATIO == PlannerConfig().shl_target_ratio
    L = ListData("resnet18", shapes.model_shapes(quick=True)["resnet18"], torch.device("cpu"), 0,
                 "flat")
    for ratio in (SPARSE_RATIO, 0.01):
        case = build_case("merge_sparse", L, K, ratio)
        assert f"nnz={max(1, int(L.n * ratio))} sorted" in case.notes
    for bad in ("0", "1.5", "-0.1", "nan"):
        args = build_parser("kernels").parse_args(["kernels", "--quick", "--sparse-ratio", bad])
        assert bench_kernels.run(args) == 2
        assert "--sparse-ratio must be in (0, 1]" in capsys.readouterr().err
