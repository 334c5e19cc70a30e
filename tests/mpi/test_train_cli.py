"""``python -m ashl.train``: option checks (one line, exit status 2, before MPI starts), the
helpers behind its outputs, and a real 3-rank run under mpirun."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import _util  # noqa: E402

from ashl import train  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def plain_env():
    """No launcher variables: the module runs as a plain process, MPI never starts."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OMPI_", "PMI_", "PMIX_", "MV2_", "ASHL_"))}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    return env


def run_cli(*args, timeout=60):
    return subprocess.run([sys.executable, "-m", "ashl.train", *map(str, args)],
                          capture_output=True, text=True, env=plain_env(), timeout=timeout)


BAD = [
    (["--compute-slowdown", "1,x,2"], ["--compute-slowdown", "'x'"]),
    (["--compute-slowdown", "1,,2"], ["--compute-slowdown", "''"]),
    (["--compute-slowdown", "1,0.5"], ["--compute-slowdown", "0.5", ">= 1"]),
    (["--link-slowdown", "inf"], ["--link-slowdown", "inf"]),
    (["--link-base", "0.001"], ["--link-base", "LATENCY_S,BYTES_PER_S"]),
    (["--link-base", "0.001,0"], ["--link-base", "bandwidth"]),
    (["--strategy", "sgd"], ["--strategy", "'sgd'", "ashl"]),
    (["--dataset", "mnist"], ["--dataset", "'mnist'", "digits"]),
    (["--dataset", "cifar10:/no/such/dir"], ["--dataset", "/no/such/dir", "does not exist"]),
    (["--dataset", "cifar10"], ["--dataset", "cifar10:DIR"]),
    (["--dataset", "synthetic:many"], ["--dataset", "synthetic:many"]),
    (["--max-seconds", "0"], ["--max-seconds", "> 0"]),
    (["--max-seconds", "-5"], ["--max-seconds", "-5"]),
    (["--max-seconds", "nan"], ["--max-seconds", "nan"]),
    (["--max-commits", "0"], ["--max-commits", ">= 1"]),
    (["--target-accuracy", "93"], ["--target-accuracy", "93", "(0, 1]"]),
    (["--batch-size", "0"], ["--batch-size", "0"]),
    (["--lr", "0"], ["--lr", "0"]),
    (["--profile-steps", "2"], ["--profile-steps", "2"]),
    (["--max-seconds", "abc"], ["--max-seconds", "abc"]),
    (["--no-such-option"], ["--no-such-option"]),
    (["--outer-optimizer", "nesterov(0.7)"], ["--outer-optimizer", "'nesterov(0.7)'",
                                              "takes (lr, momentum)"]),
    (["--strategy", "bsp", "--outer-optimizer", "nesterov"], ["--outer-optimizer",
                                                              "strategy bsp"]),
]


@pytest.mark.parametrize("args,needles", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_options_fail_with_one_line_naming_them(args, needles):
    t0 = time.monotonic()
    proc = run_cli(*args)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("ashl.train: error: "), lines[0]
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    assert proc.stdout == ""
    # Checked before torch, MPI or Horovod start: quick.
    assert time.monotonic() - t0 < 15


@pytest.mark.parametrize("model", ["resnet18", "vgg16"])
def test_big_models_need_32x32_images(model):
    proc = run_cli("--model", model)
    assert proc.returncode == 2
    line, = proc.stderr.strip().splitlines()
    assert f"--model '{model}'" in line and "32x32" in line and "'digits'" in line


def test_unknown_model_is_named():
    proc = run_cli("--model", "lenet")
    assert proc.returncode == 2
    line, = proc.stderr.strip().splitlines()
    assert "--model 'lenet'" in line and "mlp" in line and "cnn" in line


def test_out_must_be_a_directory(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    proc = run_cli("--out", f)
    assert proc.returncode == 2
    line, = proc.stderr.strip().splitlines()
    assert "--out" in line and str(f) in line


def test_a_broken_cifar_directory_is_reported_as_the_dataset(tmp_path):
    proc = run_cli("--dataset", f"cifar10:{tmp_path}", "--model", "mlp")
    assert proc.returncode == 2
    line, = proc.stderr.strip().splitlines()
    assert f"--dataset 'cifar10:{tmp_path}'" in line and "missing" in line


def test_help_lists_the_options():
    proc = run_cli("--help")
    assert proc.returncode == 0
    for opt in ("--strategy", "--model", "--dataset", "--compute-slowdown", "--link-slowdown",
                "--link-base", "--target-accuracy", "--max-seconds", "--max-commits", "--seed",
                "--batch-size", "--lr", "--out"):
        assert opt in proc.stdout


# ---------------------------------------------------------------- helpers, in process
def test_time_to_target_is_the_first_evaluation_at_or_above_it():
    rows = [{"t": 0.5, "accuracy": 0.5}, {"t": 1.0, "accuracy": 0.93},
            {"t": 2.0, "accuracy": 0.97}]
    assert train.time_to_target(rows, 0.93) == 1.0
    assert train.time_to_target(rows, 0.95) == 2.0
    assert train.time_to_target(rows, 0.99) is None
    assert train.time_to_target(rows, None) is None


def test_metrics_reader_skips_a_torn_last_line(tmp_path):
    p = tmp_path / "metrics.jsonl"
    p.write_text('{"t": 1, "accuracy": 0.5}\n{"t": 2, "accu')
    assert train.read_metrics(str(p)) == [{"t": 1, "accuracy": 0.5}]
    assert train.read_metrics(str(tmp_path / "none.jsonl")) == []


def test_plot_writes_a_png(tmp_path):
    rows = [{"t": 0.1 * i, "accuracy": min(1.0, 0.1 * i), "loss": 2.0 / (i + 1),
             "stage": "AHL" if i < 5 else "SHL"} for i in range(10)]
    path = tmp_path / "c.png"
    train.plot_curves(rows, str(path), "test", target=0.9)
    assert path.read_bytes()[:8] == PNG_MAGIC


def test_counters_become_json():
    import torch
    value = train._jsonable({"a": torch.tensor(3), "b": float("inf"), "c": (1, 2.5), "d": None})
    assert json.loads(json.dumps(value)) == {"a": 3, "b": None, "c": [1, 2.5], "d": None}


# ---------------------------------------------------------------- under mpirun
mpi = [pytest.mark.mpi,
       pytest.mark.skipif(_util.skip_reason() is not None, reason=_util.skip_reason() or "")]


def mpirun_train(np_, *args, timeout=90):
    cmd = ["mpirun", "-np", str(np_), "--oversubscribe", "--bind-to", "none",
           sys.executable, "-m", "ashl.train", *map(str, args)]
    env = _util.mpi_env()
    env["OMP_NUM_THREADS"] = "1"
    env.pop("ASHL_TIMELINE", None)
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)


@pytest.mark.mpi
@pytest.mark.skipif(_util.skip_reason() is not None, reason=_util.skip_reason() or "")
def test_a_slowdown_list_longer_than_the_ranks_is_refused_once():
    proc = mpirun_train(2, "--compute-slowdown", "1,2,3", "--out", "/tmp/unused-ashl-train")
    assert proc.returncode == 2, proc.stderr
    lines = [l for l in proc.stderr.splitlines() if l.startswith("ashl.train: error")]
    assert len(lines) == 1, proc.stderr      # every rank refuses, rank 0 says why
    assert "--compute-slowdown '1,2,3'" in lines[0] and "3 factors" in lines[0] \
        and "2 ranks" in lines[0]


@pytest.mark.mpi
@pytest.mark.skipif(_util.skip_reason() is not None, reason=_util.skip_reason() or "")
def test_three_ranks_reach_the_target_and_leave_every_output(tmp_path):
    out = tmp_path / "run"
    t0 = time.monotonic()
    proc = mpirun_train(3, "--strategy", "ashl", "--max-seconds", "60", "--target-accuracy",
                        "0.9", "--compute-slowdown", "1,2,3", "--out", out)
    took = time.monotonic() - t0
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert "ashl: 3 ranks" in proc.stdout and "results in" in proc.stdout

    s = json.loads((out / "summary.json").read_text())
    for key in ("strategy", "ranks", "time_to_target_s", "final_accuracy", "wall_s",
                "utilization", "bytes_sent", "commits", "plan", "per_rank", "stop_reason"):
        assert key in s, key
    assert s["strategy"] == "ashl" and s["ranks"] == 3
    assert s["compute_slowdown"] == [1.0, 2.0, 3.0]
    assert s["final_accuracy"] >= 0.9
    assert s["time_to_target_s"] is not None and 0 < s["time_to_target_s"] <= s["wall_s"] + 1
    assert s["wall_s"] < 60 + 15
    assert "target accuracy" in s["stop_reason"]
    assert len(s["utilization"]) == 3 and all(0 < u <= 1.05 for u in s["utilization"])
    assert s["commits"] > 0 and s["bytes_sent"] > 0
    assert isinstance(s["plan"], dict) and s["plan"]
    assert [r["rank"] for r in s["per_rank"]] == [0, 1, 2]
    assert s["commits"] == sum(r["counters"]["commits"] for r in s["per_rank"])

    rows = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) >= 2
    times = [r["t"] for r in rows]
    assert times == sorted(times) and times[0] >= 0
    for r in rows:
        assert set(r) >= {"t", "stage", "loss", "accuracy", "commits"}
        assert 0 <= r["accuracy"] <= 1
        assert r["stage"] in ("PROFILE", "AHL", "SHL", "DONE")
    assert rows[-1]["stage"] == "DONE" and rows[-1]["accuracy"] == s["final_accuracy"]
    assert any(r["accuracy"] >= 0.9 for r in rows)

    assert (out / "curves.png").read_bytes()[:8] == PNG_MAGIC
    trace = json.loads((out / "timeline.json").read_text())
    pids = {e["pid"] for e in trace["traceEvents"]}
    assert pids == {0, 1, 2}
    assert any(e["name"] == "commit" for e in trace["traceEvents"])
    assert took < 60, f"the run took {took:.0f} s"
