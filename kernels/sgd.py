"""SGD with momentum, b <- mu b + g and theta <- theta - lr b, on NVIDIA GPUs as one CUDA kernel for every parameter, which writes each b
and theta in place. tinygrad writes the two assignments as two kernels a parameter, each in blocks of 32 threads, which on the H200
run far below the memory's rate (kernels/jitter.py): backprop's update took 1.6-1.9 ms at the dust preset, 0.4-0.5 ms as one kernel a
parameter, 0.23 ms as this one (H200). One launch for all of them: at the small preset a launch costs more than the arithmetic of a
parameter. The gradient comes as zo.Flat's one buffer, read at each parameter's offset.
"""
import itertools
from tinygrad import Tensor, dtypes
from kernels import cuda_kernels
from kernels.cuda import program

SOURCE = r"""
// 1,024 values of one parameter a block, 4 a thread, 256 apart: each load of a warp is 128 contiguous bytes
__device__ __forceinline__ void sgd(float *p, float *b, const float *g, float lr, size_t n, size_t block) {{
  #pragma unroll
  for (int j = 0; j < 4; j++) {{
    const size_t i = block * 1024 + j * 256 + threadIdx.x;
    if (i < n) {{ const float m = {MU}f * b[i] + g[i]; b[i] = m; p[i] -= lr * m; }}
  }}
}}
extern "C" __global__ void __launch_bounds__(256) {NAME}({ARGS}) {{
  const size_t block = blockIdx.x;  // parameters in order, each on its own blocks: the first whose blocks end past this one
{BRANCHES}
}}
"""

def blocks(n:int) -> int: return (n + 1023) // 1024

def source(name:str, sizes:list[int], offsets:list[int], groups:list[int], mu:float) -> str:
  """The kernel for parameters of these sizes, whose gradients start at these offsets of the Flat, parameter i in lr group groups[i]."""
  args = [f"float *__restrict__ {v}{i}" for v in "PB" for i in range(len(sizes))] + ["const float *__restrict__ G"] + \
         [f"const float *__restrict__ LR{j}" for j in range(max(groups) + 1)]
  starts = [0, *itertools.accumulate(blocks(n) for n in sizes)]
  branches = [f"  {'else ' if i else ''}if (block < {starts[i + 1]}) sgd(P{i}, B{i}, G + {a}, *LR{j}, {n}, block - {starts[i]});"
              for i, (n, a, j) in enumerate(zip(sizes, offsets, groups))]
  return SOURCE.format(NAME=name, MU=repr(float(mu)), ARGS=", ".join(args), BRANCHES="\n".join(branches))

def fits(theta:Tensor, buf:Tensor) -> bool: return cuda_kernels(theta.device) and theta.dtype == buf.dtype == dtypes.float32

def step(thetas:tuple[Tensor, ...], bs:tuple[Tensor, ...], buf:Tensor, offsets:list[int], lrs:tuple[Tensor, ...], mu:float) -> list[Tensor]:
  """The thetas, then the bs, after one step on their gradients buf[offset : offset + theta.numel()] (float32, all of them), each with
  its lr, as one kernel."""
  groups = {id(lr): lr for lr in lrs}
  sizes, group = [t.numel() for t in thetas], [list(groups).index(id(lr)) for lr in lrs]
  n, D = len(thetas), sum(sizes)
  name = f"sgd_{n}_{D}"
  fxn = program(thetas[0].device, name, source(name, sizes, offsets, group, mu), (sum(blocks(s) for s in sizes),), 256,
                2 * n + 1 + len(groups), 3 * D, 20 * D, outs=2 * n)
  return list(thetas[0].custom_kernel(*thetas[1:], *bs, buf, *groups.values(), fxn=fxn)[:2 * n])
