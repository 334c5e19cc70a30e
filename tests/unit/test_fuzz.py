"""What a peer can send, fuzzed: the sparse merge with hypothesis, and a bounded atheris run
over the header decoder and the merge (tests/soak/fuzz_atheris.py runs it for longer)."""
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, strategies as st

from ashl import kernels

N = 257


@given(st.lists(st.integers(-2**31, 2**31 - 1), max_size=40),
       st.lists(st.floats(allow_nan=True, allow_infinity=True, width=32), max_size=40),
       st.floats(-4, 4))
def test_sparse_merge_from_untrusted_indices_and_values(indices, values, weight):
    n = min(len(indices), len(values))
    idx = torch.tensor(indices[:n], dtype=torch.int32)
    vals = torch.tensor(values[:n], dtype=torch.float32)
    dst = torch.ones(N)
    in_range = all(0 <= i < N for i in indices[:n])
    finite = bool(torch.isfinite(vals).all())
    if not in_range:
        with pytest.raises(IndexError, match="out of range"):
            kernels.merge_sparse(dst, idx, vals, weight)
        assert torch.equal(dst, torch.ones(N))
        return
    ok = kernels.merge_sparse(dst, idx, vals, weight)
    assert ok == finite
    expected = torch.ones(N)
    if finite:
        expected.index_add_(0, idx.long(), vals * weight)
        assert torch.allclose(dst, expected, rtol=1e-6, atol=1e-5)
    else:
        assert torch.equal(dst, expected)


def test_atheris_over_decoder_and_sparse_merge():
    if importlib.util.find_spec("atheris") is None:
        pytest.skip("atheris is not installed (make bootstrap installs it where it builds)")
    script = Path(__file__).resolve().parents[1] / "soak" / "fuzz_atheris.py"
    proc = subprocess.run([sys.executable, str(script), "-runs=50000", "-seed=1"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Done 50000 runs" in proc.stderr
