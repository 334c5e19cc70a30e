"""The CUDA kernels' logic without a GPU: csrc/cuda built with ASHL_CUDA_EMULATE runs every
launch block by block on the host (index math, tails, misaligned views, batching across
launches, flags, validation), and csrc/cpu linked beside it must give the same bits for every
op (both drive the ops of csrc/include/ashl/ops.h). Runs wherever nvcc exists; the real-device
tests are in test_kernels.py (cuda parameter), which skip without a GPU."""
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_cuda_kernels_emulated_on_host(tmp_path):
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc not found: the CUDA kernels are not built on this machine")
    exe = tmp_path / "cuda_emulate_test"
    build = subprocess.run(
        [nvcc, "-std=c++17", "-O2", "-diag-suppress", "20011", "-Xcompiler", "-ffp-contract=off",
         f"-I{ROOT/'csrc/include'}", f"-I{ROOT/'csrc/cuda'}",
         str(ROOT / "tests/native/cuda_emulate_test.cu"), str(ROOT / "csrc/common.cpp"),
         str(ROOT / "csrc/cpu/kernels.cpp"), str(ROOT / "csrc/cpu/halves.cpp"), "-o", str(exe)],
        capture_output=True, text=True, timeout=600)
    assert build.returncode == 0, build.stderr
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and "ALL PASSED" in run.stdout, run.stdout[-4000:] + run.stderr
