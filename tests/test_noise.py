"""Tests of kernels/noise.py: bit-exact threefry vs a NumPy reference, determinism, statistics, fusion, keys as JIT inputs."""
import math
import numpy as np
import pytest
from tinygrad import Tensor, TinyJit, GlobalCounters, dtypes
from tinygrad.device import Buffer
from kernels.noise import key, fold, bits, gaussian, rademacher

# ***** NumPy reference: Threefry-2x32-20 (Salmon et al. 2011, Random123) *****

ROTATIONS = [[13, 15, 26, 6], [17, 29, 16, 24]]

def threefry2x32(k0, k1, c0, c1) -> tuple[np.ndarray, np.ndarray]:
  """Threefry-2x32 with 20 rounds on broadcast uint32 arrays; returns the two output words (x0, x1)."""
  k0, k1, x0, x1 = (np.atleast_1d(np.asarray(v, dtype=np.uint64)).astype(np.uint32) for v in (k0, k1, c0, c1))
  k0, k1, x0, x1 = np.broadcast_arrays(k0, k1, x0, x1)
  ks = [k0, k1, k0 ^ k1 ^ np.uint32(0x1BD11BDA)]
  x0, x1 = x0 + ks[0], x1 + ks[1]
  for i in range(5):
    for r in ROTATIONS[i % 2]:
      x0 = x0 + x1
      x1 = ((x1 << np.uint32(r)) | (x1 >> np.uint32(32 - r))) ^ x0
    x0, x1 = x0 + ks[(i + 1) % 3], x1 + ks[(i + 2) % 3] + np.uint32(i + 1)
  return x0, x1

def ref_key(seed:int) -> tuple[int, int]: return seed & 0xffffffff, (seed >> 32) & 0xffffffff
def ref_fold(k:tuple[int, int], d:int) -> tuple[int, int]:
  lo, hi = threefry2x32(k[0], k[1], d, 1)
  return int(lo[0]), int(hi[0])
def ref_words(k:tuple[int, int], n:int) -> tuple[np.ndarray, np.ndarray]: return threefry2x32(k[0], k[1], np.arange(n), 0)
def ref_bits(k:tuple[int, int], n:int) -> np.ndarray:
  lo, hi = ref_words(k, n)
  return (hi.astype(np.uint64) << np.uint64(32)) | lo.astype(np.uint64)
def ref_uniform(w:np.ndarray) -> np.ndarray: return ((w >> np.uint32(9)) | np.uint32(0x3f800000)).view(np.float32) - np.float32(1.0)
def ref_gaussian(k:tuple[int, int], n:int) -> np.ndarray:
  """Box-Muller on each word of call n // 4: r = sqrt(-2 ln(1 - u1)), u1 its low 16 bits, t = 2 pi u2, u2 its high 16 bits; value 4j + 2h + s
  is word h (lo, hi) of call j, r cos t for s = 0 and r sin t for s = 1."""
  lo, hi = ref_words(k, (n + 3) // 4)
  w = np.stack([lo, hi], -1).astype(np.float64)
  r, t = np.sqrt(-2 * np.log(1 - (w % 65536) / 65536)), 2 * np.pi * np.floor(w / 65536) / 65536
  return np.stack([r * np.cos(t), r * np.sin(t)], -1).reshape(-1)[:n]

SEEDS = [0, 1, 42, 0xdeadbeef, 2**32 + 7, 2**63 + 12345]

def test_reference_known_answers():
  """The reference itself against Random123's kat_vectors (threefry2x32_20): a wrong reference would make every check below moot."""
  kat = [((0, 0), (0, 0), (0x6b200159, 0x99ba4efe)),
         ((0xffffffff, 0xffffffff), (0xffffffff, 0xffffffff), (0x1cb996fc, 0xbb002be7)),
         ((0x13198a2e, 0x03707344), (0x243f6a88, 0x85a308d3), (0xc4923a9c, 0x483df7a0))]
  for (k0, k1), (c0, c1), want in kat:
    got = threefry2x32(k0, k1, c0, c1)
    assert (int(got[0][0]), int(got[1][0])) == want, f"key {(k0, k1)} ctr {(c0, c1)}"

# ***** bit-exact agreement with the reference *****

def test_key_words():
  """key(seed) is (lo, hi) uint32, realized: a truncated seed (hi word dropped) would alias seeds 2**32 apart."""
  for s in SEEDS:
    k = key(s)
    assert k.dtype == dtypes.uint32 and k.shape == (2,) and k.uop.is_realized
    assert tuple(k.tolist()) == ref_key(s)

def test_bits_match_reference():
  """bits(key(s)) is threefry(key, (i, 0)) packed hi<<32|lo: catches swapped words, wrong counters, wrong rounds or key schedule."""
  shape = (50, 60)
  for s in SEEDS:
    b = bits(key(s), shape)
    assert b.dtype == dtypes.uint64 and b.shape == shape
    np.testing.assert_array_equal(b.numpy().reshape(-1), ref_bits(ref_key(s), math.prod(shape)), err_msg=f"seed {s}")

def test_fold_matches_reference():
  """fold(k, d) is threefry(k, (d, 1)), applied in turn for several data: catches ignored data, wrong counter word, wrong order."""
  for s in SEEDS[:4] + SEEDS[-1:]:
    k, rk = key(s), ref_key(s)
    assert tuple(fold(k, 5).tolist()) == ref_fold(rk, 5)
    assert tuple(fold(k, 3, 7).tolist()) == ref_fold(ref_fold(rk, 3), 7)
    assert fold(k, 3, 7).tolist() != fold(k, 7, 3).tolist()
    ks = fold(k, Tensor.arange(6))
    assert ks.shape == (6, 2) and ks.dtype == dtypes.uint32
    assert [tuple(r) for r in ks.tolist()] == [ref_fold(rk, d) for d in range(6)]

def test_fold_tensor_equals_int():
  """fold with an int tensor gives the same keys as fold with the ints: a batch of keys must not differ from the scalar path."""
  k = key(99)
  batched = fold(k, Tensor([0, 17, 123456], dtype=dtypes.int32)).tolist()
  assert batched == [fold(k, d).tolist() for d in (0, 17, 123456)]

def test_bits_batched_keys():
  """A (..., 2) batch of keys gives key.shape[:-1] + shape, each slice the stream of its own key: catches broadcasting the wrong word."""
  ks = fold(key(2**40 + 3), Tensor.arange(4)).reshape(2, 2, 2)
  kw = ks.numpy()
  b = bits(ks, (3, 5))
  assert b.shape == (2, 2, 3, 5)
  got = b.numpy()
  for i in range(2):
    for j in range(2):
      np.testing.assert_array_equal(got[i, j].reshape(-1), ref_bits((int(kw[i, j, 0]), int(kw[i, j, 1])), 15))

def test_gaussian_matches_reference():
  """gaussian() is Box-Muller on each reference word's halves, four values a call: catches swapped words or halves, log(u1) vs
  log(1-u1), sin and cos swapped, a quadrant of the CPU's polynomials off, and a count that isn't a multiple of 4 (7 values)."""
  for s in SEEDS[:2]: np.testing.assert_allclose(gaussian(key(s), (7,)).numpy(), ref_gaussian(ref_key(s), 7), rtol=1e-5, atol=1e-6)
  shape = (40, 50)
  for s in SEEDS[:3] + SEEDS[-2:]:
    g = gaussian(key(s), shape)
    assert g.dtype == dtypes.float32 and g.shape == shape
    np.testing.assert_allclose(g.numpy().reshape(-1), ref_gaussian(ref_key(s), math.prod(shape)), rtol=1e-5, atol=1e-6, err_msg=f"seed {s}")
  assert gaussian(key(0), (3,), dtypes.float16).dtype == dtypes.float16

def test_rademacher_matches_reference():
  """rademacher() is +1 where the top bit of the lo word is set, else -1, exactly: catches using the hi word or an inverted sign."""
  shape = (40, 50)
  for s in SEEDS[:3] + SEEDS[-2:]:
    r = rademacher(key(s), shape)
    assert r.dtype == dtypes.float32 and r.shape == shape
    lo, _ = ref_words(ref_key(s), math.prod(shape))
    np.testing.assert_array_equal(r.numpy().reshape(-1), np.where(lo >> np.uint32(31), 1.0, -1.0).astype(np.float32), err_msg=f"seed {s}")

# ***** determinism and independence *****

def test_same_key_same_numbers():
  """Two separate evaluations from equal keys give identical numbers: a stateful generator (counter, Tensor.rand) would not."""
  shape = (30, 70)
  for fn in (bits, gaussian, rademacher):
    a, b = fn(key(7), shape).numpy(), fn(key(7), shape).numpy()
    np.testing.assert_array_equal(a, b)
  np.testing.assert_array_equal(gaussian(fold(key(7), 4), shape).numpy(), gaussian(fold(key(7), 4), shape).numpy())

def corr(a:np.ndarray, b:np.ndarray) -> float: return float(np.corrcoef(a.reshape(-1), b.reshape(-1))[0, 1])

def test_different_keys_uncorrelated():
  """Different keys (incl. sibling children fold(k,0), fold(k,1) for two same-shape params) give uncorrelated noise: catches fold ignoring d."""
  shape = (250, 400)
  n, k = math.prod(shape), key(3)
  bound = 5 / math.sqrt(n)
  z0, z1 = gaussian(fold(k, 0), shape).numpy(), gaussian(fold(k, 1), shape).numpy()
  zk, zs, zh = gaussian(k, shape).numpy(), gaussian(key(4), shape).numpy(), gaussian(key(3 + 2**32), shape).numpy()
  pairs = {"fold 0/1": (z0, z1), "parent/child": (zk, z0), "seed 3/4": (zk, zs), "seed 3/3+2**32": (zk, zh),
           "fold 0/1 shifted by one": (z0.reshape(-1)[1:], z1.reshape(-1)[:-1])}
  for name, (a, b) in pairs.items(): assert abs(corr(a, b)) < bound, name
  # rademacher too: sibling children must not share their sign pattern
  r0, r1 = rademacher(fold(k, 0), shape).numpy(), rademacher(fold(k, 1), shape).numpy()
  assert abs(corr(r0, r1)) < bound

# ***** statistics *****

N_STAT = 10**6

def test_gaussian_statistics():
  """1e6 samples have mean 0, variance 1, excess kurtosis 0 within 5 standard errors: catches wrong scale (e.g. missing -2), u in the
  wrong range, or a non-Gaussian shape (e.g. uniform: kurtosis -1.2). The 16-bit uniforms cut the tails at 4.71, which moves the
  variance by 6e-5 and the kurtosis by 1.4e-3, below a tenth of the tolerances (0.007, 0.024)."""
  z = gaussian(key(123), (1000, N_STAT // 1000)).numpy().astype(np.float64).reshape(-1)
  n = z.size
  assert np.isfinite(z).all()
  m, v = z.mean(), z.var()
  assert abs(m) < 5 / math.sqrt(n)
  assert abs(v - 1) < 5 * math.sqrt(2 / n)  # var of the sample variance of N(0,1) is 2/n
  kurt = ((z - m)**4).mean() / v**2 - 3
  assert abs(kurt) < 5 * math.sqrt(24 / n)  # var of the sample excess kurtosis of N(0,1) is ~24/n
  # Kolmogorov-Smirnov: sqrt(n) sup|F_n - Phi| exceeds 1.95 with probability 0.001 for Gaussian samples. Catches what the moments
  # miss: an angle or radius of the wrong shape, a polynomial off in one quadrant
  cdf, s = 0.5 * (1 + np.vectorize(math.erf)(np.sort(z) / math.sqrt(2))), np.arange(n + 1) / n
  assert math.sqrt(n) * max((s[1:] - cdf).max(), (cdf - s[:-1]).max()) < 1.95

def test_gaussian_neighbours_independent():
  """Values at neighbouring indices, and their squares, must be uncorrelated within 5/sqrt(n). Box-Muller's pairs share a radius and
  an angle, yet are independent Gaussians, so this holds for every neighbour; it catches a word or call used twice (cos t twice, or
  one word for both pairs of a call) and a counter that advances too slowly."""
  z = gaussian(key(77), (N_STAT,)).numpy().astype(np.float64)
  a, b = z[:-1], z[1:]
  for name, (x, y) in {"neighbours": (a, b), "their squares": (a ** 2, b ** 2)}.items(): assert abs(corr(x, y)) < 5 / math.sqrt(x.size), name

def test_rademacher_statistics():
  """1e6 samples are exactly +-1 with mean 0 within 5/sqrt(n): catches 0/1 output or a biased bit."""
  r = rademacher(key(321), (1000, N_STAT // 1000)).numpy().reshape(-1)
  assert set(np.unique(r).tolist()) == {-1.0, 1.0}
  assert abs(r.astype(np.float64).mean()) < 5 / math.sqrt(r.size)

# ***** fusion: noise is computed inside the consumer kernel, never stored *****

@pytest.fixture
def peak():
  """Track the peak of GlobalCounters.mem_used by wrapping Buffer.allocate (tinygrad has no peak counter); restore it afterwards."""
  orig, box = Buffer.allocate, [0]
  def tracked(self, *args, **kwargs):
    ret = orig(self, *args, **kwargs)
    box[0] = max(box[0], GlobalCounters.mem_used)
    return ret
  Buffer.allocate = tracked
  try: yield box
  finally: Buffer.allocate = orig

def test_gaussian_fuses_into_matmul_epilogue(peak):
  """x@W + sigma*gaussian is ONE kernel with no noise-sized buffer; the .contiguous() control must show 2 kernels and the extra buffer."""
  M, K, N, sigma = 64, 512, 256, 1e-2
  rng = np.random.default_rng(0)
  x, W = Tensor(rng.standard_normal((M, K), dtype=np.float32)).realize(), Tensor(rng.standard_normal((K, N), dtype=np.float32)).realize()
  k = key(11)
  out_nbytes = M * N * 4
  def measure(fn):
    GlobalCounters.reset()
    base = peak[0] = GlobalCounters.mem_used
    out = fn().realize()
    return out, GlobalCounters.kernel_count, peak[0] - base
  y, kernels, extra = measure(lambda: x @ W + sigma * gaussian(k, (M, N)))
  assert kernels == 1, f"fused noise ran as {kernels} kernels"
  assert extra <= out_nbytes, f"extra peak {extra} B > output {out_nbytes} B: the noise was materialized"
  y2, kernels2, extra2 = measure(lambda: x @ W + sigma * gaussian(k, (M, N)).contiguous())
  assert kernels2 == 2 and extra2 >= out_nbytes + M * N * 4, f"control: {kernels2} kernels, extra {extra2} B"
  np.testing.assert_allclose(y.numpy(), y2.numpy(), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(y.numpy(), x.numpy() @ W.numpy() + sigma * ref_gaussian((11, 0), M * N).reshape(M, N), rtol=1e-4, atol=1e-3)

# ***** keys as JIT inputs *****

def test_key_as_jit_input():
  """A realized key passed to a TinyJit gives new noise per key and equals the eager result, with one capture (no baked-in seed)."""
  shape = (8, 16)
  @TinyJit
  def f(k:Tensor) -> Tensor: return (gaussian(fold(k, 2), shape) + rademacher(k, shape)).realize()
  outs, captured = [], None
  for i in range(5):
    out = f(key(100 + i)).numpy().copy()  # the jit reuses its output buffer: copy before the next call
    assert f.cnt == i + 1
    if i >= 2: assert f.captured is captured, "the jit recaptured"
    captured = f.captured
    np.testing.assert_allclose(out, (gaussian(fold(key(100 + i), 2), shape) + rademacher(key(100 + i), shape)).numpy(), rtol=1e-6, atol=1e-6)
    outs.append(out)
  for i in range(len(outs)):
    for j in range(i):
      assert not np.allclose(outs[i], outs[j]), f"calls {i} and {j} gave the same noise"
