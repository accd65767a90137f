"""kernels/matmul.py: linear computes act(x) @ w.T, with the CUDA kernel where `tuned` says it applies and tinygrad's matmul elsewhere."""
import numpy as np
import pytest
from tinygrad import Device, Tensor, dtypes
from kernels.matmul import linear, matmul, tuned, wgmma

def reference(x:np.ndarray, w:np.ndarray, npd, act:str|None) -> np.ndarray:
  """In float64 from x and w rounded to npd, with relu(x)^2 rounded to npd too (the kernel squares in half)."""
  x, w = x.astype(npd), w.astype(npd)
  if act == "relu2": x = np.maximum(x, 0) * np.maximum(x, 0)
  return x.astype(np.float64) @ w.astype(np.float64).T

def check(M:int, N:int, K:int, dtype, act:str|None, rtol:float):
  rng = np.random.default_rng(0)
  x, w = rng.normal(size=(M, K)).astype(np.float32), rng.normal(size=(N, K)).astype(np.float32) / np.sqrt(K)
  npd = np.float32 if dtype == dtypes.float32 else np.float16
  out = linear(Tensor(x).cast(dtype), Tensor(w), act).numpy()
  assert out.dtype == npd and out.shape == (M, N)
  # K products of |x w| ~ 1/sqrt(K) sum to ~1 in float32; a half result is rounded once more, by at most 2^-11 relative
  np.testing.assert_allclose(out.astype(np.float64), reference(x, w, npd, act), rtol=rtol, atol=1e-3)

@pytest.mark.parametrize("dtype,act", [(dtypes.float32, None), (dtypes.half, None), (dtypes.half, "relu2")])
def test_linear_here(dtype, act):
  # tinygrad's matmul on the CPU: a missing transpose, w read unrounded or the activation left out fails
  assert not tuned(Tensor.empty(24, 40, dtype=dtype), Tensor.empty(16, 40))
  check(24, 16, 40, dtype, act, 1e-6 if dtype == dtypes.float32 else 2**-11)

def test_untuned():
  # N = 64 isn't a multiple of the tile, on any device: linear is tinygrad's own matmul, batch axes and all
  x, w = Tensor.ones(2, 64, 128, dtype=dtypes.half), Tensor.ones(64, 128)
  assert not tuned(x, w)
  np.testing.assert_array_equal(linear(x, w).numpy(), np.full((2, 64, 64), 128, np.float16))

@pytest.mark.skipif(not tuned(Tensor.empty(128, 128, dtype=dtypes.half), Tensor.empty(128, 128)), reason=f"{Device.DEFAULT} has no CUDA sm_80+")
@pytest.mark.parametrize("act", [None, "relu2"])
def test_kernel(act):
  # the CUDA kernel itself (runs on the GPU machine): a wrong fragment layout, swizzle or pipeline stage gives wrong sums
  for M, N, K in ((128, 128, 32), (256, 384, 96), (1024, 512, 2048)):  # one step of K, odd tile counts, many steps
    check(M, N, K, dtypes.half, act, 2**-10)

def test_weight_per_group_here():
  # w [G, N, K]: row group g of x times weight g (a population's members, kernels/perturb.py); a group reading another's weight fails
  rng = np.random.default_rng(1)
  G, R, N, K = 3, 8, 16, 40
  x, w = rng.normal(size=(G * R, K)).astype(np.float32), rng.normal(size=(G, N, K)).astype(np.float32) / np.sqrt(K)
  out = linear(Tensor(x), Tensor(w)).numpy()
  ref = np.concatenate([x[g * R:(g + 1) * R].astype(np.float64) @ w[g].astype(np.float64).T for g in range(G)])
  np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)

@pytest.mark.skipif(not tuned(Tensor.empty(128, 128, dtype=dtypes.half), Tensor.empty(128, 128)), reason=f"{Device.DEFAULT} has no CUDA sm_80+")
@pytest.mark.parametrize("act", [None, "relu2"])
def test_kernel_weight_per_group(act):
  # the kernel with a weight per group of 256 rows: a block that took group 0's weight, or its neighbour's, gives wrong sums
  rng = np.random.default_rng(2)
  G, R, N, K = 3, 256, 384, 96
  x, w = rng.normal(size=(G * R, K)).astype(np.float32), rng.normal(size=(G, N, K)).astype(np.float32) / np.sqrt(K)
  assert tuned(Tensor.empty(G * R, K, dtype=dtypes.half), Tensor.empty(G, N, K))
  out = linear(Tensor(x).cast(dtypes.half), Tensor(w), act).numpy()
  ref = np.concatenate([reference(x[g * R:(g + 1) * R], w[g], np.float16, act) for g in range(G)])
  np.testing.assert_allclose(out.astype(np.float64), ref, rtol=2**-10, atol=1e-3)

@pytest.mark.skipif(not wgmma(Device.DEFAULT), reason=f"{Device.DEFAULT} is no Hopper GPU (wgmma)")
def test_kernel_nmajor():
  # x @ w with w [K, N] read as stored, N-major (backprop's dx = dy w, run on the GPU machine): a wrong block offset in the descriptor,
  # or a chunk stored under another swizzle, gives wrong sums; the shapes as in test_kernel
  rng = np.random.default_rng(3)
  for M, N, K in ((128, 128, 32), (256, 384, 96), (1024, 512, 2048)):
    x, w = rng.normal(size=(M, K)).astype(np.float16), (rng.normal(size=(K, N)) / np.sqrt(K)).astype(np.float16)
    out = matmul(Tensor(x), Tensor(w), nmajor=True).numpy()
    np.testing.assert_allclose(out.astype(np.float64), x.astype(np.float64) @ w.astype(np.float64), rtol=2**-10, atol=1e-3)
