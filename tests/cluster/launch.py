"""What the launch tests share: the job environment, the scripts, reading results."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RANK_INFO = Path(__file__).resolve().parent / "rank_info.py"
TRAIN = ROOT / "examples" / "train_digits.py"
SBATCH = ROOT / "examples" / "slurm" / "ashl.sbatch"
VENV_BIN = Path(sys.executable).parent


def job_env(base: dict | None = None, **extra) -> dict:
    """Environment for mpirun/horovodrun/sbatch: root allowed, ashl importable, one thread."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "mpi"))
    from _util import mpi_env
    env = mpi_env()
    if base:
        env.update(base)
        env["PYTHONPATH"] = mpi_env()["PYTHONPATH"]
    env.update({"PATH": f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}", "OMP_NUM_THREADS": "1",
                "PYTHON": sys.executable})
    env.update({k: str(v) for k, v in extra.items()})
    return env


def subnet_env(subnet: str) -> dict:
    """Open MPI settings for ranks on the emulated hosts: TCP on the hosts' subnet only."""
    return {"OMPI_MCA_btl": "tcp,self", "OMPI_MCA_btl_tcp_if_include": subnet,
            "OMPI_MCA_oob_tcp_if_include": subnet}


def rank_infos(stdout: str) -> list[dict]:
    """The JSON lines rank_info.py printed, in rank order."""
    # horovodrun prefixes every line with [rank,...]<stdout>:
    decoder = json.JSONDecoder()
    infos = [decoder.raw_decode(line[line.index('{"hvd"'):])[0] for line in stdout.splitlines()
             if '{"hvd"' in line]
    return sorted(infos, key=lambda i: i["mpi"]["rank"])


def read_rank_files(out_dir, size: int) -> list[dict]:
    """The rank<N>.json files rank_info.py wrote into out_dir (robust where stdout lines of
    several ranks may interleave), in rank order; fails naming the missing ones."""
    out_dir = Path(out_dir)
    missing = [r for r in range(size) if not (out_dir / f"rank{r}.json").exists()]
    assert not missing, f"ranks {missing} wrote no file in {out_dir}"
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(size)]


def check_world(infos: list[dict], size: int, per_host: int) -> None:
    """One world of `size` ranks, Horovod agrees with MPI, local ranks count within each host."""
    assert [i["mpi"]["rank"] for i in infos] == list(range(size)), infos
    by_host: dict[str, list[dict]] = {}
    for i in infos:
        assert i["hvd"]["rank"] == i["mpi"]["rank"]
        assert i["hvd"]["size"] == i["mpi"]["size"] == size
        assert i["hvd"]["local_rank"] == i["mpi"]["local_rank"]
        assert i["hvd"]["local_size"] == i["mpi"]["local_size"] == per_host
        assert i["hvd"]["mpi_enabled"] and i["hvd"]["mpi_threads_supported"]
        assert i["allreduce_sum"] == sum(range(size)) == i["mpi_allreduce_sum"]
        by_host.setdefault(i["host"], []).append(i)
    assert len(by_host) == size // per_host, sorted(by_host)
    for ranks in by_host.values():
        assert sorted(r["hvd"]["local_rank"] for r in ranks) == list(range(per_host))
        assert len({r["hvd"]["cross_rank"] for r in ranks}) == 1
