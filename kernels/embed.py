"""The embedding lookup w[idx], and on NVIDIA GPUs its gradient as a CUDA kernel.

tinygrad differentiates w[idx] as a one-hot reduction: each of the table's values sums over every token, 34 G multiply-adds for the
dust preset's 4,096 x 512 table at 16,384 tokens. The kernel (GRAD) gives each row v of the table a block that scans the token ids
128 at a time and adds the gradient rows of the tokens equal to v, in token order, so the sum is the same at every run.
"""
from tinygrad import Tensor, dtypes
from tinygrad.dtype import DType
from tinygrad.uop.ops import UOp
from kernels import cuda_kernels
from kernels.cuda import program

GRAD = r"""
#define D {D}  // a row of the table: 128 threads, D / 128 columns each
#define M {M}  // tokens
extern "C" __global__ void __launch_bounds__(128) {NAME}(float *__restrict__ DW, const half *__restrict__ G, const int *__restrict__ I) {{
  __shared__ unsigned hits[4];
  const int v = blockIdx.x, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  float acc[D / 128] = {{}};
  for (int t0 = 0; t0 < M; t0 += 128) {{
    const unsigned hit = __ballot_sync(0xffffffff, I[t0 + tid] == v);  // which of the warp's 32 tokens are v
    if (lane == 0) hits[warp] = hit;
    __syncthreads();
    for (int w = 0; w < 4; w++)
      for (unsigned h = hits[w]; h; h &= h - 1) {{  // the tokens in order
        const half *g = G + (size_t)(t0 + w * 32 + __ffs(h) - 1) * D;
        #pragma unroll
        for (int j = 0; j < D / 128; j++) acc[j] += __half2float(g[j * 128 + tid]);
      }}
    __syncthreads();  // every thread has read hits before the next tokens' words overwrite them
  }}
  #pragma unroll
  for (int j = 0; j < D / 128; j++) DW[(size_t)v * D + j * 128 + tid] = acc[j];
}}
"""

def grad(dy:UOp, call:UOp) -> tuple[UOp|None, ...]:
  """embedding's grad_fxn: the float32 table's gradient (GRAD), none for the ids."""
  w, idx = call.src[1:]
  (V, D), M = w.shape, idx.numel()
  name = f"embed_grad_{V}_{D}_{M}"
  fxn = program(w.device, name, GRAD.format(NAME=name, D=D, M=M), (V,), 128, 3, M * D, 2 * M * D + 4 * V * M + 4 * V * D)
  g, ids = Tensor(dy).cast(dtypes.half).reshape(M, D), Tensor(idx).reshape(M).cast(dtypes.int32)
  return Tensor.empty(V, D, device=w.device).custom_kernel(g, ids, fxn=fxn)[0].uop, None

def embedding(w:Tensor, idx:Tensor, dtype:DType) -> Tensor:
  """w[idx] in `dtype`. Where GRAD runs (half on an NVIDIA GPU, rows by 128, tokens by 128), the lookup is tinygrad's own inside a
  function whose gradient is GRAD."""
  if not (cuda_kernels(w.device) and dtype == dtypes.half and w.shape[1] % 128 == 0 and idx.numel() % 128 == 0): return w.cast(dtype)[idx]
  return w.call(idx, fxn=w.as_param(0).cast(dtype)[idx.as_param(1)], grad_fxn=grad)
