"""A compressor forced with ``DistributedOptimizer(compression=...)`` in a real run: every
strategy that takes it trains to the target with every commit sent that way; the others
stop at once, on every rank, with an error that names the compressor."""

import json
import math
from pathlib import Path

import pytest

import _util  # noqa: E402
from ashl.data import digits
from ashl.models import build_model

TRAIN = Path(__file__).resolve().parents[2] / "examples" / "train_digits.py"
NUMEL = sum(p.numel() for p in build_model("mlp", digits().input_shape, 10).parameters())


def run(strategy, compression, tmp_path, *args):
    out = tmp_path / f"{strategy}-{compression}.json"
    _util.mpirun(3, TRAIN, out, "--strategy", strategy, "--compression", compression,
                 "--max-seconds", "60", *args, timeout=150)
    ranks = json.loads(out.read_text())["ranks"]
    assert len({r["accuracy"] for r in ranks}) == 1, "ranks ended with different models"
    assert ranks[0]["accuracy"] >= 0.9
    return ranks


def bytes_per_commit(compression: str) -> float:
    """What one commit of the MLP's delta puts on the wire (header included)."""
    if compression == "none":
        return 128 + 4 * NUMEL
    if compression == "fp16":
        return 128 + 2 * NUMEL
    k = math.ceil(float(compression.split(":")[1]) * NUMEL)
    return 128 + 8 * k                   # k int32 indices and k fp32 values


@pytest.mark.parametrize("strategy,compression", [
    ("ashl", "none"), ("ashl", "fp16"), ("ashl", "topk:0.1"),
    ("ssp", "fp16"), ("asp", "topk:0.25"), ("adsp", "fp16")])
def test_every_commit_goes_out_with_the_forced_compressor(strategy, compression, tmp_path):
    ranks = run(strategy, compression, tmp_path)
    per_commit = bytes_per_commit(compression)
    for r in ranks:
        c = r["counters"]
        assert c["commits"] > 0 and c["rejected"] == 0
        # every commit had exactly the forced compressor's size: no dense fallback
        assert c["bytes_sent"] == c["commits"] * per_commit, c


def test_bsp_hands_fp16_to_horovod(tmp_path):
    ranks = run("bsp", "fp16", tmp_path)
    assert all(r["counters"]["horovod_optimizer"] for r in ranks)


# Every refusal is a unit test (test_strategies.py); under mpirun one shows that the error
# reaches the user and the job ends: bsp's, which Horovod's wrapped optimizer must pass on.
@pytest.mark.parametrize("strategy,compression", [("bsp", "topk:0.1")])
def test_a_strategy_that_cannot_send_it_says_so(strategy, compression, tmp_path):
    with pytest.raises(AssertionError) as failed:
        _util.mpirun(2, TRAIN, tmp_path / "r.json", "--strategy", strategy,
                     "--compression", compression, timeout=90)
    assert f"strategy {strategy!r} cannot send with compression=Compression." in str(failed.value)
