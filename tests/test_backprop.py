"""Backprop on kernels/cuda.py's kernels (run on the GPU machine; skipped elsewhere): each kernel's gradient against float64 from the
same half inputs, and the model's gradient against float32. u = 2^-11 is half precision's unit roundoff: a value rounded to half is off
by at most u relative. tests/test_cuda.py checks on the CPU that the backward graph uses every kernel's gradient once."""
import numpy as np
import pytest
from tinygrad import Context, Device, Tensor, dtypes
from kernels import cuda_kernels
from kernels.embed import embedding
from kernels.flash import flash
from kernels.loss import softcapped_loss
from kernels.matmul import linear
from kernels.mix import scale
from kernels.norm import norm, qk_norm
from model import GPT, GPTConfig
import estimators, optim

GPU = pytest.mark.skipif(not cuda_kernels(Device.DEFAULT), reason=f"{Device.DEFAULT} runs no kernels/cuda.py kernels")
U = 2.0 ** -11

def rel(a:np.ndarray, ref:np.ndarray) -> float: return float(np.linalg.norm(a.astype(np.float64) - ref) / np.linalg.norm(ref))

@GPU
@pytest.mark.parametrize("act", [None, "relu2"])
def test_linear(act):
  # 1,024 tokens, a 384 x 256 weight: 6 tiles, so the tokens are split in 4 parts (split-K). dx is the forward kernel on w^T, rounded to
  # half once, and with relu2 once more after the derivative: 2u, doubled. dw sums in float32 (1,024 terms: ~1e-7 relative each, far
  # under u). A transposed operand, a misplaced split, or the activation's derivative left out is off by O(1)
  rng = np.random.default_rng(0)
  M, N, K = 1024, 384, 256
  x, w, r = rng.normal(size=(M, K)).astype(np.float16), (rng.normal(size=(N, K)) / np.sqrt(K)).astype(np.float32), rng.normal(size=(M, N))
  xt, wt = Tensor(x), Tensor(w)
  dx, dw = linear(xt, wt, act).gradient(xt, wt, gradient=Tensor(r.astype(np.float16)))
  x64, w64, r64 = x.astype(np.float64), w.astype(np.float16).astype(np.float64), r.astype(np.float16).astype(np.float64)
  a = np.maximum(x, 0).astype(np.float16) ** 2 if act else x  # the kernel squares in half
  da = r64 @ w64
  assert rel(dx.numpy(), da * 2 * np.maximum(x64, 0) if act else da) < 4 * U
  assert dw.dtype == dtypes.float32 and rel(dw.numpy(), r64.T @ a.astype(np.float64)) < U

def attention64(q:np.ndarray, k:np.ndarray, v:np.ndarray, do:np.ndarray, W:int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """dq, dk, dv of sum(do * softmax(q k^T / 8 + mask) v) in float64, [S, T, H, 64] tokens first."""
  q, k, v, do = [a.astype(np.float64).swapaxes(1, 2) for a in (q, k, v, do)]
  lag = np.arange(q.shape[2])[:, None] - np.arange(q.shape[2])[None, :]
  s = np.where((lag >= 0) & (lag <= W), q @ k.swapaxes(-1, -2) / 8, -np.inf)
  p = np.exp(s - s.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  dp = do @ v.swapaxes(-1, -2)
  ds = p * (dp - (dp * p).sum(-1, keepdims=True))
  return (ds @ k / 8).swapaxes(1, 2), (ds.swapaxes(-1, -2) @ q / 8).swapaxes(1, 2), (p.swapaxes(-1, -2) @ do).swapaxes(1, 2)

@GPU
@pytest.mark.parametrize("W", [100, 384])
def test_flash(W:int):
  # 2 sequences, 3 heads, 384 tokens (6 blocks of 64 queries or keys), windows that end inside a block (100) or span all (384). A term of
  # dq or dk carries up to four roundings to half (the weight, dS as an mma operand, the output, and P inside dS's D), of dv three:
  # 4u and 3u, doubled; a block of keys or queries skipped that some warp sees, a wrong mask or operand order is off by O(1)
  rng = np.random.default_rng(W)
  def unit_rms(*shape): return (x := rng.normal(size=shape)) / np.sqrt((x ** 2).mean(-1, keepdims=True))
  q, k, v, do = unit_rms(2, 384, 3, 64), unit_rms(2, 384, 3, 64), rng.normal(size=(2, 384, 3, 64)), rng.normal(size=(2, 384, 3, 64))
  q, k, v, do = [a.astype(np.float16) for a in (q, k, v, do)]
  qt, kt, vt = Tensor(q), Tensor(k), Tensor(v)
  grads = flash(qt, kt, vt, W).gradient(qt, kt, vt, gradient=Tensor(do))
  for g, ref, rounds in zip(grads, attention64(q, k, v, do, W), (4, 4, 3)):
    assert g.dtype == dtypes.half and rel(g.numpy(), ref) < 2 * rounds * U

@GPU
def test_loss():
  # dL/dz = (softmax(c) - onehot(y)) (1 - (c / cap)^2) g, c = cap tanh(z / cap), computed in float32 and rounded to half once: u, doubled
  rng = np.random.default_rng(3)
  z, y, g = (rng.normal(size=(4, 8, 4096)) * 10).astype(np.float16), rng.integers(0, 4096, (4, 8)).astype(np.int32), rng.normal(size=(4, 8))
  zt = Tensor(z)
  dz = softcapped_loss(zt, Tensor(y), 15.0).gradient(zt, gradient=Tensor(g.astype(np.float32)))[0].numpy()
  c = 15 * np.tanh(z.astype(np.float64) / 15)
  p = np.exp(c - c.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  ref = g[..., None] * (p - np.eye(4096)[y]) * (1 - (c / 15) ** 2)
  assert rel(dz, ref) < 2 * U

@GPU
def test_embedding():
  # the table's gradient, each row the sum of its tokens' gradient rows in float32 (a few terms: ~1e-7 relative), the same at every run;
  # a token added to the wrong row, twice or not at all is off by O(1)
  rng = np.random.default_rng(4)
  w, idx, g = rng.normal(size=(256, 256)).astype(np.float32), rng.integers(0, 256, (8, 128)).astype(np.int32), rng.normal(size=(8, 128, 256))
  wt, g16 = Tensor(w), g.astype(np.float16)
  def grad() -> np.ndarray: return embedding(wt, Tensor(idx), dtypes.half).gradient(wt, gradient=Tensor(g16))[0].numpy()
  ref = np.zeros((256, 256))
  np.add.at(ref, idx.reshape(-1), g16.reshape(-1, 256).astype(np.float64))
  out = grad()
  assert rel(out, ref) < 1e-6 and np.array_equal(out, grad())

@GPU
@pytest.mark.parametrize("add", [False, True])
def test_norm(add:bool):
  # d rms(x + y) with dx in float32 (float32 arithmetic: ~1e-7 relative, 1e-5 leaves 100x) and dy rounded to half once (u, doubled); a
  # row's sums taken over part of it, or y's gradient left out, is off by O(1)
  rng = np.random.default_rng(6)
  x, y, g = rng.normal(size=(2, 8, 512)).astype(np.float32) * 3, rng.normal(size=(2, 8, 512)).astype(np.float16), rng.normal(size=(2, 8, 512))
  xt, yt, g16 = Tensor(x), Tensor(y), g.astype(np.float16)
  grads = norm(xt, dtypes.half, yt if add else None).gradient(*((xt, yt) if add else (xt,)), gradient=Tensor(g16))
  s = x.astype(np.float64) + (y if add else 0)
  r = 1 / np.sqrt((s ** 2).mean(-1, keepdims=True) + 1e-6)
  ref = r * g16 - s * r ** 3 * (g16 * s).mean(-1, keepdims=True)
  assert grads[0].dtype == dtypes.float32 and rel(grads[0].numpy(), ref) < 1e-5
  if add: assert grads[1].dtype == dtypes.half and rel(grads[1].numpy(), ref) < 2 * U

@GPU
@pytest.mark.parametrize("dtype", [dtypes.half, dtypes.float32])
def test_qk_norm(dtype):
  # d rms(rope(x)): du = r g - u r^3 mean(g u), rotated back by RoPE's transpose; in float32 ~1e-7 relative (1e-5 leaves 100x), in half
  # the result rounded once (u, doubled). A pair rotated the wrong way, or with another position's angles, is off by O(1)
  rng = np.random.default_rng(7)
  npd = np.float16 if dtype == dtypes.half else np.float32
  x, g, ang = rng.normal(size=(2, 128, 3, 64)).astype(npd), rng.normal(size=(2, 128, 3, 64)).astype(npd), rng.uniform(0, 6.3, (128, 1, 32))
  xt = Tensor(x)
  dx = qk_norm(xt, *[Tensor(f(ang).astype(np.float32)) for f in (np.cos, np.sin)], dtype).gradient(xt, gradient=Tensor(g))[0]
  c, sn, x64, g64 = np.cos(ang.astype(np.float32)), np.sin(ang.astype(np.float32)), x.astype(np.float64), g.astype(np.float64)
  a, b = x64[..., :32], x64[..., 32:]
  u = np.concatenate([a * c + b * sn, b * c - a * sn], -1)
  r = 1 / np.sqrt((u ** 2).mean(-1, keepdims=True) + 1e-6)
  du = r * g64 - u * r ** 3 * (g64 * u).mean(-1, keepdims=True)
  ref = np.concatenate([c * du[..., :32] - sn * du[..., 32:], sn * du[..., :32] + c * du[..., 32:]], -1)
  assert dx.dtype == dtype and rel(dx.numpy(), ref) < (2 * U if dtype == dtypes.half else 1e-5)

@GPU
def test_scale():
  # w[2] x: dw is zero but at 2, where it is sum(dy x) over 1,000,000 values in float32 (~1e-6 relative in parts of ~4,000; 1e-5 leaves
  # 10x); a slice of the stream left out of the sum, or the sum put at another index, is off by O(1)
  rng = np.random.default_rng(8)
  w, x, g = rng.normal(size=4).astype(np.float32), rng.normal(size=(1000, 1000)).astype(np.float32), rng.normal(size=(1000, 1000))
  wt, xt = Tensor(w), Tensor(x)
  dw, dx = scale(wt, 2, xt).gradient(wt, xt, gradient=Tensor(g.astype(np.float32)))
  ref = np.zeros(4)
  ref[2] = (g * x).sum()
  assert rel(dw.numpy(), ref) < 1e-5 and rel(dx.numpy(), w[2] * g) < 1e-6

def model_grads(model:GPT, x:Tensor, y:Tensor) -> dict[str, np.ndarray]:
  return {n: t.numpy().astype(np.float64) for n, t in estimators.estimate(model, x, y, "backprop", 1, 0).items()}

@GPU
def test_model_gradient():
  # The small preset's blocks, two of them (windows 128 and 256, value embeddings on block 1), 8 x 256 tokens: each parameter's gradient
  # with the kernels is as close to the float32 gradient as tinygrad's own half precision one (CUDA_KERNELS=0) is, within a factor 2,
  # plus 4u: both round the same activations to half, in other orders. A kernel's gradient missing or counted twice is off by O(1)
  cfg = GPTConfig.preset("small", n_layer=2)
  rng = np.random.default_rng(5)
  x, y = (Tensor(rng.integers(0, cfg.vocab, (8, cfg.seq_len)).astype(np.int32)) for _ in range(2))
  ref = model_grads(GPT(cfg, dtype=dtypes.float32), x, y)
  fast = model_grads(GPT(cfg, dtype=dtypes.half), x, y)
  with Context(CUDA_KERNELS=0): ours = model_grads(GPT(cfg, dtype=dtypes.half), x, y)
  errs = {n: (rel(fast[n], ref[n]), rel(ours[n], ref[n])) for n in ref}
  assert all(e <= 2 * o + 4 * U for e, o in errs.values()), {n: e for n, e in errs.items() if e[0] > 2 * e[1] + 4 * U}

@GPU
def test_sgd_update():
  # SGD with momentum on a Flat gradient, kernels/sgd.py's one kernel against tinygrad's SGD (CUDA_KERNELS=0), three steps of new
  # gradients: parameters of 3, 35, 2,048 and 3,000 values (offsets by 3, a block's 1,024 values and a part of one), two lr groups.
  # Both compute b = mu b + g and theta - lr b in float32, the kernel with fused multiply-adds: within a few float32 roundings. A value
  # read from another parameter's part, a block given to the wrong parameter, the momentum not kept, or the other group's lr is off
  # by O(lr)
  rng = np.random.default_rng(9)
  shapes = {"a": (3,), "b": (5, 7), "c": (64, 32), "d": (3000,)}
  init = {n: rng.normal(size=s).astype(np.float32) for n, s in shapes.items()}
  gs = [rng.normal(size=sum(int(np.prod(s)) for s in shapes.values())).astype(np.float32) for _ in range(3)]
  def run() -> dict[str, np.ndarray]:
    params = {n: Tensor(v).realize() for n, v in init.items()}
    opt = optim.Optimizer(params, {"a": 0.1, "b": 0.1, "c": 0.02, "d": 0.1}, "sgd", 0.9, 0)
    for g in gs: opt.step(estimators.Flat(Tensor(g).realize()))
    return {n: p.numpy() for n, p in params.items()}
  fast = run()
  with Context(CUDA_KERNELS=0): ref = run()
  for n in shapes: np.testing.assert_allclose(fast[n], ref[n], rtol=1e-6, atol=1e-6)
