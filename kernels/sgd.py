"""SGD with momentum, b <- mu b + g and theta <- theta - lr b, on NVIDIA GPUs as one CUDA kernel a parameter that writes b and theta in
place. tinygrad writes the two assignments as two kernels, each in blocks of 32 threads, which on the H200 run far below the memory's
rate (kernels/jitter.py): backprop's update took 1.6-1.9 ms at the dust preset (0.4-0.5 ms so). The gradient comes as zo.Flat's one
buffer, read at the parameter's offset.
"""
from tinygrad import Tensor, dtypes
from kernels.cuda import available, program

SOURCE = r"""
#define N {N}
extern "C" __global__ void __launch_bounds__(256) {NAME}(float *__restrict__ P, float *__restrict__ B, const float *__restrict__ G,
                                                          const float *__restrict__ LR) {{
  const float lr = *LR, *g = G + {OFFSET};
  #pragma unroll
  for (int j = 0; j < 4; j++) {{  // 4 values a thread, 256 apart: each load of a warp is 128 contiguous bytes
    const size_t i = (size_t)blockIdx.x * 1024 + j * 256 + threadIdx.x;
    if (i < N) {{ const float b = {MU}f * B[i] + g[i]; B[i] = b; P[i] -= lr * b; }}
  }}
}}
"""

def fits(theta:Tensor, buf:Tensor) -> bool: return available(theta.device) and theta.dtype == buf.dtype == dtypes.float32

def step(theta:Tensor, b:Tensor, buf:Tensor, offset:int, lr:Tensor, mu:float) -> tuple[Tensor, Tensor]:
  """theta and b after one step on the gradient buf[offset : offset + theta.numel()] (float32, all three), as one kernel."""
  n = theta.numel()
  name = f"sgd_{n}_{offset}"
  fxn = program(theta.device, name, SOURCE.format(NAME=name, N=n, OFFSET=offset, MU=repr(float(mu))), ((n + 1023) // 1024,), 256, 4,
                3 * n, 20 * n, outs=2)
  return tuple(theta.custom_kernel(b, buf, lr, fxn=fxn)[:2])
