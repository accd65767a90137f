"""kernels/attention.py: the blocked, max-free attention against a float64 softmax, its mask, and its precision in half."""
import math
import numpy as np
import pytest
from tinygrad import Tensor, dtypes
from tinygrad.uop.ops import Ops, UOp
from kernels.attention import attention, mix, probs, spans
from kernels.flash import fits

T = 16

def unit_rms(rng:np.random.Generator, *shape:int) -> np.ndarray:  # what QK-norm hands the attention
  x = rng.normal(size=shape)
  return x / np.sqrt((x ** 2).mean(-1, keepdims=True))

def tok(a:np.ndarray) -> np.ndarray: return a.swapaxes(1, 2)  # heads first <-> tokens first, the layout `attention` takes

def reference(q:np.ndarray, k:np.ndarray, v:np.ndarray, W:int) -> tuple[np.ndarray, np.ndarray]:
  """(output, probabilities) in float64, with the max-subtracting softmax over keys t, 0 <= s - t <= W."""
  lag = np.arange(q.shape[2])[:, None] - np.arange(q.shape[2])[None, :]
  s = np.where((lag >= 0) & (lag <= W), q @ k.swapaxes(-1, -2) / math.sqrt(q.shape[-1]), -np.inf)
  p = np.exp(s - s.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  return p @ v, p

@pytest.mark.parametrize("block", [5, T])
@pytest.mark.parametrize("W", [0, 3, 8, T])
def test_window(W:int, block:int):
  # query s sees keys t with 0 <= s - t <= W, nothing else, whatever the query blocks (5 leaves a ragged last block, and with W = 3
  # blocks that start past key 0): an off-by-one window, a key range cut short, a future key or a wrong scale fails
  rng = np.random.default_rng(W)
  q, k, v = unit_rms(rng, 2, 2, T, 8), unit_rms(rng, 2, 2, T, 8), rng.normal(size=(2, 2, T, 8))
  ref, p = reference(q, k, v, W)
  def run(k:np.ndarray, v:np.ndarray) -> np.ndarray:
    return tok(attention(*[Tensor(tok(a).astype(np.float32)) for a in (q, k, v)], W, block).numpy())
  out = run(k, v)
  np.testing.assert_allclose(out, ref, atol=1e-5, rtol=1e-5)
  # the probabilities by block, and them applied to two draws of values at once (a batch twice p's)
  pb = probs(*[Tensor(tok(a).astype(np.float32)) for a in (q, k)], W, dtypes.float32, block)
  v2 = np.concatenate([v, 2 * v])
  np.testing.assert_allclose(tok(mix(pb, Tensor(tok(v2).astype(np.float32)), W, block).numpy()), np.concatenate([ref, 2 * ref]), atol=1e-5,
                             rtol=1e-5)
  for b, (s0, s1, t0) in zip(pb, spans(T, W, block)):  # each block holds all its rows' probability: the keys it skips have none
    np.testing.assert_allclose(b.numpy(), p[:, :, s0:s1, t0:s1], atol=1e-6)
    np.testing.assert_allclose(b.numpy().sum(-1), 1, atol=1e-6)
  # moving key/value t0 changes exactly the queries t0..t0+W
  t0, v2, k2 = 4, v.copy(), k.copy()
  v2[:, :, t0], k2[:, :, t0] = v2[:, :, t0] + 1, -k2[:, :, t0]
  changed = np.abs(run(k2, v2) - out).max(axis=(0, 1, 3)) > 1e-6
  np.testing.assert_array_equal(changed, (np.arange(T) >= t0) & (np.arange(T) <= t0 + W))

@pytest.mark.parametrize("hd", [64, 256])
def test_half_range(hd:int):
  # the largest score QK-norm allows, sqrt(hd) (every query equal to every key), in half: exp(8) fits at hd = 64, while exp(16) at
  # hd = 256 would overflow half (65504) to inf and the output to NaN without the shift
  rng = np.random.default_rng(hd)
  k = unit_rms(rng, 1, 2, 1, hd).repeat(T, 2)
  q, v = k.copy(), rng.normal(size=(1, 2, T, hd))
  q[:, :, 1::2] = unit_rms(rng, 1, 2, T // 2, hd)  # and ordinary scores on every other row
  out = tok(attention(*[Tensor(tok(a).astype(np.float16)) for a in (q, k, v)], T, 4).numpy())
  assert out.dtype == np.float16
  np.testing.assert_allclose(out.astype(np.float64), reference(q, k, v, T)[0], atol=1e-2)  # half: ~2^-11 relative per value

def exp_of_half(u:UOp) -> bool:
  """Whether the value that EXP2 `u` reads was held in half since its last reduction or buffer (a score rounded to half)."""
  todo, seen = list(u.src), set()
  while todo:
    s = todo.pop()
    if s in seen or s.op in (Ops.REDUCE, Ops.CONTIGUOUS, Ops.BUFFER): continue
    seen.add(s)
    if s.dtype == dtypes.half: return True
    todo.extend(s.src)
  return False

def half_sdpa(q:Tensor, k:Tensor, v:Tensor, window:int) -> Tensor:
  """The wrong version (tinygrad's sdpa): scores and softmax in the half dtype of v."""
  lag = Tensor.arange(q.shape[2]).reshape(-1, 1) - Tensor.arange(q.shape[2]).reshape(1, -1)
  scores = (q.cast(v.dtype) @ k.cast(v.dtype).transpose(-1, -2)) / math.sqrt(q.shape[-1])
  return ((lag >= 0) & (lag <= window)).where(scores, -math.inf).softmax(-1) @ v

def test_half_scores_float32():
  # in half, the scores that exp reads are accumulated and kept in float32 (DUST.md §1.4: as flash attention does); tinygrad's sdpa
  # rounds them to half first, which the check must catch
  rng = np.random.default_rng(0)
  q, k, v = [Tensor(tok(unit_rms(rng, 1, 2, T, 8)).astype(np.float16)) for _ in range(3)]
  def exps(out:Tensor) -> list[UOp]: return [u for u in out.uop.toposort() if u.op is Ops.EXP2]
  assert exps(out := attention(q, k, v, 3, 5)) and not any(exp_of_half(u) for u in exps(out))
  assert any(exp_of_half(u) for u in exps(half_sdpa(*[t.transpose(1, 2) for t in (q, k, v)], 3)))

@pytest.mark.skipif(not fits(Tensor.empty(1, 128, 1, 64, dtype=dtypes.half), Tensor.empty(1, 128, 1, 64, dtype=dtypes.half)),
                    reason="kernels/flash.py runs on NVIDIA GPUs (sm_80+) only")
@pytest.mark.parametrize("dtype", [dtypes.half, dtypes.float32])
@pytest.mark.parametrize("W", [0, 100, 384])
def test_flash(W:int, dtype):
  # the CUDA kernels (run on the GPU machine), 3 blocks of 128 queries: a wrong fragment layout, mask or pipeline stage, or a key block
  # skipped that a warp sees (W = 100 ends windows inside a block), gives wrong rows
  rng = np.random.default_rng(W)
  q, k, v = unit_rms(rng, 2, 3, 384, 64), unit_rms(rng, 2, 3, 384, 64), rng.normal(size=(2, 3, 384, 64))
  npd = np.float16 if dtype == dtypes.half else np.float32
  out = tok(attention(*[Tensor(tok(a).astype(npd)) for a in (q, k, v)], W).numpy())
  assert out.dtype == npd
  # half: ~2^-11 relative per value; float32: sums of ~400 terms at 2^-24
  np.testing.assert_allclose(out.astype(np.float64), reference(q, k, v, W)[0], atol=1e-2 if dtype == dtypes.half else 1e-5)
