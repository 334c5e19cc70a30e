"""Which device a rank trains on (ashl.device): pure functions of the spec, the host's GPU
count and the launcher's local rank."""
import pytest
import torch
from hypothesis import given, strategies as st

from ashl.device import (LOCAL_RANK_VARS, check_device_spec, local_rank, model_device,
                         pick_device, resolve_device)


@given(count=st.integers(1, 16), rank=st.integers(0, 255))
def test_auto_and_cuda_take_the_local_ranks_gpu_round_robin(count, rank):
    assert resolve_device("auto", count, rank) == f"cuda:{rank % count}"
    assert resolve_device("cuda", count, rank) == f"cuda:{rank % count}"


@given(rank=st.integers(0, 255))
def test_auto_is_the_cpu_on_a_host_without_gpus(rank):
    assert resolve_device("auto", 0, rank) == "cpu"
    assert resolve_device("cpu", 4, rank) == "cpu"


def test_an_explicit_gpu_must_exist():
    assert resolve_device("cuda:1", 2, 0) == "cuda:1"
    with pytest.raises(ValueError, match=r"'cuda:2'.*2 CUDA devices \(0 to 1\)"):
        resolve_device("cuda:2", 2, 0)
    with pytest.raises(ValueError, match="'cuda'.*no CUDA device"):
        resolve_device("cuda", 0, 0)


@pytest.mark.parametrize("spec", ["gpu", "cuda:", "cpu:0", "auto:1", "cuda:-1", "", "mps"])
def test_a_misspelt_device_is_named(spec):
    with pytest.raises(ValueError, match="expected auto, cpu, cuda or cuda:N"):
        check_device_spec(spec)


def test_spellings_are_normalised():
    assert check_device_spec(" CUDA:3 ") == "cuda:3"


def test_the_local_rank_comes_from_the_first_launcher_variable_set():
    assert local_rank({}) == 0
    assert local_rank({"SLURM_LOCALID": "3"}) == 3                  # srun's ranks
    assert local_rank({"OMPI_COMM_WORLD_LOCAL_RANK": "x", "LOCAL_RANK": "2"}) == 2
    assert local_rank({"MPI_LOCALRANKID": "1", "HOROVOD_LOCAL_RANK": "2"}) == 1
    assert LOCAL_RANK_VARS[0] == "OMPI_COMM_WORLD_LOCAL_RANK"


@given(launcher=st.sampled_from(LOCAL_RANK_VARS[:-1]), rank=st.integers(0, 63),
       step=st.integers(0, 63))
def test_a_launcher_inside_a_slurm_allocation_outranks_the_batch_steps_local_id(
        launcher, rank, step):
    """mpirun (or mpiexec, horovodrun, torchrun) in an sbatch script: every rank inherits
    the batch step's SLURM_LOCALID; the launcher's own variable is the rank's."""
    assert local_rank({"SLURM_LOCALID": str(step), launcher: str(rank)}) == rank


def test_with_a_communicator_the_local_rank_is_mpis(monkeypatch):
    import ashl.device as device
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(device, "host_rank", lambda comm: {"world": 3}[comm])
    for name in LOCAL_RANK_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_RANK", "1")
    assert pick_device("auto") == torch.device("cuda:1")
    assert pick_device("auto", comm="world") == torch.device("cuda:3")


def test_a_model_lives_on_one_device():
    assert model_device([torch.zeros(2), torch.zeros(3)]) == torch.device("cpu")
    assert model_device([]) == torch.device("cpu")
    with pytest.raises(ValueError, match=r"tensors are on \['cpu', 'meta'\].*one device per rank"):
        model_device([torch.zeros(2), torch.zeros(2, device="meta")])
    with pytest.raises(ValueError, match="the model is on meta"):
        model_device([torch.zeros(2, device="meta")])
