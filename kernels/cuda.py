"""CUDA C kernels inside tinygrad: the pieces that the kernels of kernels/ (matmul, flash, loss, norm, ...) share.

A kernel reaches tinygrad as a PROGRAM whose source is CUDA C: tinygrad compiles it with NVRTC, and its scheduler, JIT and memory
planner treat it as one of its own kernels. Where they run is kernels/__init__.py's table (an NVIDIA GPU of sm_80 or later: cp.async,
and mma.sync at 16x8x16 with half inputs and float accumulation). Each has a gradient, a grad_fxn made of kernels too (`operands` hands
it the kernel's buffers), so backprop, the reference baseline, runs on them.
"""
from tinygrad import Device, Tensor
from tinygrad.renderer import Estimates
from tinygrad.uop.ops import KernelInfo, Ops, ProgramInfo, UOp

# one warp's tensor-core primitives. A 16x16 half tile of A, or two 8-column tiles of B stored [n][k], is 4 8x8 matrices that
# ldmatrix loads, each lane giving the address of one row of one matrix; mma.sync multiplies them, accumulating in float.
PRELUDE = r"""
#include <cuda_fp16.h>
__device__ __forceinline__ unsigned smem(const half *p) { return (unsigned)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void cp_async(half *dst, const half *src) {  // 16 bytes, global -> shared, without passing registers
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"(smem(dst)), "l"(src));
}
__device__ __forceinline__ void commit() { asm volatile("cp.async.commit_group;"); }
template <int n> __device__ __forceinline__ void wait() { asm volatile("cp.async.wait_group %0;" :: "n"(n)); }  // all but n groups landed
__device__ __forceinline__ void ldsm(unsigned (&r)[4], const half *p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];" : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem(p)));
}
__device__ __forceinline__ void ldsm_t(unsigned (&r)[4], const half *p) {  // transposed: B from a tile stored [k][n]
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];" : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem(p)));
}
__device__ __forceinline__ void mma(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {  // d += a (16x16) b (16x8)
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
    : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ unsigned pack(float x, float y) { half2 h = __floats2half2_rn(x, y); return *(unsigned *)&h; }
"""

def program(device:str, name:str, src:str, grid:tuple[int, ...], threads:int, n_bufs:int, flops:int, nbytes:int, outs:int=1):
  """A custom_kernel fxn: buffers 0 .. outs-1 are the outputs, the rest the inputs, in the order of the kernel's parameters. tinygrad
  compiles the source as it compiles its own kernels, with the renderer's compiler (which engine makes emit machine code, for sm_90a
  on Hopper: engine.nvrtc_for)."""
  def fxn(*_bufs:UOp) -> UOp:
    info = ProgramInfo(name, (*grid, *(1,) * (3 - len(grid))), (threads, 1, 1), globals=tuple(range(n_bufs)), outs=tuple(range(outs)),
                       ins=tuple(range(outs, n_bufs)), target=Device[device].renderer.target)
    sink = UOp.sink(arg=KernelInfo(name, estimates=Estimates(ops=flops, lds=nbytes, mem=nbytes)))
    return UOp(Ops.PROGRAM, src=(sink, UOp(Ops.LINEAR, src=()), UOp(Ops.SOURCE, arg=PRELUDE + src)), arg=info)
  return fxn

def operands(call:UOp) -> list[Tensor]:
  """In a grad_fxn, the kernel's buffers as tensors in the order of its parameters: the outputs as the kernel wrote them, then the inputs."""
  outs = call.src[0].arg.outs
  return [Tensor(u.after(call) if i in outs else u) for i, u in enumerate(call.src[1:])]
