"""A population of perturbed weights evaluated in one batched forward: member m owns batch rows [m*B, (m+1)*B).

Member m's weight is W_m = W + c E_m, with one signed scale c for the whole forward (an antithetic pair is two forwards, c = +sigma
then -sigma, so only one sign's activations are ever live). E_m is a full-rank Gaussian Z_m, or EGGROLL's rank-r product
A_m B_m^T / sqrt(r) (A_m, B_m Gaussian). The directions come from the members' keys.

Every member's W_m is formed once per forward, whatever the rank. A member owns a whole batch (thousands of tokens), so forming
its weight costs about 1/tokens of its matmul, which then runs on the dense GEMM. EGGROLL's way, x W^T + c/sqrt(r) (x B_m) A_m^T,
never forms W_m, but its thin matmuls and the extra pass over every layer's output made a rank-1 ES step at pop 256 2.4x (small
preset) and 3.1x (dust preset) slower on the H200 (docs/performance.md); it pays where members have a few tokens each, not here.
"""
import math
from tinygrad import Tensor, dtypes
from tinygrad.dtype import DType
from kernels.matmul import linear
from kernels.noise import fold, gaussian

def direction(keys:Tensor, shape:tuple[int, ...], rank:int) -> Tensor|tuple[Tensor, Tensor]:
  """E_j for each key j: Z_j [N, *shape], or the factors (A [N, out, r], B [N, in, r]) of a matrix when rank > 0."""
  if rank == 0 or len(shape) != 2: return gaussian(keys, shape)
  return gaussian(fold(keys, 0), (shape[0], rank)), gaussian(fold(keys, 1), (shape[1], rank))

# tinygrad 0.14's kernel heuristic unrolls a reduce axis of at most 32 in full, so a sum over 9..32 keys puts that many copies of the
# generator (times its upcast) into one kernel: 8.7 s to compile at 16 keys and 22 s at 32 against 0.8 s at 33, which it leaves a loop
# (one [3072, 768] sum, NULL device with the CUDA renderer). Such a sum gets keys of coefficient 0 up to 33, at most 3.7x its noise.
UNROLLED = 32

def combine(keys:Tensor, coef:Tensor, shape:tuple[int, ...], rank:int) -> Tensor:
  """sum_j coef_j E_j, regenerated from the keys: the dense form of a compact estimate [(key_j, coef_j)]."""
  if (rank == 0 or len(shape) != 2) and 8 < (n := keys.shape[0]) <= UNROLLED:
    keys, coef = keys.pad(((0, UNROLLED + 1 - n), (0, 0))), coef.pad((0, UNROLLED + 1 - n))
  e = direction(keys, shape, rank)
  if isinstance(e, Tensor): return (coef.reshape(-1, *[1] * len(shape)) * e).sum(0)
  a, b = e
  n, r = a.shape[0], a.shape[2]
  return ((a * coef.reshape(n, 1, 1)).permute(1, 0, 2).reshape(shape[0], n * r) @ b.permute(1, 0, 2).reshape(shape[1], n * r).T) / math.sqrt(r)

class Population:
  def __init__(self, w:Tensor, keys:Tensor, c:float|Tensor, rank:int=0):
    self.w, self.c, self.M = w, c, keys.shape[0]
    e = direction(keys, w.shape, rank)
    self.e = e if isinstance(e, Tensor) else e[0] @ e[1].transpose(-1, -2) / math.sqrt(rank)  # E_m [M, *shape], formed

  def dense(self, dtype:DType) -> Tensor:
    """Every member's full weight [M, *shape], materialized once per forward: as [M, numel], so that weights of one size
    (the MLP's [4d, d] and [d, 4d]) share one compiled kernel."""
    M = self.M
    return (self.w.reshape(-1) + self.c * self.e.reshape(M, -1)).cast(dtype).contiguous().reshape(M, *self.w.shape)

  def linear(self, x:Tensor, dtype:DType, act:str|None=None) -> Tensor:  # act(x) @ W_m^T, member by member along the rows
    return linear(x, self.dense(dtype), act)

  def embed(self, idx:Tensor, dtype:DType) -> Tensor:  # member m's rows idx of W_m, from the stacked [M * V, d] weights
    V, d = self.w.shape
    offs = (Tensor.arange(idx.shape[0]) // (idx.shape[0] // self.M) * V).reshape(-1, 1).cast(dtypes.int32)
    return self.dense(dtype).reshape(self.M * V, d)[idx + offs]

  def scale(self, i:int, x:Tensor) -> Tensor: return per_member(self.dense(dtypes.float32)[:, i], x)  # a residual-mix scalar per member

def per_member(v:Tensor, x:Tensor) -> Tensor:
  """v [M] times x [M*R, ...]: member m's value times its rows."""
  M = v.shape[0]
  return v.reshape(M, 1).expand(M, x.shape[0] // M).reshape(x.shape[0], *[1] * (x.ndim - 1)) * x
