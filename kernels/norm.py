"""The norms: RMS norm, rotary position embedding (RoPE), and on NVIDIA GPUs CUDA kernels for the two places the GPT uses them.

In tensor ops a norm is two kernels, the sum of squares and then the scaling, each reading the row (and recomputing what it is made of:
RoPE, the residual sum). At a block of a Dust chunk on the H200 (131,072 tokens, ~6 ms a block) the norms of q and k took 0.6 ms and
the two norms of the residual stream ~0.6 ms. The kernels read each row once and keep it in registers:
- qk_norm, RoPE then the QK-norm of a head: four lanes hold its 64 values as the pairs (a, b) that RoPE rotates, in float32;
- norm, the stream's norm (of a sum h + y where the block adds its attention output y), cast to the layers' dtype: a warp per row.
Their gradients (for backprop) are kernels of the same shapes: with u the normed vector (RoPE's output, or h + y), r = 1 / rms(u) and
dy the output's gradient, du = r dy - r^3 u mean(dy u), and for qk_norm dx is du rotated back (RoPE's transpose). tinygrad's autograd
of the tensor ops spent 4.7 ms on them in a dust-preset backprop step (H200), in reductions that read the rows with few threads.
"""
from tinygrad import Tensor, dtypes
from tinygrad.dtype import DType
from tinygrad.uop.ops import UOp
from kernels import cuda_kernels
from kernels.cuda import operands, program

def rms(x:Tensor, eps:float=1e-6) -> Tensor: return x * (x.float().square().mean(-1, keepdim=True) + eps).rsqrt().cast(x.dtype)

def rope(x:Tensor, cos:Tensor, sin:Tensor) -> Tensor:  # x [B, T, H, hd]; rotate the halves (a, b) -> (a cos + b sin, -a sin + b cos)
  a, b = x.chunk(2, dim=-1)
  return (a * cos + b * sin).cat(b * cos - a * sin, dim=-1)

QK_IO = r"""
__device__ __forceinline__ void load(float (&f)[8], const float *p) {{
  const float4 x = *(const float4 *)p, y = *(const float4 *)(p + 4);
  f[0] = x.x; f[1] = x.y; f[2] = x.z; f[3] = x.w; f[4] = y.x; f[5] = y.y; f[6] = y.z; f[7] = y.w;
}}
__device__ __forceinline__ void load(float (&f)[8], const half *p) {{
  const uint4 u = *(const uint4 *)p;
  for (int i = 0; i < 4; i++) {{ const float2 x = __half22float2(((const half2 *)&u)[i]); f[2 * i] = x.x; f[2 * i + 1] = x.y; }}
}}
__device__ __forceinline__ void store(float *p, const float (&f)[8], float r) {{
  *(float4 *)p = make_float4(f[0] * r, f[1] * r, f[2] * r, f[3] * r); *(float4 *)(p + 4) = make_float4(f[4] * r, f[5] * r, f[6] * r, f[7] * r);
}}
__device__ __forceinline__ void store(half *p, const float (&f)[8], float r) {{
  uint4 u;
  for (int i = 0; i < 4; i++) ((unsigned *)&u)[i] = pack(f[2 * i] * r, f[2 * i + 1] * r);
  *(uint4 *)p = u;
}}
"""

QK_SOURCE = QK_IO + r"""
#define T {T}
#define H {H}
// a thread per 8 pairs: lane quarter j of row (token, head) holds a = x[8 j .. 8 j + 7] and b = x[32 + 8 j .. 32 + 8 j + 7]
extern "C" __global__ void __launch_bounds__(256) {NAME}({OUT} *__restrict__ Y, const {IN} *__restrict__ X, const float *__restrict__ C,
                                                          const float *__restrict__ S) {{
  const int row = blockIdx.x * 64 + (threadIdx.x >> 2), j = threadIdx.x & 3, t = row / H % T;
  float a[8], b[8], c[8], s[8], ss = 0.f;
  load(a, X + (size_t)row * 64 + 8 * j); load(b, X + (size_t)row * 64 + 32 + 8 * j); load(c, C + t * 32 + 8 * j); load(s, S + t * 32 + 8 * j);
  #pragma unroll
  for (int i = 0; i < 8; i++) {{
    const float ra = a[i] * c[i] + b[i] * s[i], rb = b[i] * c[i] - a[i] * s[i];
    a[i] = ra; b[i] = rb; ss += ra * ra + rb * rb;
  }}
  ss += __shfl_xor_sync(0xffffffff, ss, 1); ss += __shfl_xor_sync(0xffffffff, ss, 2);
  const float r = rsqrtf(ss / 64.f + 1e-6f);
  store(Y + (size_t)row * 64 + 8 * j, a, r); store(Y + (size_t)row * 64 + 32 + 8 * j, b, r);
}}
"""

# dx = RoPE^T(du), du = r dy - r^3 u mean(dy u): each row's 4 lanes sum dy.u as they summed u.u
QK_GRAD = QK_IO + r"""
#define T {T}
#define H {H}
extern "C" __global__ void __launch_bounds__(256) {NAME}({IN} *__restrict__ DX, const {IN} *__restrict__ X, const float *__restrict__ C,
                                                          const float *__restrict__ S, const {OUT} *__restrict__ G) {{
  const int row = blockIdx.x * 64 + (threadIdx.x >> 2), j = threadIdx.x & 3, t = row / H % T;
  const size_t at = (size_t)row * 64 + 8 * j;
  float a[8], b[8], c[8], s[8], ga[8], gb[8], ss = 0.f, gu = 0.f;
  load(a, X + at); load(b, X + at + 32); load(c, C + t * 32 + 8 * j); load(s, S + t * 32 + 8 * j); load(ga, G + at); load(gb, G + at + 32);
  #pragma unroll
  for (int i = 0; i < 8; i++) {{
    const float ra = a[i] * c[i] + b[i] * s[i], rb = b[i] * c[i] - a[i] * s[i];
    a[i] = ra; b[i] = rb; ss += ra * ra + rb * rb; gu += ga[i] * ra + gb[i] * rb;
  }}
  ss += __shfl_xor_sync(0xffffffff, ss, 1); ss += __shfl_xor_sync(0xffffffff, ss, 2);
  gu += __shfl_xor_sync(0xffffffff, gu, 1); gu += __shfl_xor_sync(0xffffffff, gu, 2);
  const float r = rsqrtf(ss / 64.f + 1e-6f), k = r * r * r * gu / 64.f;
  #pragma unroll
  for (int i = 0; i < 8; i++) {{  // du, then back through the rotation: da = c dra - s drb, db = s dra + c drb
    const float da = r * ga[i] - k * a[i], db = r * gb[i] - k * b[i];
    a[i] = c[i] * da - s[i] * db; b[i] = s[i] * da + c[i] * db;
  }}
  store(DX + at, a, 1.f); store(DX + at + 32, b, 1.f);
}}
"""

CTYPE = {dtypes.half: "half", dtypes.float32: "float"}

def qk_grad(dy:UOp, call:UOp) -> tuple[UOp|None, ...]:
  """qk_norm's grad_fxn: dx in x's dtype (QK_GRAD), none for RoPE's tables."""
  y, x, cos, sin = operands(call)
  (_, T, H, _), name = x.shape, f"qk_norm_grad_{x.numel() // 64}_{CTYPE[x.dtype]}_{CTYPE[y.dtype]}"
  src = QK_GRAD.format(NAME=name, T=T, H=H, IN=CTYPE[x.dtype], OUT=CTYPE[y.dtype])
  fxn = program(x.device, name, src, (x.numel() // 64 // 64,), 256, 5, 20 * x.numel(), (2 * x.dtype.itemsize + y.dtype.itemsize) * x.numel())
  return None, Tensor.empty(*x.shape, dtype=x.dtype, device=x.device).custom_kernel(x, cos, sin, Tensor(dy).cast(y.dtype), fxn=fxn)[0].uop, None, None

def qk_fits(x:Tensor, dtype:DType) -> bool:  # x [B, T, H, 64], 64 rows to a block, in half or float32, as is the output
  return cuda_kernels(x.device) and x.ndim == 4 and x.shape[-1] == 64 and (x.numel() // 64) % 64 == 0 and x.dtype in CTYPE and dtype in CTYPE

def qk_norm(x:Tensor, cos:Tensor, sin:Tensor, dtype:DType) -> Tensor:
  """rms(rope(x)) in float32 for the heads x [B, T, H, hd], RoPE's tables cos, sin [T, 1, hd / 2] -> `dtype` (the attention's)."""
  if not qk_fits(x, dtype): return rms(rope(x.float(), cos, sin)).cast(dtype)
  B, T, H, _ = x.shape
  name = f"qk_norm_{B * T * H}_{CTYPE[x.dtype]}_{CTYPE[dtype]}"
  fxn = program(x.device, name, QK_SOURCE.format(NAME=name, T=T, H=H, IN=CTYPE[x.dtype], OUT=CTYPE[dtype]), (B * T * H // 64,), 256, 4,
                12 * B * T * H * 64, (x.dtype.itemsize + dtype.itemsize) * B * T * H * 64)
  return Tensor.empty(B, T, H, 64, dtype=dtype, device=x.device).custom_kernel(x, cos, sin, fxn=fxn, grad_fxn=qk_grad)[0]

NORM_SOURCE = r"""
#define D {D}
extern "C" __global__ void __launch_bounds__(256) {NAME}(half *__restrict__ Y, const float *__restrict__ X{ADD_ARG}) {{
  const int lane = threadIdx.x & 31;
  const size_t row = (size_t)(blockIdx.x * 8 + (threadIdx.x >> 5)) * D;
  float v[D / 32], ss = 0.f;
  #pragma unroll
  for (int k = 0; k < D / 128; k++) {{  // lane takes 4 values of every 128
    const float4 x = *(const float4 *)(X + row + k * 128 + lane * 4);
    v[4 * k] = x.x; v[4 * k + 1] = x.y; v[4 * k + 2] = x.z; v[4 * k + 3] = x.w;
    {ADD}
    #pragma unroll
    for (int i = 0; i < 4; i++) ss += v[4 * k + i] * v[4 * k + i];
  }}
  for (int o = 16; o; o >>= 1) ss += __shfl_xor_sync(0xffffffff, ss, o);
  const float r = rsqrtf(ss / D + 1e-6f);
  #pragma unroll
  for (int k = 0; k < D / 128; k++) {{
    uint2 u; u.x = pack(v[4 * k] * r, v[4 * k + 1] * r); u.y = pack(v[4 * k + 2] * r, v[4 * k + 3] * r);
    *(uint2 *)(Y + row + k * 128 + lane * 4) = u;
  }}
}}
"""
# dx = r dy - r^3 (x + y) mean(dy (x + y)) in float32, and the same in half for y
NORM_GRAD = r"""
#define D {D}
extern "C" __global__ void __launch_bounds__(256) {NAME}(float *__restrict__ DX{DY_ARG}, const float *__restrict__ X{ADD_ARG},
                                                          const half *__restrict__ G) {{
  const int lane = threadIdx.x & 31;
  const size_t row = (size_t)(blockIdx.x * 8 + (threadIdx.x >> 5)) * D;
  float v[D / 32], g[D / 32], ss = 0.f, gu = 0.f;
  #pragma unroll
  for (int k = 0; k < D / 128; k++) {{
    const float4 x = *(const float4 *)(X + row + k * 128 + lane * 4);
    v[4 * k] = x.x; v[4 * k + 1] = x.y; v[4 * k + 2] = x.z; v[4 * k + 3] = x.w;
    {ADD}
    const uint2 w = *(const uint2 *)(G + row + k * 128 + lane * 4);
    const float2 g0 = __half22float2(*(const half2 *)&w.x), g1 = __half22float2(*(const half2 *)&w.y);
    g[4 * k] = g0.x; g[4 * k + 1] = g0.y; g[4 * k + 2] = g1.x; g[4 * k + 3] = g1.y;
    #pragma unroll
    for (int i = 0; i < 4; i++) {{ ss += v[4 * k + i] * v[4 * k + i]; gu += g[4 * k + i] * v[4 * k + i]; }}
  }}
  for (int o = 16; o; o >>= 1) {{ ss += __shfl_xor_sync(0xffffffff, ss, o); gu += __shfl_xor_sync(0xffffffff, gu, o); }}
  const float r = rsqrtf(ss / D + 1e-6f), c = r * r * r * gu / D;
  #pragma unroll
  for (int k = 0; k < D / 128; k++) {{
    float d[4];
    for (int i = 0; i < 4; i++) d[i] = r * g[4 * k + i] - c * v[4 * k + i];
    *(float4 *)(DX + row + k * 128 + lane * 4) = make_float4(d[0], d[1], d[2], d[3]);
    {DY}
  }}
}}
"""
DY = """uint2 h; h.x = pack(d[0], d[1]); h.y = pack(d[2], d[3]); *(uint2 *)(DY + row + k * 128 + lane * 4) = h;"""
ADD = """const uint2 u = *(const uint2 *)(A + row + k * 128 + lane * 4);  // + y, in half
    const float2 a = __half22float2(*(const half2 *)&u.x), b = __half22float2(*(const half2 *)&u.y);
    v[4 * k] += a.x; v[4 * k + 1] += a.y; v[4 * k + 2] += b.x; v[4 * k + 3] += b.y;"""

def norm_fits(x:Tensor, dtype:DType, y:Tensor|None=None) -> bool:  # a half output; D by 128 up to 2,048 (a lane keeps D / 32); rows by 8
  D = x.shape[-1]
  return cuda_kernels(x.device) and x.dtype == dtypes.float32 and dtype == dtypes.half and D % 128 == 0 and D <= 2048 and \
    (x.numel() // D) % 8 == 0 and (y is None or y.dtype == dtypes.half)

def norm_grad(dy:UOp, call:UOp) -> tuple[UOp|None, ...]:
  """norm's grad_fxn: float32 dx and, where the norm added y, half dy, both from NORM_GRAD."""
  _, x, *y = operands(call)
  (R, D), name = x.shape, f"norm_grad_{x.shape[0]}_{x.shape[1]}" + ("_add" if y else "")
  src = NORM_GRAD.format(NAME=name, D=D, DY_ARG=", half *__restrict__ DY" if y else "", ADD_ARG=", const half *__restrict__ A" if y else "",
                         ADD=ADD if y else "", DY=DY if y else "")
  outs = [Tensor.empty(R, D, device=x.device)] + [Tensor.empty(R, D, dtype=dtypes.half, device=x.device) for _ in y]
  fxn = program(x.device, name, src, (R // 8,), 256, 2 * len(outs) + 1, 8 * R * D, (4 + 2 + 6 * len(y)) * R * D, outs=len(outs))
  return None, *[t.uop for t in outs[0].custom_kernel(*outs[1:], x, *y, Tensor(dy).cast(dtypes.half), fxn=fxn)[:len(outs)]]

def norm(x:Tensor, dtype:DType, y:Tensor|None=None) -> Tensor:
  """rms(x + y) in float32, cast to `dtype`: x a float32 stream [..., D], y (if given) in half; a CUDA kernel where norm_fits."""
  if not norm_fits(x, dtype, y): return rms(x if y is None else x + y.float()).cast(dtype)
  D, R = x.shape[-1], x.numel() // x.shape[-1]
  name = f"norm_{R}_{D}" + ("" if y is None else "_add")
  src = NORM_SOURCE.format(NAME=name, D=D, ADD_ARG="" if y is None else ", const half *__restrict__ A", ADD="" if y is None else ADD)
  fxn = program(x.device, name, src, (R // 8,), 256, 2 if y is None else 3, 4 * R * D, (4 + 2 + (0 if y is None else 2)) * R * D)
  srcs = [x.reshape(R, D)] + ([] if y is None else [y.reshape(R, D)])
  return Tensor.empty(R, D, dtype=dtype, device=x.device).custom_kernel(*srcs, fxn=fxn, grad_fxn=norm_grad)[0].reshape(x.shape)
