"""``python -m ashl.bench e2e --netns``: real shaped links instead of emulated ones.

One emulated host per rank (network namespaces ashl-h0..h2 on a private bridge, ashl.netns),
rank i's link shaped with tc tbf to --netns-rate / its link slowdown, every strategy's mpirun
started on host 0 across the hosts; afterwards no namespace is left. Needs root, iproute2 and
mpirun; skips with the reason otherwise."""

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "mpi"))
import _util  # noqa: E402

from ashl import netns  # noqa: E402
from ashl.bench import e2e  # noqa: E402
from ashl.bench.__main__ import build_parser  # noqa: E402


def _netns_skip():
    return _util.skip_reason() or netns.skip_reason()


def bench(*args, timeout=150):
    env = _util.mpi_env()
    env["OMP_NUM_THREADS"] = "1"
    return subprocess.run([sys.executable, "-m", "ashl.bench", "e2e", *map(str, args)],
                          capture_output=True, text=True, env=env, timeout=timeout)


def parse(*argv):
    return build_parser("e2e").parse_args(["e2e", *map(str, argv)])


def test_rates_parse_and_divide():
    assert netns.parse_rate("100mbit") == 100e6 and netns.parse_rate("500kbit") == 500e3
    assert netns.parse_rate("64000") == 64000
    assert netns.format_rate(100e6 / 8) == "12500kbit"
    for bad in ("100mbps", "fast", "-1mbit", "1bit"):
        with pytest.raises(ValueError):
            netns.parse_rate(bad)


def test_netns_command_has_no_emulated_link_and_runs_on_host0(tmp_path):
    """The launcher line: mpirun on ashl-h0 through hostexec, the hosts' mpirun options, compute
    slowdowns emulated, no --link-slowdown / --link-base."""
    args = parse("--netns", "--ranks", "3", "--compute-slowdown", "1,2,4",
                 "--link-slowdown", "1,2,4")
    hosts = netns.Hosts(3, tmp_base="/var/tmp/x")   # not created: the command only
    cmd = e2e.train_command(args, "ashl", "/var/tmp/x/run", [1, 2, 4], [1, 2, 4], hosts)
    at = next(i for i, c in enumerate(cmd) if Path(c).name == "hostexec")
    assert cmd[0] == "env" and "ASHL_HOSTS_TMP=/var/tmp/x" in cmd[1:at]
    assert all(c.startswith("ASHL_HOSTS_") for c in cmd[1:at])
    assert cmd[at + 1] == "ashl-h0"
    inner = cmd[at + 2]
    assert inner.startswith("mpirun -np 3 -H 10.231.7.10:1,10.231.7.11:1,10.231.7.12:1 ")
    for piece in ("--mca plm_rsh_agent", "--mca btl tcp,self", "btl_tcp_if_include 10.231.7.0/24",
                  "--bind-to none", "--compute-slowdown 1,2,4", "--out /var/tmp/x/run"):
        assert piece in inner, piece
    assert "--link-slowdown" not in inner and "--link-base" not in inner
    assert "--oversubscribe" not in inner


def test_refused_with_one_line_when_not_root(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(netns, "is_root", lambda: False)
    rc = e2e.run(parse("--netns", "--ranks", "3", "--json", tmp_path / "e.json"))
    assert rc == 2
    line, = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("ashl.bench e2e: error: --netns needs root"), line
    assert not (tmp_path / "e.json").exists()


def test_refused_with_one_line_without_ip(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(netns, "is_root", lambda: True)
    monkeypatch.setattr(e2e.shutil, "which", lambda name, *a, **k: None)
    rc = e2e.run(parse("--netns", "--json", tmp_path / "e.json"))
    assert rc == 2
    line, = capsys.readouterr().err.strip().splitlines()
    assert "ip netns" in line, line


@pytest.mark.parametrize("args,needle", [
    (["--link-base", "1e-3,1e8"], "--link-base"),
    (["--netns-rate", "10mbps"], "--netns-rate '10mbps'"),
])
def test_bad_netns_options_exit_2(args, needle, tmp_path):
    proc = bench("--netns", *args, "--json", tmp_path / "e.json", timeout=30)
    assert proc.returncode == 2, proc.stderr
    line, = proc.stderr.strip().splitlines()
    assert line.startswith("ashl.bench e2e: error:") and needle in line, line


@pytest.mark.mpi
@pytest.mark.timeout(170)
@pytest.mark.skipif(_netns_skip() is not None, reason=str(_netns_skip()))
def test_two_strategies_on_three_shaped_hosts(tmp_path):
    if netns.namespaces_in_use():
        pytest.skip(f"emulated hosts in use by another run: {netns.namespaces_in_use()}")
    out = tmp_path / "bench" / "e2e.json"   # under /tmp: the runs go via /var/tmp and back
    t0 = time.monotonic()
    proc = bench("--netns", "--ranks", "3", "--strategies", "ashl,bsp",
                 "--model", "mlp", "--dataset", "digits", "--step-time", "0",
                 "--compute-slowdown", "1,1,1", "--link-slowdown", "1,1,8",
                 "--netns-rate", "40mbit", "--max-seconds", "30", "--target-accuracy", "0.9",
                 "--timeout", "70", "--json", out, timeout=160)
    took = time.monotonic() - t0
    left = netns.leftover_namespaces()
    assert not left, f"namespaces left behind: {left}"
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    report = json.loads(out.read_text())
    sc = report["scenario"]
    assert sc["netns"] is True and sc["netns_rate"] == "40mbit"
    assert sc["link_rates"] == ["40000kbit", "40000kbit", "5000kbit"]
    assert sc["link_slowdown"] == [1, 1, 8] and sc["link_base"] is None
    assert [r["strategy"] for r in report["results"]] == ["ashl", "bsp"]
    for r in report["results"]:
        assert r["status"] == "ok", r
        assert r["time_to_target_s"] is not None and r["final_accuracy"] >= 0.9
        run_dir = Path(r["run_dir"])
        assert run_dir.parent == out.parent   # copied back from the hosts' shared folder
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["ranks"] == 3
        assert summary["link"] == [None, None, None]   # no emulated link on any rank
        log = (run_dir / "log.txt").read_text()
        assert "hostexec ashl-h0 " in log and "--link-slowdown" not in log.splitlines()[0]
    # the plan saw the real slow link: host 2's push + pull is the slowest
    ashl = json.loads((out.parent / "ashl" / "summary.json").read_text())
    link = [p.get("push_s", 0) + p.get("pull_s", 0) for p in ashl["plan"]["profiles"]]
    assert link[2] == max(link), link
    md = (out.parent / "e2e.md").read_text()
    assert "shaped links (netns) 40mbit" in md and "| bsp |" in md
    print(f"e2e --netns, 2 strategies on 3 hosts: {took:.0f} s")
