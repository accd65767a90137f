"""The per-token loss of the softcapped logits, cross_entropy(cap tanh(z / cap), y): in tensor ops, or as one CUDA kernel, a warp per token.

In tensor ops the loss reads the [tokens, vocab] logits in several reductions (the max, the exp-sum, the target's logit), and on the
H200 tinygrad's kernels for them ran at ~230 GB/s: 6.1 ms per Dust chunk (131,072 tokens x 4,096 logits, 1 GB in half), more than
its flash attention. Here the logits are read once, 16 bytes a lane: every softcapped logit c lies in (-cap, cap), so sum exp(c) needs
no max subtracted first (at cap 15 and 4,096 logits it stays under 2^34) and no lane keeps its values, which leaves registers for
many warps in flight.

Its gradient (GRAD, for backprop) is one more pass of the same shape: with c = cap tanh(z / cap) and lse = L + c_y,
dL/dz_j = (exp(c_j - lse) - [j = y]) (1 - (c_j / cap)^2).
"""
import functools, math
from typing import Callable
from tinygrad import Tensor, dtypes
from tinygrad.uop.ops import UOp
from kernels import cuda_kernels, writes_exps
from kernels.cuda import operands, program

SOURCE = r"""
#define V {V}
__device__ __forceinline__ float softcap(float z) {{ return {CAP}f * tanhf(z / {CAP}f); }}

extern "C" __global__ void __launch_bounds__(256) {NAME}(float *__restrict__ L, const half *__restrict__ Z, const int *__restrict__ Y) {{
  const int lane = threadIdx.x & 31, row = blockIdx.x * 8 + (threadIdx.x >> 5);
  const half *z = Z + (size_t)row * V;
  float s = 0.f;
  #pragma unroll 4
  for (int i = 0; i < V / 256; i++) {{  // 16 bytes a lane, 512 a warp, coalesced
    const uint4 u = *(const uint4 *)(z + i * 256 + lane * 8);
    #pragma unroll
    for (int j = 0; j < 4; j++) {{
      const float2 f = __half22float2(((const half2 *)&u)[j]);
      s += __expf(softcap(f.x)) + __expf(softcap(f.y));
    }}
  }}
  for (int o = 16; o; o >>= 1) s += __shfl_xor_sync(0xffffffff, s, o);
  if (lane == 0) L[row] = logf(s) - softcap(__half2float(z[Y[row]]));
}}
"""

GRAD = r"""
#define V {V}
__device__ __forceinline__ float softcap(float z) {{ return {CAP}f * tanhf(z / {CAP}f); }}

extern "C" __global__ void __launch_bounds__(256) {NAME}(half *__restrict__ DZ, const half *__restrict__ Z, const int *__restrict__ Y,
                                                          const float *__restrict__ L, const float *__restrict__ G) {{
  const int lane = threadIdx.x & 31, row = blockIdx.x * 8 + (threadIdx.x >> 5), y = Y[row];
  const half *z = Z + (size_t)row * V;
  const float lse = L[row] + softcap(__half2float(z[y])), g = G[row];
  #pragma unroll 4
  for (int i = 0; i < V / 256; i++) {{
    const int j0 = i * 256 + lane * 8;
    const uint4 u = *(const uint4 *)(z + j0);
    uint4 out;
    #pragma unroll
    for (int e = 0; e < 4; e++) {{
      const float2 f = __half22float2(((const half2 *)&u)[e]);
      const float c0 = softcap(f.x), c1 = softcap(f.y);
      ((unsigned *)&out)[e] = pack(g * (__expf(c0 - lse) - (j0 + 2 * e == y)) * (1.f - c0 * c0 / ({CAP}f * {CAP}f)),
                                   g * (__expf(c1 - lse) - (j0 + 2 * e + 1 == y)) * (1.f - c1 * c1 / ({CAP}f * {CAP}f)));
    }}
    *(uint4 *)(DZ + (size_t)row * V + j0) = out;
  }}
}}
"""

def softcap(t:Tensor, cap:float) -> Tensor: return cap * (t / cap).tanh()  # smoothly into (-cap, cap)

def exp_sum(c:Tensor) -> Tensor:
  """sum exp(c) over the last axis. On the CPU the exps are written, then summed (kernels/__init__.py's table): the loss of 4,096
  tokens at vocab 32 took 3.9 ms written, 8.6 ms fused (2 cores)."""
  e = c.exp()
  return (e.contiguous() if writes_exps(c.device) else e).sum(-1)

def cross_entropy(z:Tensor, y:Tensor, cap:float) -> Tensor:
  """The loss of each token, float32 [...], of the logits z [..., V] soft-capped at `cap`, for the targets y [...]: one kernel where
  `fits` (kernels/__init__.py's table), else tensor ops."""
  if fits(z, cap): return softcapped_loss(z, y, cap)
  c = softcap(z.float(), cap)
  # contiguous: a consumer that sums the losses would otherwise fuse the vocab reductions into its own (8.5 s, not 1 ms, on the H200)
  top = c.max(-1, keepdim=True).detach()  # logsumexp's max (detached, as there), though |c| <= cap: the float32 rounding of the pins
  return (exp_sum(c - top).log() + top.squeeze(-1) - c.gather(-1, y.unsqueeze(-1)).squeeze(-1)).contiguous()

def fits(z:Tensor, cap:float) -> bool:
  """z [..., V]: half on a GPU that runs kernels/cuda.py's kernels, V a multiple of 256, rows by 8 (warps), and V e^cap, the largest
  exp sum, well inside float32."""
  V = z.shape[-1]
  return cuda_kernels(z.device) and z.dtype == dtypes.half and V % 256 == 0 and (z.numel() // V) % 8 == 0 and cap + math.log(V) < 80

def softcapped_loss(z:Tensor, y:Tensor, cap:float) -> Tensor:
  """The loss of each token, logits z [..., V] and targets y [...] -> float32 [...]."""
  V, R = z.shape[-1], z.numel() // z.shape[-1]
  name = f"loss_{R}_{V}"
  fxn = program(z.device, name, SOURCE.format(NAME=name, V=V, CAP=repr(float(cap))), (R // 8,), 256, 3, 8 * R * V, 2 * R * V + 8 * R)
  out = Tensor.empty(R, dtype=dtypes.float32, device=z.device)
  return out.custom_kernel(z.reshape(R, V), y.reshape(R).cast(dtypes.int32), fxn=fxn, grad_fxn=grad(cap))[0].reshape(y.shape)

@functools.cache
def grad(cap:float) -> Callable:
  """softcapped_loss's grad_fxn: dL/dz in half (GRAD), none for the targets."""
  def fxn(dl:UOp, call:UOp) -> tuple[UOp|None, ...]:
    loss, z, y = operands(call)
    (R, V), name = z.shape, f"loss_grad_{z.shape[0]}_{z.shape[1]}"
    fxn = program(z.device, name, GRAD.format(NAME=name, V=V, CAP=repr(float(cap))), (R // 8,), 256, 5, 12 * R * V, 4 * R * V + 12 * R)
    return None, Tensor.empty(R, V, dtype=dtypes.half, device=z.device).custom_kernel(z, y, loss, Tensor(dl).float(), fxn=fxn)[0].uop, None
  return fxn
