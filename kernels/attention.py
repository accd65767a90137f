"""Causal windowed attention with QK-norm, in tensor ops: no max pass, and only the key blocks that the mask leaves visible.

Query s sees keys t with 0 <= s - t <= window. The usual softmax(s) = exp(s - max) / sum exp(s - max) subtracts the row max so
that exp can't overflow. Under QK-norm it can't anyway: q and k have unit RMS, so |q.k| <= |q| |k| = hd and every score
q.k / sqrt(hd) lies in [-sqrt(hd), sqrt(hd)], 8 at hd = 64, where exp stays within half precision's range. So the weights
w = exp(score) are final as soon as the scores are, and the attention is y = (w v) / (w 1): one kernel makes w (the scores matmul,
with exp and the mask in its epilogue), one sums it, one multiplies it into v and divides. The T x T matrix is written once,
in the model's dtype, and read twice; a max-subtracting softmax writes float32 scores and reads them three times.

Rows are taken in blocks of BLOCK queries, and each block multiplies only the keys it can see, [s0 - window, s1): at 2048 tokens
about half of the T x T products for a full causal window, less for a window of half the context. Tensor ops can't keep w out of
memory, so w of one block is written and read back; on NVIDIA GPUs `attention` is kernels/flash.py's kernel instead, which doesn't.
q, k and v come in as the projections lay them out, [B, T, H, hd]: the CUDA kernel reads them so, the tensor ops take heads first.

Dust's attention draws (dust.py) change one attention many times: `prepare` makes what they read once, and `moved` (q or k moved)
and `mixed` (the values moved) give every draw's change of the output at once, on the CUDA kernels or in tensor ops.
"""
import math
from tinygrad import Tensor, dtypes
from tinygrad.dtype import DType
from kernels.flash import delta, fits, flash
import engine

BLOCK = 256  # queries per block
SCORES = 1 << 28  # bytes of float32 scores that Dust's q and k draws may hold at once on tinygrad's kernels (moved)

def weights(q:Tensor, k:Tensor, s0:int, t0:int, window:int, dtype:DType) -> Tensor:
  """w[s, t] = exp(q_s.k_t / sqrt(hd)) for the queries s0 + i and keys t0 + j that the mask lets through, else 0, in `dtype`.
  q, k: [B, H, n, hd] unit-RMS rows. The scores accumulate in float32 whatever the dtype, as flash attention does."""
  hd = q.shape[-1]
  # in half, w and the products w v (rounded to half on CUDA before they are summed in float32) must fit under 65504: w is capped at
  # e^8 ~ 2981, the bound at hd = 64, which leaves |v| up to 22. A wider head shifts every score down, which the division by w 1 cancels
  shift = max(0.0, math.sqrt(hd) - 8)
  scores = q.matmul(k.transpose(-1, -2), dtype=dtypes.float32) / math.sqrt(hd) - shift
  lag = (Tensor.arange(q.shape[2]) + s0).reshape(-1, 1) - (Tensor.arange(k.shape[2]) + t0).reshape(1, -1)
  return ((lag >= 0) & (lag <= window)).where(scores.exp(), 0).cast(dtype).contiguous()  # contiguous: the two readers don't redo the matmul

def spans(T:int, window:int, block:int=BLOCK) -> list[tuple[int, int, int]]:
  """(s0, s1, t0) for each block of queries s0..s1-1: the keys they can see are t0..s1-1."""
  return [(s0, min(T, s0 + block), max(0, s0 - window)) for s0 in range(0, T, block)]

def probs(q:Tensor, k:Tensor, window:int, dtype:DType, block:int=BLOCK) -> list[Tensor]:
  """The attention probabilities by block of queries (spans), [B, H, s1 - s0, s1 - t0] each, normalized in float32 and kept in
  `dtype`, to be applied to many value changes (mix). q, k: [B, T, H, hd], unit RMS."""
  q, k = [t.transpose(1, 2).float().contiguous() for t in (q, k)]
  def rows(s0:int, s1:int, t0:int) -> Tensor:
    w = weights(q[:, :, s0:s1], k[:, :, t0:s1], s0, t0, window, dtypes.float32)
    return (w / w.sum(-1, keepdim=True)).cast(dtype).contiguous()
  return [rows(*s) for s in spans(q.shape[2], window, block)]

def mix(p:list[Tensor], v:Tensor, window:int, block:int=BLOCK) -> Tensor:
  """p v for probabilities by block (probs) and values v [B', T, H, hd], B' a multiple of p's batch -> [B', T, H, hd] float32."""
  n = v.shape[0] // p[0].shape[0]
  v = v.transpose(1, 2).cast(p[0].dtype).contiguous()  # heads first, made once (with whatever v is computed from): every block reads it
  def rows(pb:Tensor, s0:int, s1:int, t0:int) -> Tensor:
    return pb.repeat(n, 1, 1, 1).matmul(v[:, :, t0:s1], dtype=dtypes.float32).contiguous()
  return Tensor.cat(*[rows(pb, *s) for pb, s in zip(p, spans(v.shape[2], window, block))], dim=2).transpose(1, 2)

def attention(q:Tensor, k:Tensor, v:Tensor, window:int, block:int=BLOCK) -> Tensor:
  """softmax(q k^T / sqrt(hd) + mask) v, q, k, v: [B, T, H, hd] (as the projections lay them out) with q, k of unit RMS -> [B, T, H, hd]
  in v's dtype. q and k are read in v's dtype (tensor cores in half), the weights are kept in it, the sums are float32."""
  q, k = q.cast(v.dtype), k.cast(v.dtype)
  if fits(q, v): return flash(q, k, v, window)  # one CUDA kernel on NVIDIA GPUs (kernels/flash.py), no copy needed
  # materialized heads-first: a matmul that reads its operands through RoPE, the norm and the transposes recomputes them for every
  # output element (17 ms instead of ~2 ms per layer on the H200 at 8x2048 tokens)
  q, k, v = [t.transpose(1, 2).contiguous() for t in (q, k, v)]
  def rows(s0:int, s1:int, t0:int) -> Tensor:  # contiguous: else the concatenation fuses every block's matmul into one kernel
    w = weights(q[:, :, s0:s1], k[:, :, t0:s1], s0, t0, window, v.dtype)
    return (w.matmul(v[:, :, t0:s1], dtype=dtypes.float32) / w.float().sum(-1, keepdim=True)).cast(v.dtype).contiguous()
  return Tensor.cat(*[rows(*s) for s in spans(q.shape[2], window, block)], dim=2).transpose(1, 2).contiguous()  # tokens first again

# ***** one attention changed by many draws (Dust's attention internals) *****

def prepare(qh:Tensor, kh:Tensor, u:Tensor, window:int, dtype:DType) -> dict[str, Tensor]:
  """What `moved` and `mixed` read, made once from the clean attention's q^, k^ (RoPE'd and normed) and values u [B, T, H, hd] in
  float32: on NVIDIA GPUs half copies of the three, which kernels/flash.py's kernels read (they remake the probabilities, so none are
  kept); elsewhere the clean output o and the probabilities p by block of queries, kept in `dtype`."""
  if fits(qh.half(), u.half()): return {"qh16": qh.half(), "kh16": kh.half(), "u16": u.half()}
  return {"o": attention(qh, kh, u, window)} | {f"p{j}": p for j, p in enumerate(probs(qh, kh, window, dtype))}

def moved(prep:dict[str, Tensor], qh:Tensor, kh:Tensor, u:Tensor, new:Tensor, moving:str, window:int) -> Tensor:
  """o' - o in float32 for n draws at once, when q^ (moving "q") or k^ ("k") becomes `new` [n B, T, H, hd] (float32). On NVIDIA GPUs
  one kernel for all draws (flash.delta) makes it from the change of q^ or k^ itself, taken in float32 (both are ~1, the change ~σ)
  and then rounded to half. Elsewhere the whole attention again, in float32 (half measured slower), in groups of draws whose scores
  fit SCORES, each group realized, so that the scheduler can't order all draws' scores first: all n at once held n sets of T x T
  scores (at pop 1024 on the dust preset, 8.6 GB, the peak of the whole update), where a JIT's memory plan reuses one group's for
  the next. Where they are small, as on the CPU's models, one group is one graph for tinygrad to schedule instead of n."""
  n, old = new.shape[0] // u.shape[0], qh if moving == "q" else kh
  if "u16" in prep: return delta(prep["qh16"], prep["kh16"], prep["u16"], (new - old.repeat(n, 1, 1, 1)).half(), moving, window)
  B, T, H, _ = u.shape
  m = engine.per_call(n, B * H * T * T * 4, SCORES)  # draws a group: the most that divide n and whose float32 scores fit
  def rerun(d:Tensor) -> Tensor:
    def each(t:Tensor) -> Tensor: return t.repeat(m, 1, 1, 1)
    return attention(d if moving == "q" else each(qh), d if moving == "k" else each(kh), each(u), window) - each(prep["o"])
  return Tensor.cat(*[rerun(d).realize() for d in new.chunk(n // m)])

def mixed(prep:dict[str, Tensor], du:Tensor, window:int) -> Tensor:
  """p du in float32 [n B, T, H, hd]: the change of the output when the values move by du, exact by linearity. On NVIDIA GPUs the flash
  kernel (p remade from q^ and k^ where it is used); elsewhere the kept probabilities, reused by every draw (mix materializes du, so
  its noise is made once and not inside the matmul's loop)."""
  if "u16" in prep: return flash(prep["qh16"], prep["kh16"], du.half(), window)
  return mix([prep[f"p{j}"] for j in range(len(spans(du.shape[1], window)))], du, window)
