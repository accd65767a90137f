"""kernels/matmul.py: the explicit matmul kernel computes x @ w.T, and its fixed optimizations apply where `tuned` says they do."""
import os, pathlib, subprocess, sys
import numpy as np
import pytest
from tinygrad import Context, Tensor, dtypes
from kernels.matmul import linear, matmul, tuned

ROOT = pathlib.Path(__file__).resolve().parent.parent

@pytest.mark.parametrize("dtype", [dtypes.float32, dtypes.half])
def test_matmul(dtype):
  # C[i, j] = sum_k x[i, k] w[j, k] with w rounded to x's dtype first: a swapped index, a missing transpose or w read unrounded fails
  rng = np.random.default_rng(0)
  x, w = rng.normal(size=(24, 40)).astype(np.float32), rng.normal(size=(16, 40)).astype(np.float32)
  npd = np.float32 if dtype == dtypes.float32 else np.float16
  ref = x.astype(npd).astype(np.float64) @ w.astype(npd).astype(np.float64).T
  out = matmul(Tensor(x).cast(dtype), Tensor(w), opts=None).numpy()
  assert out.dtype == npd and out.shape == (24, 16)
  # the float32 sum of 40 products is off by ~40 * 2^-24 * 10 < 1e-4; a half result is rounded once more, by at most 2^-11 relative
  np.testing.assert_allclose(out.astype(np.float64), ref, rtol=1e-6 if dtype == dtypes.float32 else 2**-11, atol=1e-4)

def test_untuned_here():
  # on the CPU there is no half tensor core: linear is tinygrad's own matmul, batch axes and all
  x, w = Tensor.ones(2, 64, 64, dtype=dtypes.half), Tensor.ones(64, 64)
  assert not tuned(x, w)
  np.testing.assert_array_equal(linear(x, w).numpy(), np.full((2, 64, 64), 64, np.float16))

TUNED = """
from tinygrad import Context, Tensor, dtypes
from kernels.matmul import linear, tuned
for M, N, K in ((128, 512, 512), (128, 2048, 512), (128, 512, 2048), (128, 4096, 512)):  # the dust preset's linear layers, few tokens
  x, w = Tensor.empty(1, M, K, dtype=dtypes.half), Tensor.empty(N, K)
  assert tuned(x, w) and linear(x, w).shape == (1, M, N)
  linear(x, w).realize()  # compiles the kernel with OPTS: one that doesn't fit its shape raises KernelOptError
  with Context(TUNED_MATMUL=0): assert not tuned(x, w)
assert not tuned(Tensor.empty(128, 32, dtype=dtypes.half), Tensor.empty(8, 32))  # the value-embedding gate: N = 8 doesn't divide
assert not tuned(Tensor.empty(64, 512, dtype=dtypes.half), Tensor.empty(512, 512))  # too few tokens for the tile
assert not tuned(Tensor.empty(64, 64), Tensor.empty(64, 64))                    # float32: no half tensor core
print("tuned ok")
"""

def test_opts_compile_for_the_h200():
  # the kernels are compiled (not run) for an sm_90 GPU by tinygrad's NULL device, which needs no GPU and no CUDA library
  env = {**os.environ, "DEV": "MOCK+NULL:PTX:sm_90", "PYTHONPATH": str(ROOT)}
  r = subprocess.run([sys.executable, "-c", TUNED], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert r.returncode == 0 and "tuned ok" in r.stdout, r.stderr[-3000:]

def test_backprop_context():
  # the kernel has no gradient, so backprop turns it off; the switch is a tinygrad ContextVar, read at graph-building time
  with Context(TUNED_MATMUL=0): assert not tuned(Tensor.empty(64, 64, dtype=dtypes.half), Tensor.empty(64, 64))
