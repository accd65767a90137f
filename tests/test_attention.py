"""kernels/attention.py: the blocked, max-free attention against a float64 softmax, its mask, and its precision in half."""
import math
import numpy as np
import pytest
from tinygrad import Tensor, dtypes
from tinygrad.uop.ops import Ops, UOp
from kernels.attention import attention, mix, probs, spans
from kernels.flash import delta, fits, flash

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
  # in half, the scores that exp reads are accumulated and kept in float32 (docs/dust.md §1.4: as flash attention does); tinygrad's sdpa
  # rounds them to half first, which the check must catch
  rng = np.random.default_rng(0)
  q, k, v = [Tensor(tok(unit_rms(rng, 1, 2, T, 8)).astype(np.float16)) for _ in range(3)]
  def exps(out:Tensor) -> list[UOp]: return [u for u in out.uop.toposort() if u.op is Ops.EXP2]
  assert exps(out := attention(q, k, v, 3, 5)) and not any(exp_of_half(u) for u in exps(out))
  assert any(exp_of_half(u) for u in exps(half_sdpa(*[t.transpose(1, 2) for t in (q, k, v)], 3)))

GPU = pytest.mark.skipif(not fits(Tensor.empty(1, 128, 1, 64, dtype=dtypes.half), Tensor.empty(1, 128, 1, 64, dtype=dtypes.half)),
                         reason="kernels/flash.py runs on NVIDIA GPUs (sm_80+) only")

@GPU
@pytest.mark.parametrize("W", [0, 100, 384])
def test_flash(W:int):
  # the CUDA kernel (run on the GPU machine), 3 blocks of 128 queries, two sequences of q and k shared by four of v: a wrong fragment
  # layout, mask or pipeline stage, a key block skipped that a warp sees (W = 100 ends windows inside a block) or a draw reading
  # another sequence's q gives wrong rows
  rng = np.random.default_rng(W)
  q, k, v = unit_rms(rng, 2, 3, 384, 64), unit_rms(rng, 2, 3, 384, 64), rng.normal(size=(4, 3, 384, 64))
  q, k, v = [a.astype(np.float16) for a in (q, k, v)]
  out = tok(flash(*[Tensor(tok(a)) for a in (q, k, v)], W).numpy())
  assert out.dtype == np.float16
  q64, k64, v64 = [a.astype(np.float64) for a in (q, k, v)]
  ref = np.stack([reference(q64[s % 2][None], k64[s % 2][None], v64[s][None], W)[0][0] for s in range(4)])  # v's s reads q, k's s % 2
  np.testing.assert_allclose(out.astype(np.float64), ref, atol=1e-2)  # half: ~2^-11 relative per value
  np.testing.assert_array_equal(tok(attention(*[Tensor(tok(a)) for a in (q, k, v[:2])], W).numpy()), out[:2])  # attention() is it

@GPU
@pytest.mark.parametrize("moved", ["q", "k"])
@pytest.mark.parametrize("W", [0, 100, 384])
def test_flash_delta(W:int, moved:str):
  # o' - o of the local q and k draws (run on the GPU machine), four draws of two sequences, against float64 attentions of the same half
  # inputs before and after the move: a wrong sign, a missing B o term, a product taken with the wrong operand (q for D or D for k), the
  # mask left out of the moved weights, or a draw reading another sequence's q, k or u fails by O(1) of the change. The kernel rounds
  # w and e to half: 2^-11 of each term, so 2^-9 of the largest change; at W = 0 each query sees only itself and the change is 0, up to
  # float32 rounding of terms of ~0.1 (1e-6 leaves a factor of 30)
  rng = np.random.default_rng(W)
  q, k, u = unit_rms(rng, 2, 3, 384, 64), unit_rms(rng, 2, 3, 384, 64), rng.normal(size=(2, 3, 384, 64))
  base = np.concatenate([q if moved == "q" else k] * 2)
  d = unit_rms(rng, *base.shape) * 0.05 + base
  d = d / np.sqrt((d ** 2).mean(-1, keepdims=True)) - base  # as the draws move q^ or k^: renormalized, a change of ~0.05 a value
  q, k, u, d = [a.astype(np.float16).astype(np.float64) for a in (q, k, u, d)]
  def change(q:np.ndarray, k:np.ndarray, u:np.ndarray, d:np.ndarray) -> np.ndarray:
    moved_q, moved_k = (q + d, k) if moved == "q" else (q, k + d)
    return reference(moved_q[None], moved_k[None], u[None], W)[0][0] - reference(q[None], k[None], u[None], W)[0][0]
  ref = np.stack([change(q[s % 2], k[s % 2], u[s % 2], d[s]) for s in range(4)])
  out = tok(delta(*[Tensor(tok(a).astype(np.float16)) for a in (q, k, u, d)], moved, W).numpy())
  assert out.dtype == np.float32
  np.testing.assert_allclose(out, ref, atol=2**-9 * np.abs(ref).max() + 1e-6, rtol=0)
