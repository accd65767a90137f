"""kernels/matmul.py: linear computes act(x) @ w.T, with the CUDA kernel where `tuned` says it applies and tinygrad's matmul elsewhere."""
import numpy as np
import pytest
from tinygrad import Device, Tensor, dtypes
from kernels.matmul import halved, linear, matmul, mix_rows, outer_sum, tuned, wgmma
import kernels.matmul

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

def test_halved():
  # outer_sum's half operands: float32 values as small as Dust's per-token errors (here about 1e-9, which half would flush to 0) are
  # scaled to a largest magnitude of 2^14 and keep half's 11 bits, and the scale returned undoes it; a half tensor is taken as it is
  a = (np.random.default_rng(0).normal(size=(64, 48)) * 1e-9).astype(np.float32)
  h, s = halved(Tensor(a))
  assert h.dtype == dtypes.half and np.abs(h.numpy()).max() == 2**14
  # rounded to the nearest half: half a unit in the last of 11 bits, or of half's subnormal step 2^-24, in the scaled units
  np.testing.assert_allclose(h.numpy().astype(np.float64) / s.item(), a, rtol=2**-11, atol=2**-25 / s.item())
  x = Tensor(a * 1e9).cast(dtypes.half)
  assert halved(x) == (x, 1.0)

def test_outer_sum_here():
  # a^T b over the rows in float32, tinygrad's matmul where the CUDA kernels don't run: a transpose missing or the wrong operand fails
  rng = np.random.default_rng(1)
  a, b = rng.normal(size=(40, 24)).astype(np.float32), rng.normal(size=(40, 16)).astype(np.float16)
  out = outer_sum(Tensor(a), Tensor(b)).numpy()
  assert out.dtype == np.float32 and out.shape == (24, 16)
  np.testing.assert_allclose(out, a.astype(np.float64).T @ b.astype(np.float64), rtol=1e-5, atol=1e-5)

def test_mix_rows_here(monkeypatch):
  # c @ x for x [n, T, H]: here tinygrad's matmul, and the tensor cores' layout (x's rows first, one sum for all n at once) with
  # outer_sum's arithmetic in float32: a wrong permute mixes the sequences or the heads
  rng = np.random.default_rng(3)
  # weights at most 1, as a credit's, and whole halves, as the tensor cores take them
  c, x = rng.uniform(size=(16, 16)).astype(np.float16).astype(np.float32), rng.normal(size=(3, 16, 5)).astype(np.float32)
  ref = np.einsum("ts,nsh->nth", c.astype(np.float64), x.astype(np.float64))
  np.testing.assert_allclose(mix_rows(Tensor(c), Tensor(x)).numpy(), ref, rtol=1e-5, atol=1e-5)
  monkeypatch.setattr(kernels.matmul, "tensor_cores", lambda a, b: True)
  monkeypatch.setattr(kernels.matmul, "outer_sum", lambda a, b: a.float().T @ b.float())
  np.testing.assert_allclose(mix_rows(Tensor(c), Tensor(x)).numpy(), ref, rtol=1e-5, atol=1e-5)

@pytest.mark.skipif(not tuned(Tensor.empty(128, 128, dtype=dtypes.half), Tensor.empty(128, 128)), reason=f"{Device.DEFAULT} has no CUDA sm_80+")
def test_kernel_outer_sum():
  # Dust's reassembly on the tensor cores (runs on the GPU machine): errors of about 1e-7, whose sums half would flush or round coarsely
  # unscaled, and a one-hot of token ids, within half's rounding of the float32 sums
  rng = np.random.default_rng(2)
  err, x = (rng.normal(size=(1024, 256)) * 1e-7).astype(np.float32), rng.normal(size=(1024, 384)).astype(np.float16)
  onehot = (rng.integers(0, 128, 1024)[:, None] == np.arange(128)).astype(np.float32)
  for a, b in ((err, x), (onehot, err)):
    ref = a.astype(np.float64).T @ b.astype(np.float64)
    out = outer_sum(Tensor(a), Tensor(b)).numpy()
    assert np.linalg.norm(out - ref) / np.linalg.norm(ref) < 2**-10
  # a discounted credit of Dust's local draws (gamma 0.98, window 1024) over 2,048 tokens of scores of about 1e-6, 64 x 8 of them
  lag = np.arange(2048)[None, :] - np.arange(2048)[:, None]
  credit = np.where((lag >= 0) & (lag <= 1024), 0.98 ** np.maximum(lag, 0), 0).astype(np.float32)
  score = (rng.normal(size=(64, 2048, 8)) * 1e-6).astype(np.float32)
  ref = np.einsum("ts,nsh->nth", credit.astype(np.float64), score.astype(np.float64))
  out = mix_rows(Tensor(credit), Tensor(score)).numpy()
  assert np.linalg.norm(out - ref) / np.linalg.norm(ref) < 2**-10

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
