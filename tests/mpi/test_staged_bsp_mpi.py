"""Strategy "bsp" with ashl averaging the gradients (a CUDA model under a Horovod without GPU
operations, run on the CPU with ASHL_STAGE_WIRE=1) and a GradScaler, on real Horovod under
mpirun: the average is taken as backward ends, so GradScaler's inf check reads the same
gradients on every rank. A rank whose own gradient overflows makes every rank skip that step
(skipping alone, it would leave the others in an allreduce it never joins: a hang), with
Horovod's recipe and with a plain scaler.step(opt). mpirun inside a Slurm allocation leaves
the batch step's SLURM_LOCALID in every rank: the local rank is still mpirun's."""
import json
from pathlib import Path

import pytest

import _util  # noqa: E402

SCRIPT = Path(__file__).resolve().parent / "staged_bsp_amp.py"


@pytest.mark.parametrize("recipe", ["horovod", "plain"])
def test_every_rank_steps_or_skips_together(recipe, tmp_path):
    out = tmp_path / "ranks.json"
    _util.mpirun(2, SCRIPT, recipe, out, timeout=90,
                 env={"ASHL_STAGE_WIRE": "1", "SLURM_LOCALID": "0"})
    r0, r1 = json.loads(out.read_text())
    assert len(r0["after"]) == len(r1["after"]) == 5       # 4 counted steps, 1 skipped
    assert r0["after"] == r1["after"]                       # the same model after every step
    assert r0["after"][0] == r0["after"][1]                 # the skipped step changed nothing
    assert r0["scales"] == r1["scales"] and r0["scales"][1] == r0["scales"][0] / 2
    for r in (r0, r1):
        assert r["local_steps"] == 4 and not r["horovod_optimizer"]
        # one trip each way per backward (the skipped step's too), and the final model's
        assert r["staging"]["staged"]
        assert r["staging"]["to_host"] == r["staging"]["to_device"] == 5 + 1
    assert [r0["local_rank"], r1["local_rank"]] == [0, 1]
    assert [r0["host_rank"], r1["host_rank"]] == [0, 1]
