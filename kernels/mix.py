"""One scalar of a vector times a tensor, w[i] x: the GPT's residual mix (docs/dust.md §1), and on NVIDIA GPUs its gradient for w as a CUDA
kernel. tinygrad differentiates it as one sum of dy x over the whole stream, which it ran in blocks of 16 threads: the 16 scalars took
2.6 ms of a dust-preset backprop step (H200). DOT gives each of BLOCKS blocks of 256 threads a slice of the stream, and tinygrad adds
their sums.
"""
import functools
from typing import Callable
from tinygrad import Tensor, dtypes
from tinygrad.uop.ops import UOp
from kernels import cuda_kernels
from kernels.cuda import program

DOT = r"""
#define N {N}
extern "C" __global__ void __launch_bounds__(256) {NAME}(float *__restrict__ P, const float *__restrict__ G, const float *__restrict__ X) {{
  __shared__ float warps[8];
  const int tid = threadIdx.x;
  float s = 0.f;
  for (size_t i = ((size_t)blockIdx.x * 256 + tid) * 4; i < N; i += (size_t)gridDim.x * 1024) {{  // 16 bytes of each a thread a step
    const float4 g = *(const float4 *)(G + i), x = *(const float4 *)(X + i);
    s += g.x * x.x + g.y * x.y + g.z * x.z + g.w * x.w;
  }}
  for (int o = 16; o; o >>= 1) s += __shfl_xor_sync(0xffffffff, s, o);
  if ((tid & 31) == 0) warps[tid >> 5] = s;
  __syncthreads();
  if (tid == 0) {{ float t = 0.f; for (int w = 0; w < 8; w++) t += warps[w]; P[blockIdx.x] = t; }}
}}
"""
BLOCKS = 264  # two per SM of an H200

def scale(w:Tensor, i:int, x:Tensor) -> Tensor:
  """w[i] * x. Where DOT runs (x float32, of a size by 4, on an NVIDIA GPU) inside a function whose gradient for w is DOT's."""
  if not (cuda_kernels(x.device) and x.dtype == dtypes.float32 and x.numel() % 4 == 0): return w[i] * x
  return w.call(x, fxn=w.as_param(0)[i] * x.as_param(1), grad_fxn=grad(i))

@functools.cache
def grad(i:int) -> Callable:
  """scale's grad_fxn for index i: dw = one-hot(i) sum(dy x), the sum from DOT; dx = w[i] dy, which tinygrad fuses into the stream's
  other gradients (DOT writing it too measured no faster: docs/performance.md)."""
  def fxn(dy:UOp, call:UOp) -> tuple[UOp|None, ...]:
    w, x, g = Tensor(call.src[1]), Tensor(call.src[2]), Tensor(dy).float()
    N, name = x.numel(), f"dot_{x.numel()}"
    fxn = program(x.device, name, DOT.format(NAME=name, N=N), (BLOCKS,), 256, 3, 2 * N, 8 * N)
    total = Tensor.empty(BLOCKS, device=x.device).custom_kernel(g.reshape(N), x.reshape(N), fxn=fxn)[0].sum()
    return total.reshape(1).pad(((i, w.shape[0] - i - 1),)).uop, (w[i] * g).uop
  return fxn
