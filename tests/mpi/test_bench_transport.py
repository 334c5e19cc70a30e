"""``python -m ashl.bench transport``: option checks, the round-trip plan and payload check, and
a tiny real run of both transports under mpirun. No timing thresholds: only that every figure
is there, positive and finite, and that every reply carried the commit's bytes."""

import json
import math

import pytest
import torch

import _util  # noqa: E402

from ashl import protocol  # noqa: E402
from ashl.bench import SUBCOMMANDS  # noqa: E402
from ashl.bench import transport as bench  # noqa: E402
from ashl.bench import transport_worker as worker  # noqa: E402

pytestmark = pytest.mark.mpi


def run_bench(*args, timeout=120):
    return _util.bench("transport", *args, timeout=timeout)


def test_registered_as_a_bench_subcommand():
    assert SUBCOMMANDS["transport"][0] == "ashl.bench.transport"


def test_sizes_parse_in_powers_of_1024_and_print_back():
    sizes = bench.parse_sizes(bench.DEFAULT_SIZES)
    assert sizes == [4 ** k * 1024 for k in range(9)]
    assert [bench.format_size(n) for n in sizes] == bench.DEFAULT_SIZES.split(",")
    assert bench.parse_sizes("4096, 2KiB,1m") == [4096, 2048, 1 << 20]
    assert bench.format_size(1000) == "1000"


@pytest.mark.parametrize("args,needle", [
    (["--sizes", "1K,x"], "'x'"),
    (["--sizes", "1001"], "multiple of 4"),
    (["--sizes", "1K,1024"], "twice"),
    (["--repeat", "0"], "--repeat"),
    (["--warmup", "-1"], "--warmup"),
    (["--poll-s", "-1"], "--poll-s"),
    (["--hold-s", "-1"], "--hold-s"),
    (["--hold-repeat", "-1"], "--hold-repeat"),
])
def test_bad_options_exit_2_with_one_line(args, needle, tmp_path):
    _util.check_bad_bench_option("transport", args, needle, tmp_path)


def test_a_failing_launcher_is_reported(tmp_path):
    proc = run_bench("--sizes", "1K", "--repeat", "1", "--mpirun", "false",
                     "--json", tmp_path / "t.json", timeout=60)
    assert proc.returncode == 1 and "the run failed" in proc.stderr, proc.stderr
    assert not (tmp_path / "t.json").exists()


def test_plan_interleaves_the_transports_and_alternates_who_goes_first():
    rounds = worker.plan(warmup=1, repeat=2)
    assert [c for c, _, _ in rounds] == [1, 2, 3, 4, 5, 6]   # every commit its own number
    assert [(t, timed) for _, t, timed in rounds] == [
        ("mpi", False), ("zmq", False),
        ("mpi", True), ("zmq", True), ("zmq", True), ("mpi", True)]


def test_the_server_ranks_own_commits_have_a_plan_of_their_own():
    rounds = worker.plan(warmup=0, repeat=2, transports=worker.SELF_TRANSPORTS)
    assert [t for _, t, _ in rounds] == ["mpi-self", "inproc", "inproc", "mpi-self"]
    assert {worker.FAMILY[t] for t in worker.SELF_TRANSPORTS} == {"mpi", "zmq"}


def test_idle_shares_are_cpu_and_wakeups_over_the_wall_time():
    rounds = [{"wall_s": 2.0, "cpu_s": 0.1, "wakeups": 8}, {"wall_s": 1.0, "cpu_s": 0.3,
                                                            "wakeups": 1}]
    s = bench.shares(rounds)
    assert s["cpu_share"] == {"median": 0.175, "min": 0.05, "max": 0.3, "n": 2}
    assert s["wakeups_per_s"] == {"median": 2.5, "min": 1.0, "max": 4.0, "n": 2}
    assert bench.idle_rows(None) is None


def test_a_reply_is_intact_only_with_the_commits_bytes_and_number():
    sent = torch.randn(64)
    header = protocol.Header(kind=protocol.Kind.REPLY, rank=worker.SERVER,
                             dtype=protocol.DType.FLOAT32, numel=64, base_version=7)

    def reply(payload, h=header):
        return protocol.Message(h, payload, worker.SERVER)

    echo = sent.view(torch.uint8).clone()
    assert worker.intact(reply(echo), 7, sent)
    assert not worker.intact(reply(echo), 8, sent)          # the answer to another commit
    flipped = echo.clone()
    flipped[100] ^= 1
    assert not worker.intact(reply(flipped), 7, sent)       # one bit changed
    assert not worker.intact(reply(echo[:-4]), 7, sent)     # short


def _positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


@pytest.mark.timeout(180)
def test_both_transports_at_every_size_with_intact_payloads(tmp_path):
    reason = _util.skip_reason()
    if reason:
        pytest.skip(reason)
    out = tmp_path / "transport.json"
    proc = run_bench("--sizes", "1K,64K", "--repeat", "3", "--warmup", "1", "--hold-s", "0.2",
                     "--hold-repeat", "2", "--json", out, timeout=150)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert [r["bytes"] for r in result["results"]] == [1024, 65536]
    assert result["corrupt_round_trips"] == 0
    for row in result["results"]:
        for t in ("mpi", "zmq", "mpi-self", "inproc"):
            r = row[t]
            assert r["corrupt"] == 0, (row["size"], t)
            assert r["n"] == 3 and len(r["times_s"]) == 3 and all(map(_positive, r["times_s"]))
            assert all(_positive(r[k]) for k in ("median_ms", "min_ms", "max_ms", "mb_per_s"))
            assert r["min_ms"] <= r["median_ms"] <= r["max_ms"]
        for key in ("zmq_over_mpi", "inproc_over_mpi_self"):
            q = row[key]
            assert q["n"] == 3 and all(_positive(q[k]) for k in ("median", "min", "max"))
    assert result["hold_s"] == 0.2 and set(result["idle"]) == {"mpi", "zmq"}
    for t, sides in result["idle"].items():
        for side in ("server", "waiting"):
            for figure in ("cpu_share", "wakeups_per_s"):
                f = sides[side][figure]
                assert f["n"] == 2 and 0 <= f["min"] <= f["median"] <= f["max"], (t, side)
            assert sides[side]["cpu_share"]["max"] <= result["cpus"]
    assert "idle cost" in proc.stdout and "inproc/mpi-self" in proc.stdout
    table = proc.stdout
    assert "zmq/mpi" in table and all(f"\n{s} " in table for s in ("1K", "64K"))
