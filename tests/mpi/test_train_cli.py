"""``python -m ashl.train``: option checks (one line, exit status 2, before MPI starts), the
helpers behind its outputs, and a real 3-rank run under mpirun."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import _util  # noqa: E402

from ashl import train  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def plain_env(*first):
    """No launcher variables: the module runs as a plain process, MPI never starts. `first`:
    folders ahead of everything on the module path."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OMPI_", "PMI_", "PMIX_", "MV2_", "ASHL_"))}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [*map(str, first), str(ROOT / "src"),
                                                      env.get("PYTHONPATH")]))
    return env


def run_cli(*args, timeout=60, first=()):
    return subprocess.run([sys.executable, "-m", "ashl.train", *map(str, args)],
                          capture_output=True, text=True, env=plain_env(*first),
                          timeout=timeout)


@pytest.fixture(scope="module")
def no_mpi(tmp_path_factory):
    """A module path on which importing mpi4py or horovod fails loudly: what runs with it
    must decide before MPI or Horovod start."""
    where = tmp_path_factory.mktemp("no-mpi")
    for name in ("mpi4py", "horovod"):
        (where / name).mkdir()
        (where / name / "__init__.py").write_text(
            f"raise ImportError('{name} was imported before the options were checked')\n")
    return where


BAD = [
    (["--compute-slowdown", "1,x,2"], ["--compute-slowdown", "'x'"]),
    (["--compute-slowdown", "1,,2"], ["--compute-slowdown", "''"]),
    (["--compute-slowdown", "1,0.5"], ["--compute-slowdown", "0.5", ">= 1"]),
    (["--link-slowdown", "inf"], ["--link-slowdown", "inf"]),
    (["--link-base", "0.001"], ["--link-base", "LATENCY_S,BYTES_PER_S"]),
    (["--link-base", "0.001,0"], ["--link-base", "bandwidth"]),
    (["--strategy", "sgd"], ["--strategy", "'sgd'", "ashl"]),
    (["--dataset", "emnist"], ["--dataset", "'emnist'", "digits"]),
    (["--step-time", "-1"], ["--step-time", ">= 0"]),
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
    (["--resume"], ["--resume", "--checkpoint-dir"]),
    (["--transport", "tcp"], ["--transport 'tcp'", "unknown transport", "zmq, mpi"]),
    (["--strategy", "bsp", "--transport", "mpi"], ["--transport 'mpi'", "strategy bsp",
                                                   "no parameter server"]),
    (["--fault-tolerant", "--transport", "mpi"], ["--transport 'mpi'", "fault-tolerant",
                                                  "'zmq'"]),
    (["--checkpoint-dir", "unused-ckpt", "--checkpoint-every", "0"], ["--checkpoint-every 0",
                                                                     "> 0"]),
    (["--device", "gpu"], ["--device 'gpu'", "auto, cpu, cuda or cuda:N"]),
    (["--strategy", "bsp", "--global-model-on", "device"], ["--global-model-on device",
                                                           "no parameter server"]),
    (["--strategy", "localsgd", "--server-threads", "1"], ["--server-threads 1",
                                                          "no parameter server"]),
    (["--server-threads", "0"], ["--server-threads 0", ">= 1"]),
]


@pytest.mark.parametrize("args,needles", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_options_fail_with_one_line_naming_them(args, needles, no_mpi):
    proc = run_cli(*args, first=[no_mpi])     # checked before MPI or Horovod start
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("ashl.train: error: "), lines[0]
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    assert proc.stdout == ""


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
                "--batch-size", "--lr", "--out", "--checkpoint-dir", "--checkpoint-every",
                "--resume"):
        assert opt in proc.stdout
    assert "DIR/ckpt.pt" in proc.stdout and "DIR/ckpt.pt.rank<r>" in proc.stdout


def test_resume_from_an_empty_directory_fails_before_anything_starts(tmp_path):
    empty, out = tmp_path / "ckpt", tmp_path / "out"
    empty.mkdir()
    proc = run_cli("--checkpoint-dir", empty, "--resume", "--out", out)
    assert proc.returncode == 2, proc.stderr
    line, = proc.stderr.strip().splitlines()
    assert f"--checkpoint-dir '{empty}' holds no checkpoint" in line and "ckpt.pt" in line
    assert not out.exists()          # refused in the option checks, before any training


@pytest.mark.parametrize("strategy", ["bsp"])
@pytest.mark.parametrize("resume", [False, True])
def test_a_strategy_that_does_not_checkpoint_is_refused_up_front(tmp_path, strategy, resume):
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    proc = run_cli("--strategy", strategy, "--checkpoint-dir", ckpt, "--out", out,
                   *(["--resume"] if resume else []))
    assert proc.returncode == 2, proc.stderr
    line, = proc.stderr.strip().splitlines()
    assert f"--strategy '{strategy}' does not checkpoint" in line and "ashl" in line
    assert not out.exists() and not ckpt.exists()


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


def mpirun_train(np_, *args, timeout=90, env=None):
    cmd = ["mpirun", "-np", str(np_), "--oversubscribe", "--bind-to", "none",
           sys.executable, "-m", "ashl.train", *map(str, args)]
    env = {**_util.mpi_env(), **(env or {})}
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
@pytest.mark.skipif(torch.cuda.is_available(), reason="this host has a GPU")
def test_a_gpu_asked_of_a_host_without_one_is_refused_on_every_rank(tmp_path):
    proc = mpirun_train(2, "--device", "cuda", "--out", tmp_path / "run")
    assert proc.returncode == 2, proc.stderr
    lines = [l for l in proc.stderr.splitlines() if l.startswith("ashl.train: error")]
    assert len(lines) == 1, proc.stderr
    assert "--device: rank 0: device 'cuda': this host has no CUDA device" in lines[0]


@pytest.mark.mpi
@pytest.mark.skipif(_util.skip_reason() is not None, reason=_util.skip_reason() or "")
def test_three_ranks_reach_the_target_and_leave_every_output(tmp_path):
    out = tmp_path / "run"
    # GPU-like 20 ms steps: the x1 rank's 10 profiling steps last 0.2 s, the x3 rank's 3
    # steps 0.18 s. With the MLP's real 1-3 ms steps, the others' last ones fell within the
    # 20 ms a rank tests the barrier on entering it.
    proc = mpirun_train(3, "--strategy", "ashl", "--max-seconds", "60", "--target-accuracy",
                        "0.9", "--compute-slowdown", "1,2,3", "--step-time", "0.02", "--out", out)
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
    assert "target accuracy" in s["stop_reason"]
    assert len(s["utilization"]) == 3 and all(0 < u <= 1.05 for u in s["utilization"])
    # busy adds the evaluations, which rank 0 alone runs (one at least, of the initial model)
    assert s["busy"][0] > s["utilization"][0] and s["busy"][1:] == s["utilization"][1:]
    assert s["per_rank"][0]["evaluator_s"] > 0
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
    # the profiling round, each rank's first: the fastest its 10 steps at least; the slower
    # ones stop at 3 or more once it has (their own 10 would last 2 and 3 times as long)
    first = {}
    for e in trace["traceEvents"]:
        if e["name"] == "compute":
            first.setdefault(e["pid"], e["args"]["steps"])
    assert first[0] >= 10 and 10 > first[2] >= 3 and first[0] > first[1] >= first[2], first


# A CUDA model's path, on the CPU: ASHL_STAGE_WIRE=1 stages a CPU model's commits (ashl:
# packed and top-k selected into a "device" buffer, one copy to the host send buffer, the
# reply copied back before the unpack), allreduces (localsgd) and gradients (bsp: ashl's own
# average, as without Horovod's GPU operations) through separate host buffers.
@pytest.mark.mpi
@pytest.mark.skipif(_util.skip_reason() is not None, reason=_util.skip_reason() or "")
@pytest.mark.parametrize("strategy,extra", [
    ("ashl", []), ("ashl", ["--global-model-on", "device", "--server-threads", "1"]),
    ("localsgd", []), ("bsp", [])],
    ids=["ashl", "ashl-global-model-on-device", "localsgd", "bsp"])
def test_every_strategy_family_trains_with_its_exchanges_staged(tmp_path, strategy, extra):
    out = tmp_path / "run"
    proc = mpirun_train(2, "--strategy", strategy, "--max-seconds", "60", "--target-accuracy",
                        "0.9", "--device", "cpu", *extra, "--out", out,
                        env={"ASHL_STAGE_WIRE": "1"})
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    s = summary(out)
    assert s["final_accuracy"] >= 0.9 and "target accuracy" in s["stop_reason"]
    for rank in s["per_rank"]:
        assert rank["device"] == "cpu" and rank["counters"]["device"] == "cpu"
        staging = rank["counters"]["staging"]
        assert staging["staged"] and staging["to_host"] > 0 and staging["to_device"] > 0
        assert staging["bytes_to_host"] > 0
    if strategy == "bsp":
        assert not s["per_rank"][0]["counters"]["horovod_optimizer"]   # ashl's own average
        for rank in s["per_rank"]:   # one trip each way per step's backward, and the final's
            staging = rank["counters"]["staging"]
            assert staging["to_host"] == staging["to_device"] == \
                rank["counters"]["local_steps"] + 1, rank["counters"]
    if extra:
        assert s["per_rank"][0]["counters"]["global_model_on"] == "device"
        assert s["per_rank"][0]["counters"]["server_threads"] == 1


def summary(out):
    return json.loads((out / "summary.json").read_text())


def output(proc):
    return f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"


@pytest.mark.mpi
@pytest.mark.skipif(_util.skip_reason() is not None, reason=_util.skip_reason() or "")
@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy,slowdown,commits", [("ashl", "1,2,3", 12),
                                                       ("localsgd", "1,2", 12),
                                                       ("ashl-sync", "1,2", 4)])
def test_a_checkpointed_run_resumes_where_it_stopped(tmp_path, strategy, slowdown, commits):
    """ashl saves on each rank's clock, localsgd and ashl-sync at epoch ends when rank 0
    says so: either way a short run leaves a checkpoint and a --resume run continues it to
    the target. (A synchronous run saved at the target may stop again before any step, in
    the epoch-end round of the batches left: ashl-sync's first run is kept short of it.)"""
    ranks, ckpt = len(slowdown.split(",")), tmp_path / "ckpt"
    job = ["--strategy", strategy, "--compute-slowdown", slowdown, "--checkpoint-dir", ckpt,
           "--checkpoint-every", "0.05", "--no-progress"]
    proc = mpirun_train(ranks, *job, "--max-commits", str(commits), "--out", tmp_path / "first")
    assert proc.returncode == 0, output(proc)
    first = summary(tmp_path / "first")
    if strategy == "ashl-sync":
        assert first["final_accuracy"] < 0.9, first["final_accuracy"]
    assert first["checkpoint"] == str(ckpt / "ckpt.pt") and first["resumed"] is False
    assert all(r["checkpoints_saved"] >= 1 for r in first["per_rank"])
    assert sorted(p.name for p in ckpt.iterdir()) == \
        ["ckpt.pt"] + [f"ckpt.pt.rank{r}" for r in range(ranks)]     # no temporary left
    assert "checkpoint in" in proc.stdout
    saved_at = [{k: v for k, v in torch.load(ckpt / f"ckpt.pt.rank{r}", weights_only=False).items()
                 if k in ("epoch", "steps_in_epoch")} for r in range(ranks)]
    assert any(p["steps_in_epoch"] > 0 for p in saved_at), saved_at

    proc = mpirun_train(ranks, *job, "--resume", "--target-accuracy", "0.9", "--lr", "0.04",
                        "--max-seconds", "60", "--out", tmp_path / "resumed")
    assert proc.returncode == 0, output(proc)
    resumed = summary(tmp_path / "resumed")
    # the checkpoint's optimizer state came with the saved lr (0.05); --lr is the one used
    assert [r["lr"] for r in first["per_rank"]] == [0.05] * ranks
    assert resumed["lr"] == 0.04 and [r["lr"] for r in resumed["per_rank"]] == [0.04] * ranks
    assert resumed["resumed"] is True and resumed["checkpoint"] == first["checkpoint"]
    assert resumed["final_accuracy"] >= 0.9 and "target accuracy" in resumed["stop_reason"]
    for before, after in zip(first["per_rank"], resumed["per_rank"]):
        for counter in ("commits", "local_steps"):   # every rank goes on from its own counts
            assert after["counters"][counter] > before["counters"][counter], counter
    assert resumed["commits"] > first["commits"]
    # each rank goes on in the epoch it saved, past the batches it had taken there
    assert [r["resumed_at"] for r in resumed["per_rank"]] == saved_at
    metrics = (tmp_path / "resumed" / "metrics.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in metrics]
    # It starts from the saved model, with the saved plan: no profiling again.
    assert rows[0]["by"] == "start" and rows[0]["accuracy"] == first["final_accuracy"]
    assert all(r["stage"] != "PROFILE" for r in rows[1:])


@pytest.mark.mpi
@pytest.mark.skipif(_util.skip_reason() is not None, reason=_util.skip_reason() or "")
@pytest.mark.timeout(120)
def test_a_checkpoint_of_another_run_is_refused_on_every_rank(tmp_path):
    from ashl import checkpoint
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    checkpoint.atomic_save({"format": checkpoint.FORMAT, "strategy": "ashl", "size": 3,
                            "numel": 1}, str(ckpt / "ckpt.pt"))
    proc = mpirun_train(2, "--checkpoint-dir", ckpt, "--resume", "--max-seconds", "60",
                        "--no-progress", "--out", tmp_path / "out")
    assert proc.returncode == 2, proc.stderr
    lines = [l for l in proc.stderr.splitlines() if l.startswith("ashl.train: error")]
    assert len(lines) == 1, proc.stderr      # every rank refuses, rank 0 says why
    assert f"{ckpt / 'ckpt.pt'} is of a 3-rank run" in lines[0] and "2 ranks" in lines[0]
    assert not (tmp_path / "out" / "summary.json").exists()

    # a run file of this job's shape whose plan this version cannot read (another ashl's):
    # refused at the load, naming the file, not with a traceback at the first step
    from ashl.bench.scenario import model_bytes
    from ashl.planner import PlannerConfig
    numel = model_bytes("mlp", "digits") // 4
    plan = {"version": 1, "profiles": [{"compute_s": 0.01}] * 2,
            "config": {**PlannerConfig().to_dict(), "a_later_knob": 1}}
    checkpoint.atomic_save({"format": checkpoint.FORMAT, "strategy": "ashl", "size": 2,
                            "numel": numel, "plan": plan, "stage": "AHL"},
                           str(ckpt / "ckpt.pt"))
    for r in (0, 1):
        checkpoint.atomic_save({"format": checkpoint.FORMAT, "rank": r}, f"{ckpt}/ckpt.pt.rank{r}")
    proc = mpirun_train(2, "--checkpoint-dir", ckpt, "--resume", "--max-seconds", "60",
                        "--no-progress", "--out", tmp_path / "out")
    assert proc.returncode == 2, proc.stderr
    lines = [l for l in proc.stderr.splitlines() if l.startswith("ashl.train: error")]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert f"{ckpt / 'ckpt.pt'}: its plan or stage cannot be read" in lines[0]
    assert "a_later_knob" in lines[0]
