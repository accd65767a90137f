"""A population of perturbed weights evaluated in one batched forward: member m owns batch rows [m*B, (m+1)*B).

Members come in antithetic pairs: 2j and 2j+1 use the same direction E_j with opposite signs, W_m = W + s_m sigma E_j,
s_m = +1, -1. E_j is a full-rank Gaussian Z_j, or EGGROLL's rank-r product A_j B_j^T / sqrt(r) (A_j, B_j Gaussian),
which the forward never forms: x W_m^T = x W^T + s_m sigma/sqrt(r) (x B_j) A_j^T. The directions come from the pair keys.
"""
import math
from tinygrad import Tensor, dtypes
from tinygrad.dtype import DType
from kernels.noise import fold, gaussian

def direction(keys:Tensor, shape:tuple[int, ...], rank:int) -> Tensor|tuple[Tensor, Tensor]:
  """E_j for each key j: Z_j [N, *shape], or the factors (A [N, out, r], B [N, in, r]) of a matrix when rank > 0."""
  if rank == 0 or len(shape) != 2: return gaussian(keys, shape)
  return gaussian(fold(keys, 0), (shape[0], rank)), gaussian(fold(keys, 1), (shape[1], rank))

def combine(keys:Tensor, coef:Tensor, shape:tuple[int, ...], rank:int) -> Tensor:
  """sum_j coef_j E_j, regenerated from the keys: the dense form of a compact estimate [(key_j, coef_j)]."""
  e = direction(keys, shape, rank)
  if isinstance(e, Tensor): return (coef.reshape(-1, *[1] * len(shape)) * e).sum(0)
  a, b = e
  n, r = a.shape[0], a.shape[2]
  return ((a * coef.reshape(n, 1, 1)).permute(1, 0, 2).reshape(shape[0], n * r) @ b.permute(1, 0, 2).reshape(shape[1], n * r).T) / math.sqrt(r)

class Population:
  def __init__(self, w:Tensor, keys:Tensor, sigma:float, rank:int=0):
    self.w, self.sigma, self.M = w, sigma, 2 * keys.shape[0]
    self.rank = rank if w.ndim == 2 else 0
    self.e = direction(keys, w.shape, self.rank)

  def coef(self, rows:int) -> Tensor:  # s_m sigma for each batch row, shape [rows]
    member = Tensor.arange(rows) // (rows // self.M)
    return (1 - 2 * (member % 2)).float() * self.sigma

  def pairs(self, t:Tensor) -> Tensor: return t.unsqueeze(1).expand(t.shape[0], 2, *t.shape[1:]).reshape(self.M, *t.shape[1:])

  def dense(self, dtype:DType) -> Tensor:  # every member's full weight [M, *shape], materialized once per forward
    s = self.coef(self.M).reshape(self.M, *[1] * self.w.ndim)
    return (self.w + s * self.pairs(self.e)).cast(dtype).contiguous()

  def rows(self, t:Tensor, x:Tensor) -> Tensor: return t.reshape(self.M, -1, *t.shape[1:]).reshape(x.shape[0], *t.shape[1:])

  def linear(self, x:Tensor, dtype:DType) -> Tensor:
    xm = x.reshape(self.M, -1, x.shape[-1])
    if self.rank == 0: return (xm @ self.dense(dtype).transpose(-1, -2)).reshape(*x.shape[:-1], self.w.shape[0])
    a, b = (self.pairs(f).cast(dtype) for f in self.e)
    low = (xm @ b) @ a.transpose(-1, -2) * (self.coef(self.M) / math.sqrt(self.rank)).reshape(self.M, 1, 1).cast(dtype)
    return x @ self.w.cast(dtype).T + low.reshape(*x.shape[:-1], self.w.shape[0])

  def embed(self, idx:Tensor, dtype:DType) -> Tensor:  # row lookup; (W + c A B^T)[idx] = W[idx] + c A[idx] B^T
    V, d = self.w.shape
    offs = (Tensor.arange(idx.shape[0]) // (idx.shape[0] // self.M) * V).reshape(-1, 1).cast(dtypes.int32)
    if self.rank == 0: return self.dense(dtype).reshape(self.M * V, d)[idx + offs]
    a, b = (self.pairs(f).cast(dtype) for f in self.e)
    ar = a.reshape(self.M * V, self.rank)[idx + offs].reshape(self.M, -1, self.rank)
    low = (ar @ b.transpose(-1, -2)) * (self.coef(self.M) / math.sqrt(self.rank)).reshape(self.M, 1, 1).cast(dtype)
    return self.w.cast(dtype)[idx] + low.reshape(*idx.shape, d)

  def scale(self, i:int, x:Tensor) -> Tensor:  # a residual-mix scalar per member times the stream
    lam = self.dense(dtypes.float32)[:, i]
    return lam.reshape(self.M, 1).expand(self.M, x.shape[0] // self.M).reshape(x.shape[0], *[1] * (x.ndim - 1)) * x
