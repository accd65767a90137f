"""kernels/jitter.py: a site's jitter x + sigma z, with z kernels/noise.py's Gaussians; as tinygrad's ops (every backend), as a CUDA kernel
of its own, and in the GEMM's epilogue (kernels/matmul.py), on NVIDIA GPUs. All three against the NumPy reference of test_noise.py."""
import numpy as np
import pytest
from tinygrad import Device, Tensor, dtypes
from kernels.jitter import jitter
from kernels.matmul import linear, tuned
from kernels.noise import fold, key
from test_noise import ref_gaussian

def ref_runs(keys:Tensor, shape:tuple[int, ...]) -> np.ndarray:
  """The noise of runs(keys, shape): the first axis split into one run a key, each run that key's Gaussians."""
  ks = keys.numpy().reshape(-1, 2)
  n = int(np.prod(shape)) // len(ks)
  return np.concatenate([ref_gaussian((int(k0), int(k1)), n) for k0, k1 in ks]).reshape(shape)

def half_close(got:np.ndarray, x:np.ndarray, noise:np.ndarray):
  """got is x + noise as tinygrad rounds it: the noise to half, then the sum, each within half's unit roundoff u = 2^-11 of the value
  it rounds (the kernels' sine and log differ from NumPy's only in float32's last bits, 1e-6 of a value)."""
  want = x.astype(np.float64) + noise
  err, bound = np.abs(got.astype(np.float64) - want), 2**-11 * (np.abs(noise) + np.abs(want)) * 1.01 + 2**-24
  assert (err <= bound).all(), f"{(err > bound).sum()} of {err.size} values off, the worst by {(err / bound).max():.2f} of the bound"

def sites(G:int) -> Tensor: return key(9) if G == 1 else fold(key(9), Tensor.arange(G)).contiguous().realize()

@pytest.mark.parametrize("G", [1, 4])
def test_jitter_here(G:int):
  # on this device (tinygrad's ops on the CPU): runs taken from the wrong key, the noise unscaled, or rounded twice shows
  x = Tensor(np.random.default_rng(0).normal(size=(8, 16, 24)).astype(np.float16)).realize()
  ks = sites(G)
  half_close(jitter(x, ks, 0.3).numpy(), x.numpy(), 0.3 * ref_runs(ks, x.shape))

GPU = pytest.mark.skipif(not tuned(Tensor.empty(128, 128, dtype=dtypes.half), Tensor.empty(128, 128)), reason=f"{Device.DEFAULT} has no CUDA sm_80+")

@GPU
@pytest.mark.parametrize("G", [1, 8])
def test_jitter_kernel(G:int):
  # the CUDA kernel: a thread's 8 values from the wrong call or word, a run's key taken at the wrong place, or cos and sin swapped fail
  x = Tensor(np.random.default_rng(1).normal(size=(64, 256, 128)).astype(np.float16)).realize()
  ks = sites(G)
  half_close(jitter(x, ks, 0.3).numpy(), x.numpy(), 0.3 * ref_runs(ks, x.shape))

@GPU
@pytest.mark.parametrize("G,act", [(1, None), (4, "relu2")])
def test_jitter_in_the_epilogue(G:int, act:str|None):
  # the GEMM's epilogue: lanes l and l ^ 1 swap words, so a wrong swap, a row's call made at r instead of r + 8, or a run boundary
  # misplaced gives the wrong Gaussians at some columns or rows
  rng = np.random.default_rng(2)
  M, N, K = 1024, 384, 256
  x, w = Tensor(rng.normal(size=(M, K)).astype(np.float16)).realize(), Tensor((rng.normal(size=(N, K)) / np.sqrt(K)).astype(np.float32)).realize()
  ks = sites(G)
  clean = linear(x, w, act).numpy()
  half_close(linear(x, w, act, (ks, 0.3)).numpy(), clean, 0.3 * ref_runs(ks, (M, N)))
