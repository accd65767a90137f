"""x @ w.T as one explicit kernel whose optimizations are chosen here, not by tinygrad's heuristic.

tinygrad turns a matmul into a kernel and then optimizes it: tensor cores, upcasts (each thread computes a tile of outputs),
locals. Its hand-coded heuristic upcasts the output tile 4x along each side and adds locals; on the H200, for the linear layers'
shapes (M = 131,072 tokens, N of 512 to 4,096, K of 512 or 2,048, half inputs, float accumulation) that runs at 70-77 TFLOP/s.
A BEAM search (BEAM=2, 35-81 s per kernel shape) found, for three of the shapes, an 8x upcast along N, 4x along M and at most one
2x local, at 102-108 TFLOP/s. Their common part (`OPTS`, no local) runs at 101-109 TFLOP/s on this kernel for all four shapes.
Each layer's kernel would need its own search, and its cache is lost with the machine, so the options are fixed on an explicit
kernel (tinygrad's `custom_kernel`) that any matmul with these dtypes and divisible shapes can use. It reads w in its own dtype
and rounds it to x's inside the loop, as the heuristic's kernel does: the results are the same bits.

The kernel has no gradient: backprop (the reference baseline) differentiates tinygrad's own matmul, under
Context(TUNED_MATMUL=0), which is also how to compare the two (`TUNED_MATMUL=0 python ...`).
"""
from tinygrad import Device, Tensor, UOp, dtypes
from tinygrad.codegen.opt import Opt, OptOps
from tinygrad.helpers import ContextVar
from tinygrad.uop.ops import AxisType, KernelInfo, Ops

TUNED_MATMUL = ContextVar("TUNED_MATMUL", 1)
# tensor cores on the first (N, M) pair of axes, then upcast N by 4, M by 4 and N by 2 again (the heuristic: N by 4, M by 4, locals)
OPTS = (Opt(OptOps.TC, 0, (-1, 0, 1)), Opt(OptOps.UPCAST, 1, 4), Opt(OptOps.UPCAST, 0, 4), Opt(OptOps.UPCAST, 1, 2))
TILE = (128, 64, 16)  # M, N, K that OPTS need to divide: the tensor core's 16x8x16 times the upcasts, and M twice that (at M = 64
# the M axis is used up, and the next UPCAST lands on the tensor core's own axis: KernelOptError)

def gemm(opts:tuple[Opt, ...]|None):
  """The kernel C[i, j] = sum_k A[i, k] B[j, k] with float accumulation; opts None leaves it to the device's heuristic."""
  def kernel(C:UOp, A:UOp, B:UOp) -> UOp:
    (M, N), K = C.shape, A.shape[1]
    k, i, j = UOp.range(K, 0, AxisType.REDUCE), UOp.range(M, 1), UOp.range(N, 2)
    acc = (A[i, k] * B[j, k].cast(A.dtype)).cast(dtypes.float).reduce(k, arg=Ops.ADD)
    return C[i, j].store(acc.cast(C.dtype)).end(i, j).sink(arg=KernelInfo(name=f"gemm_{M}_{N}_{K}", opts_to_apply=opts))
  return kernel

def matmul(x:Tensor, w:Tensor, opts:tuple[Opt, ...]|None=OPTS) -> Tensor:
  """x [M, K] @ w [N, K].T in x's dtype, as one kernel with these optimizations."""
  out = Tensor.empty(x.shape[0], w.shape[0], dtype=x.dtype, device=x.device)
  return out.custom_kernel(x.contiguous(), w.contiguous(), fxn=gemm(opts))[0]

def tuned(x:Tensor, w:Tensor) -> bool:
  """Whether OPTS apply: half inputs on a device with the 16x8x16 half tensor core (NVIDIA sm_80+), and shapes they divide."""
  tcs = getattr(Device[x.device].renderer, "tensor_cores", [])
  has_tc = any(tc.dims == (8, 16, 16) and tc.dtype_in == dtypes.half and tc.dtype_out == dtypes.float for tc in tcs)
  return bool(TUNED_MATMUL) and has_tc and x.dtype == dtypes.half and all(s % t == 0 for s, t in zip((x.numel() // x.shape[-1], *w.shape), TILE))

def linear(x:Tensor, w:Tensor) -> Tensor:
  """x @ w.T in x's dtype, x [..., K], w [N, K] in any float dtype (the float32 master weights)."""
  if not tuned(x, w): return x @ w.cast(x.dtype).T
  return matmul(x.reshape(-1, x.shape[-1]), w).reshape(*x.shape[:-1], w.shape[0])
