"""x @ w.T for the linear layers, on NVIDIA tensor cores, as a CUDA C kernel (kernels/cuda.py).

tinygrad's matmul kernels load their operands from global memory straight into registers: on the H200, at the linear layers' shapes
(M = 131,072 tokens, N of 512 to 4,096, K of 512 or 2,048, half inputs, float accumulation), 72-77 TFLOP/s by default and 101-110
with the best options a BEAM search found (the previous version of this file fixed those). A GEMM as GPUs like it stages tiles of
both operands in shared memory, where every warp of the block reuses them: each block of 256 threads computes a 128x128 tile of C,
walking K in steps of 32 through a three-stage pipeline (cp.async copies the tile after next while the tensor cores work on this
one), and each warp multiplies a 64x32 part of it with mma.sync (16x8x16, half in, float accumulate), its operands loaded by
ldmatrix. On the H200 at those shapes it runs at 245-281 TFLOP/s, with results bit-identical to tinygrad's matmul at the four shapes.

On Hopper (sm_90: the H100, H200) the same block runs HOPPER instead: its two warpgroups (128 threads each) multiply their 64x128 half
of the tile with wgmma, which reads both operands from the shared-memory tiles themselves (their swizzle is wgmma's 64-byte one)
and runs asynchronously, while the threads wait for the next tile. 266-356 TFLOP/s at the four shapes (1.08-1.34x mma.sync, measured
side by side on the H200), with identical results. Larger tiles or more stages would need more than the 48 KB of static
shared memory that tinygrad's launches allow (they pass no dynamic shared memory).

Where kernels/cuda.py's kernels don't run (CPU, AMD, Metal, tinygrad's PTX renderer, older GPUs), and for shapes the tile doesn't
divide, `linear` is tinygrad's own matmul. `act` applies an activation to x as the kernel reads it, so that relu(x)^2 of the
MLP is never written out: mma.sync's kernel computes it on the fragments in registers, each element once per warp along N, and
wgmma's on the tile in shared memory, once per block.

The gradient (`grad`), for backprop: with y = act(x) w^T, dx = (dy w) act'(x) is this same kernel with act' applied in its epilogue,
on Hopper reading w as stored (wgmma takes B N-major), elsewhere with a copy of w^T as the weight (of the small weight, not of the
activations); and dw = dy^T act(x) sums over the tokens, which both operands hold as rows: GRAD_W reads them so, with transposed
ldmatrix loads, and splits the tokens among blocks (a 512 x 512 weight is only 16 tiles of 128 x 128).
"""
import functools
from typing import Callable
from tinygrad import Tensor, dtypes
from tinygrad.uop.ops import UOp
from kernels import cuda_kernels, wgmma
from kernels.cuda import operands, program
from kernels.jitter import NOISE, jitter, literal, parts, tag

TILE = (128, 128, 32)  # M, N, K of a block's step: the shapes must divide
# name -> (the tensor op, the same in CUDA on half2 v, its gradient (x, d act(x)) -> dx, and that in CUDA on floats a, b times the derivative
# at half *x and the next); d relu(x)^2 / dx = 2 relu(x)
ACTS = {"relu2": (lambda t: t.relu().square(), "v = __hmax2(v, __float2half2_rn(0.f)); v = __hmul2(v, v);",
                  lambda x, g: (g.float() * 2 * x.float().relu()).cast(g.dtype),
                  "const float2 v = __half22float2(*(const half2 *)x); a *= 2.f * fmaxf(v.x, 0.f); b *= 2.f * fmaxf(v.y, 0.f);")}

TILES = r"""
#define N {N}
#define K {K}
#define ROWS {ROWS}  // rows of A per weight: B holds one [N][K] weight for every ROWS rows
#define NMAJOR {NMAJOR}  // B is one weight stored [K][N] instead (wgmma only): the weight of dx = dy w, read as stored
#define BK 32
#define STAGES 3
// a tile row is BK halves, 4 chunks of 16 bytes; chunk c of row r is stored at c ^ ((r >> 1) & 3), so that the 8 rows that one
// ldmatrix phase reads, and the 8 chunks that one cp.async phase writes, fall in 8 different 16-byte bank groups. It is also the
// 64-byte swizzle that Hopper's wgmma reads (bytes 16-31 of an address xor bytes 128-255's bits)
__device__ __forceinline__ int swz(int r, int c) {{ return r * BK + ((c ^ ((r >> 1) & 3)) << 3); }}
// an N-major tile, BK rows k of 128 columns n, is 4 x 4 blocks of 8 rows of 32 columns (64 bytes, in the same swizzle): the block of
// columns j and rows g is at (g * 4 + j) * 512 bytes. Chunk c (of 16) of row k is in block (k / 8, c / 4)
__device__ __forceinline__ int swz_n(int k, int c) {{ return ((k >> 3) * 4 + (c >> 2)) * 256 + swz(k & 7, c & 3); }}
__device__ __forceinline__ unsigned act(unsigned u) {{ half2 v = *(half2 *)&u; {ACT} return *(unsigned *)&v; }}
#define SIGMA {SIGMA}  // a jitter site's scale (kernels/jitter.py), 0 for none
#define RUN_ROWS {RUN_ROWS}  // rows of C that one key's noise covers
{NOISE}
// the noise words of C's rows r and r + 8 at columns c and c + 1 (c even) for this lane: threefry call (r N + c) / 4 gives the four
// columns of lanes l and l ^ 1, l even, a word each. So lane l draws row r's call, l ^ 1 row r + 8's, and they swap the word the other needs
__device__ __forceinline__ uint2 words(const unsigned *key, size_t r, size_t c, int lane) {{
  if (!SIGMA) return make_uint2(0, 0);
  const int odd = lane & 1;
  const size_t row = r + 8 * odd;
  const unsigned *k = key + row / RUN_ROWS * 2;
  const uint2 w = threefry((unsigned)((row % RUN_ROWS * N + c) / 4), k[0], k[1]);
  const unsigned got = __shfl_xor_sync(0xffffffff, odd ? w.x : w.y, 1);
  return odd ? make_uint2(got, w.y) : make_uint2(w.x, got);
}}
// two neighbouring outputs as half; in the gradient of an activation, first times its derivative at the same place of X (XAT); at a
// jitter site, plus sigma times the Gaussians of noise word w
#define XAT(i) {XAT}
__device__ __forceinline__ unsigned out(float a, float b, const half *x, unsigned w) {{
  {DACT} return SIGMA ? jittered(pack(a, b), w, SIGMA) : pack(a, b);
}}
// a 128 x BK tile of each operand into a stage: 512 chunks of 16 bytes each, two per thread (unrolled: as a loop, the wgmma kernel
// lost 25% at N = 2048)
__device__ __forceinline__ void load(half *sa, half *sb, const half *a, const half *b, int tid, int k0) {{
  #pragma unroll
  for (int i = 0; i < 2; i++) {{
    int c = tid + i * 256, r = c >> 2, ch = c & 3;
    cp_async(sa + swz(r, ch), a + (size_t)r * K + k0 + ch * 8);
    if (NMAJOR) cp_async(sb + swz_n(c >> 4, c & 15), b + (size_t)(k0 + (c >> 4)) * N + (c & 15) * 8);
    else cp_async(sb + swz(r, ch), b + (size_t)r * K + k0 + ch * 8);
  }}
  commit();
}}
"""

SOURCE = TILES + r"""
extern "C" __global__ void __launch_bounds__(256, 2) {NAME}(half *__restrict__ C, const half *__restrict__ A,
                                                              const half *__restrict__ B{X_ARG}{KEY_ARG}) {{
  __shared__ __align__(128) half sa[STAGES * 128 * BK], sb[STAGES * 128 * BK];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, wm = (warp >> 2) * 64, wn = (warp & 3) * 32;
  const half *a = A + (size_t)blockIdx.y * 128 * K, *b = B + ((size_t)(blockIdx.y * 128 / ROWS) * N + blockIdx.x * 128) * K;
  float acc[4][4][4] = {{}};
  for (int s = 0; s < STAGES - 1; s++) load(sa + s * 128 * BK, sb + s * 128 * BK, a, b, tid, s * BK);
  for (int kt = 0; kt < K / BK; kt++) {{
    wait<STAGES - 2>();  // tile kt has landed
    __syncthreads();     // ... for every thread, and every warp is done with tile kt - 1, whose stage the next load overwrites
    const int next = (kt + STAGES - 1) % STAGES;
    if (kt + STAGES - 1 < K / BK) load(sa + next * 128 * BK, sb + next * 128 * BK, a, b, tid, (kt + STAGES - 1) * BK);
    else commit();       // an empty group keeps the count that wait relies on
    const half *ta = sa + kt % STAGES * 128 * BK, *tb = sb + kt % STAGES * 128 * BK;
    #pragma unroll
    for (int kk = 0; kk < BK / 16; kk++) {{
      unsigned af[4][4], bf[2][4];
      #pragma unroll
      for (int mi = 0; mi < 4; mi++) {{  // A, 16 rows x 16 k: lanes 0-15 address rows at k 0, lanes 16-31 at k 8
        ldsm(af[mi], ta + swz(wm + mi * 16 + (lane & 15), kk * 2 + (lane >> 4)));
        for (int j = 0; j < 4; j++) af[mi][j] = act(af[mi][j]);
      }}
      #pragma unroll
      for (int nj = 0; nj < 2; nj++)  // B, two 8-column tiles x 16 k: matrices (n 0-7, k 0), (n 0-7, k 8), (n 8-15, k 0), (n 8-15, k 8)
        ldsm(bf[nj], tb + swz(wn + nj * 16 + (lane & 7) + ((lane >> 4) << 3), kk * 2 + ((lane >> 3) & 1)));
      #pragma unroll
      for (int mi = 0; mi < 4; mi++)
        #pragma unroll
        for (int ni = 0; ni < 4; ni++) mma(acc[mi][ni], af[mi], bf[ni >> 1][(ni & 1) * 2], bf[ni >> 1][(ni & 1) * 2 + 1]);
    }}
  }}
  #pragma unroll
  for (int mi = 0; mi < 4; mi++)  // lane holds rows lane / 4 and lane / 4 + 8, columns 2 (lane % 4) and the next, of each 16x8 tile
    #pragma unroll
    for (int ni = 0; ni < 4; ni++) {{
      size_t r = (size_t)blockIdx.y * 128 + wm + mi * 16 + (lane >> 2), c = blockIdx.x * 128 + wn + ni * 8 + (lane & 3) * 2;
      const uint2 w = words({KEY}, r, c, lane);
      *(unsigned *)(C + r * N + c) = out(acc[mi][ni][0], acc[mi][ni][1], XAT(r * N + c), w.x);
      *(unsigned *)(C + (r + 8) * N + c) = out(acc[mi][ni][2], acc[mi][ni][3], XAT((r + 8) * N + c), w.y);
    }}
}}
"""

# wgmma m64n128k16: a warpgroup's d (64 floats a thread) += A (64 x 16, from shared memory) B (16 x 128, from shared memory; its last
# immediate, imm-trans-b, says whether B is N-major)
WGMMA = ('asm volatile("{{ .reg .pred p; setp.ne.b32 p, %66, 0; wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 {{' +
         ", ".join(f"%{i}" for i in range(64)) + '}}, %64, %65, p, 1, 1, 0, {NMAJOR}; }}" : ' + ", ".join(f'"+f"(d[{i}])' for i in range(64)) +
         ' : "l"(da), "l"(db), "r"(1));')

HOPPER = TILES + r"""
// where wgmma finds a tile in the 64-byte swizzle (mode 2): K-major, of 8-row groups 512 bytes apart (the stride; the leading offset is
// unused); N-major (swz_n), of 32-column blocks 512 bytes apart (the leading offset) and 8-row ones 2,048 bytes apart (the stride)
__device__ __forceinline__ unsigned long long desc(const half *p) {{ return (smem(p) & 0x3ffff) >> 4 | 1ull << 16 | 32ull << 32 | 2ull << 62; }}
__device__ __forceinline__ unsigned long long desc_n(const half *p) {{ return (smem(p) & 0x3ffff) >> 4 | 32ull << 16 | 128ull << 32 | 2ull << 62; }}
__device__ __forceinline__ void wgmma(float (&d)[64], unsigned long long da, unsigned long long db) {{ """ + WGMMA + r""" }}

extern "C" __global__ void __launch_bounds__(256, 2) {NAME}(half *__restrict__ C, const half *__restrict__ A,
                                                              const half *__restrict__ B{X_ARG}{KEY_ARG}) {{
  __shared__ __align__(1024) half sa[STAGES * 128 * BK], sb[STAGES * 128 * BK];
  const int tid = threadIdx.x, lane = tid & 31, wg = tid >> 7, warp = (tid >> 5) & 3;
  const half *a = A + (size_t)blockIdx.y * 128 * K;
  const half *b = NMAJOR ? B + blockIdx.x * 128 : B + ((size_t)(blockIdx.y * 128 / ROWS) * N + blockIdx.x * 128) * K;
  float acc[64] = {{}};
  for (int s = 0; s < STAGES - 1; s++) load(sa + s * 128 * BK, sb + s * 128 * BK, a, b, tid, s * BK);
  for (int kt = 0; kt < K / BK; kt++) {{
    half *ta = sa + kt % STAGES * 128 * BK, *tb = sb + kt % STAGES * 128 * BK;
    wait<STAGES - 2>();  // this thread's copies of tile kt have landed
    if ({HAS_ACT}) for (int i = 0; i < 2; i++) {{  // wgmma reads A from shared memory: apply the activation there, to the chunks copied
      uint4 *p = (uint4 *)(ta + swz((tid + i * 256) >> 2, tid & 3)), v = *p;
      v.x = act(v.x); v.y = act(v.y); v.z = act(v.z); v.w = act(v.w); *p = v;
    }}
    // (in this order: with the fence first, NVRTC 12 crashed compiling the kernel with an activation)
    asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");  // this warpgroup's products of tile kt - 1 are done
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");    // the tile's shared memory, as written, is what wgmma will read
    __syncthreads();  // ... for every thread's copies; and every warpgroup is done with tile kt - 1, whose stage the next load overwrites
    const int next = (kt + STAGES - 1) % STAGES;
    if (kt + STAGES - 1 < K / BK) load(sa + next * 128 * BK, sb + next * 128 * BK, a, b, tid, (kt + STAGES - 1) * BK);
    else commit();
    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
    #pragma unroll  // warpgroup wg: rows 64 wg .. 64 wg + 63 of the block's C, all 128 columns; a step of 16 k is 32 bytes into the rows
    for (int kk = 0; kk < BK / 16; kk++) wgmma(acc, desc(ta + wg * 64 * BK + kk * 16), NMAJOR ? desc_n(tb + kk * 2048) : desc(tb + kk * 16));
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");  // runs while the next tile is awaited
  }}
  asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
  #pragma unroll
  for (int i = 0; i < 16; i++) {{  // as mma.sync's 16x8 tiles: warp w of the group holds rows 16 w + lane / 4 (+ 8), columns 8 i + 2 (lane % 4) (+ 1)
    size_t r = (size_t)blockIdx.y * 128 + wg * 64 + warp * 16 + (lane >> 2), c = blockIdx.x * 128 + i * 8 + (lane & 3) * 2;
    const uint2 w = words({KEY}, r, c, lane);
    *(unsigned *)(C + r * N + c) = out(acc[4 * i], acc[4 * i + 1], XAT(r * N + c), w.x);
    *(unsigned *)(C + (r + 8) * N + c) = out(acc[4 * i + 2], acc[4 * i + 3], XAT((r + 8) * N + c), w.y);
  }}
}}
"""

# dw [N, K] = sum over the tokens m of dy[m, n] act(x)[m, k], in float32: the tokens are the reduction and the rows of both operands. A
# block of 256 threads computes a 128 x 128 tile of dw over its part of the tokens (blockIdx.z: split-K), 32 tokens a step through a
# three-stage cp.async pipeline, each warp a 64 x 32 part with mma.sync as above. A stage holds 32 token rows of 128 halves of each
# operand, [m][n] and [m][k]; mma's A (16 n x 16 m) and B (16 m x 8 k) come out of them with ldmatrix.trans.
GRAD_W = r"""
#define N {N}
#define K {K}
#define BM 32
#define STAGES 3
// a stage row is 128 halves, 16 chunks of 16 bytes; chunk c of row r is stored at c ^ (r & 7), so that the 8 rows that one ldmatrix
// phase reads fall in 8 different 16-byte bank groups
__device__ __forceinline__ int swz(int r, int c) {{ return r * 128 + ((c ^ (r & 7)) << 3); }}
__device__ __forceinline__ unsigned act(unsigned u) {{ half2 v = *(half2 *)&u; {ACT} return *(unsigned *)&v; }}
__device__ __forceinline__ void load(half *sa, half *sb, const half *a, const half *b, int tid, size_t m0) {{  // 2 x 512 chunks
  #pragma unroll
  for (int i = 0; i < 2; i++) {{
    int c = tid + i * 256, r = c >> 4, ch = c & 15;
    cp_async(sa + swz(r, ch), a + (m0 + r) * N + ch * 8);
    cp_async(sb + swz(r, ch), b + (m0 + r) * K + ch * 8);
  }}
  commit();
}}

extern "C" __global__ void __launch_bounds__(256, 2) {NAME}(float *__restrict__ C, const half *__restrict__ A, const half *__restrict__ B) {{
  __shared__ __align__(128) half sa[STAGES * BM * 128], sb[STAGES * BM * 128];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, wm = (warp >> 2) * 64, wn = (warp & 3) * 32;
  const int steps = {M} / gridDim.z / BM;  // of this block's part of the tokens
  const size_t m0 = (size_t)blockIdx.z * steps * BM;
  const half *a = A + m0 * N + blockIdx.y * 128, *b = B + m0 * K + blockIdx.x * 128;
  float acc[4][4][4] = {{}};
  for (int s = 0; s < STAGES - 1; s++) load(sa + s * BM * 128, sb + s * BM * 128, a, b, tid, s * BM);
  for (int kt = 0; kt < steps; kt++) {{
    wait<STAGES - 2>();
    __syncthreads();
    const int next = (kt + STAGES - 1) % STAGES;
    if (kt + STAGES - 1 < steps) load(sa + next * BM * 128, sb + next * BM * 128, a, b, tid, (size_t)(kt + STAGES - 1) * BM);
    else commit();
    const half *ta = sa + kt % STAGES * BM * 128, *tb = sb + kt % STAGES * BM * 128;
    #pragma unroll
    for (int kk = 0; kk < BM / 16; kk++) {{
      unsigned af[4][4], bf[2][4];
      #pragma unroll
      for (int mi = 0; mi < 4; mi++)  // A, 16 n x 16 m, stored [m][n]: matrices (n 0-7, m 0-7), (n 8-15, m 0-7), (n 0-7, m 8-15), (n 8-15, m 8-15)
        ldsm_t(af[mi], ta + swz(kk * 16 + ((lane >> 4) << 3) + (lane & 7), (wm + mi * 16) / 8 + ((lane >> 3) & 1)));
      #pragma unroll
      for (int nj = 0; nj < 2; nj++) {{  // B, 16 m x two 8-column tiles, stored [m][k]: (m 0-7, k 0-7), (m 8-15, k 0-7), (m 0-7, k 8-15), ...
        ldsm_t(bf[nj], tb + swz(kk * 16 + (lane & 15), (wn + nj * 16) / 8 + (lane >> 4)));
        for (int j = 0; j < 4; j++) bf[nj][j] = act(bf[nj][j]);
      }}
      #pragma unroll
      for (int mi = 0; mi < 4; mi++)
        #pragma unroll
        for (int ni = 0; ni < 4; ni++) mma(acc[mi][ni], af[mi], bf[ni >> 1][(ni & 1) * 2], bf[ni >> 1][(ni & 1) * 2 + 1]);
    }}
  }}
  float *c = C + (size_t)blockIdx.z * N * K;
  #pragma unroll
  for (int mi = 0; mi < 4; mi++)
    #pragma unroll
    for (int ni = 0; ni < 4; ni++) {{
      size_t r = (size_t)blockIdx.y * 128 + wm + mi * 16 + (lane >> 2), col = blockIdx.x * 128 + wn + ni * 8 + (lane & 3) * 2;
      *(float2 *)(c + r * K + col) = make_float2(acc[mi][ni][0], acc[mi][ni][1]);
      *(float2 *)(c + (r + 8) * K + col) = make_float2(acc[mi][ni][2], acc[mi][ni][3]);
    }}
}}
"""
SPLIT = 256  # blocks that fill an H200 (132 SMs, two blocks each): the tokens are split in halves until a weight's tiles reach it

def matmul(x:Tensor, w:Tensor, act:str|None=None, dact:tuple[str, Tensor]|None=None, noise:tuple[Tensor, float]|None=None,
           nmajor:bool=False) -> Tensor:
  """act(x) [M, K] @ w [N, K].T in half, as one kernel; or with w [G, N, K], rows [g M/G, (g+1) M/G) of x times weight g; or on
  Hopper with nmajor, x @ w for one w [K, N]. With dact = (act, a), a [M, N], the product times act'(a): the gradient of an activation
  that a layer applied to its input a. With noise = (key, sigma), a jitter site's: plus sigma times kernels/jitter.py's Gaussians,
  drawn in the epilogue."""
  (M, K), (N, G) = x.shape, (w.shape[-1] if nmajor else w.shape[-2], 1 if w.ndim == 2 else w.shape[0])
  hopper = wgmma(x.device)
  assert hopper or not nmajor, "an N-major weight is read by wgmma only"
  name = ("wgmma" if hopper else "gemm") + f"_{M}_{N}_{K}" + (f"_x{G}" if G > 1 else "") + ("_n" if nmajor else "") + \
    (f"_{act}" if act else "") + (f"_d{dact[0]}" if dact else "") + (f"_j{tag(*noise)}" if noise else "")
  src = (HOPPER if hopper else SOURCE).format(NAME=name, N=N, K=K, ROWS=M // G, NMAJOR=int(nmajor), ACT=ACTS[act][1] if act else "",
                                              HAS_ACT=int(act is not None),
                                              DACT=ACTS[dact[0]][3] if dact else "", X_ARG=", const half *__restrict__ X" if dact else "",
                                              XAT="X + (i)" if dact else "nullptr", NOISE=NOISE, SIGMA=literal(noise[1]) if noise else "0.f",
                                              RUN_ROWS=M // parts(noise[0]) if noise else 1, KEY="key" if noise else "nullptr",
                                              KEY_ARG=", const unsigned *__restrict__ key" if noise else "")
  fxn = program(x.device, name, src, (N // TILE[1], M // TILE[0]), 256, 3 + bool(dact) + bool(noise), 2 * M * N * K,
                2 * (M * K + G * N * K + M * N))
  # no .contiguous(): a custom kernel's inputs are realized anyway, and on a kernel's output (x, often) it would be a copy
  out, extra = Tensor.empty(M, N, dtype=dtypes.half, device=x.device), ([dact[1]] if dact else []) + ([noise[0].cast(dtypes.uint32)] if noise else [])
  plain = G == 1 and not (dact or noise or nmajor)  # the forward's kernel, which backprop differentiates
  return out.custom_kernel(x, w.cast(dtypes.half), *extra, fxn=fxn, grad_fxn=grad(act) if plain else None)[0]

def weight_grad(dy:Tensor, x:Tensor, act:str|None) -> Tensor:
  """dy [M, N]^T @ act(x) [M, K] -> float32 [N, K] (GRAD_W), the tokens split into S parts whose sums are added after."""
  (M, N), K = dy.shape, x.shape[-1]
  if not grad_w_tiles(M, N, K): return dy.T.float() @ activate(x, act).float()
  S = 1
  while (N // 128) * (K // 128) * S < SPLIT and M % (2 * S * 256) == 0: S *= 2  # each part at least 256 tokens
  name = f"grad_w_{M}_{N}_{K}_{S}" + (f"_{act}" if act else "")
  src = GRAD_W.format(NAME=name, N=N, K=K, M=M, ACT=ACTS[act][1] if act else "")
  fxn = program(dy.device, name, src, (K // 128, N // 128, S), 256, 3, 2 * M * N * K, 2 * M * (N + K) + 4 * S * N * K)
  parts = Tensor.empty(S, N, K, device=dy.device).custom_kernel(dy, x, fxn=fxn)[0]
  return parts.sum(0) if S > 1 else parts.reshape(N, K)

def outer_sum(a:Tensor, b:Tensor) -> Tensor:
  """a^T b in float32 for a [M, N] and b [M, K]: a sum of outer products over the M rows (the tokens), as a weight's gradient is. On
  the CUDA kernels, where the tiles divide, GRAD_W on the tensor cores in half, each float32 operand first scaled (`halved`);
  elsewhere tinygrad's float32 matmul."""
  if not tensor_cores(a, b): return a.float().T @ b.float()
  (a, sa), (b, sb) = halved(a), halved(b)
  return weight_grad(a, b, None) / (sa * sb)

def mix_rows(c:Tensor, x:Tensor) -> Tensor:
  """c @ x, materialized, for c [T, T] of weights at most 1 and x [..., T, H] in float32: each output row a weighted sum of x's rows, as a
  discounted credit is. Where outer_sum runs on the tensor cores, as one sum over x's rows for every leading index at once (c^T and x
  with its rows first); elsewhere tinygrad's batched matmul."""
  *lead, T, H = x.shape
  xt = x.reshape(-1, T, H).permute(1, 0, 2).reshape(T, -1)  # [T, n H]: the rows first, as outer_sum sums over them
  if not tensor_cores(c.T, xt): return (c @ x).contiguous()
  # c in half as it is (a credit is at most 1): scaled, the scale's reduction over its lazy values was recomputed in every kernel
  return outer_sum(c.T.cast(dtypes.half).contiguous(), xt).reshape(T, -1, H).permute(1, 0, 2).reshape(*lead, T, H).contiguous()

def grad_w_tiles(M:int, N:int, K:int) -> bool: return M % 256 == 0 and N % 128 == 0 and K % 128 == 0  # GRAD_W's tiles divide them
def tensor_cores(a:Tensor, b:Tensor) -> bool: return cuda_kernels(a.device) and grad_w_tiles(*a.shape, b.shape[1])  # outer_sum's kernel

def halved(t:Tensor) -> tuple[Tensor, Tensor|float]:
  """t in half, and the scale it was multiplied by: a half tensor as it is; a float32 one scaled so that its largest magnitude is 2^14
  (half's largest is 65,504), which keeps half's 11 bits down to 2^-14 of that and flushes nothing above 2^-38 of it, where values as
  small as Dust's per-token errors (often below half's smallest normal, 6.1e-5) would otherwise lose their bits or vanish."""
  if t.dtype == dtypes.half: return t, 1.0
  # the rows' largest, then theirs: one scale, realized before the kernels that read it (fused, each output recomputed it)
  s = (2.0 ** 14 / t.abs().max(-1).contiguous().max().maximum(1e-30)).contiguous()
  return (t * s).cast(dtypes.half), s

@functools.cache
def grad(act:str|None) -> Callable:
  """matmul's grad_fxn: d act(x) = dy w (this kernel again: on Hopper reading w as stored, N-major, elsewhere with a copy of w^T as the
  weight), then through act; dw = dy^T act(x) in float32, the gradient of the float32 weight that was cast to half. One function per
  act, so that equal forwards stay equal UOps."""
  def fxn(dy:UOp, call:UOp) -> tuple[UOp|None, ...]:
    _, x, w = operands(call)
    g = Tensor(dy).cast(dtypes.half)
    nmajor = wgmma(g.device)
    if not tuned(g, w.T): dx = activate_grad(x, linear(g, w.T), act)
    else: dx = matmul(g, w if nmajor else w.T.contiguous(), dact=(act, x) if act else None, nmajor=nmajor)  # act' in its epilogue
    return None, dx.uop, weight_grad(g, x, act).uop
  return fxn

def tuned(x:Tensor, w:Tensor) -> bool:
  """Whether the kernel applies: half inputs, a CUDA GPU it runs on (kernels/cuda.py), and shapes the tile divides (each weight's
  rows, for a batch of weights)."""
  rows, G = x.numel() // x.shape[-1], 1 if w.ndim == 2 else w.shape[0]
  return cuda_kernels(x.device) and x.dtype == dtypes.half and rows % G == 0 and \
    all(s % t == 0 for s, t in zip((rows // G, *w.shape[-2:]), TILE))

def activate(x:Tensor, act:str|None) -> Tensor: return ACTS[act][0](x) if act else x
def activate_grad(x:Tensor, g:Tensor, act:str|None) -> Tensor: return ACTS[act][2](x, g) if act else g  # g times act'(x)

def linear(x:Tensor, w:Tensor, act:str|None=None, noise:tuple|None=None) -> Tensor:
  """act(x) @ w.T in x's dtype, x [..., K], w [N, K] in any float dtype (the float32 master weights); or w [G, N, K], a weight for each
  of G equal groups of x's rows (the members of a population, kernels/perturb.py). Materialized either way, so that no reduction
  downstream (a norm, the loss) recomputes the matmul inside its own loop. `noise` = (key, sigma, *kind), a jitter site's: the
  product plus kernels/jitter.py's noise, drawn in the kernel's epilogue where it can be (`epilogue`)."""
  if not tuned(x, w): y, fused = product(x, w, act), False
  else:
    fused = noise is not None and epilogue(x, w, noise)
    y = matmul(x.reshape(-1, x.shape[-1]), w, act, noise=noise[:2] if fused else None).reshape(*x.shape[:-1], w.shape[-2])
  return y if noise is None or fused else jitter(y, *noise)

def epilogue(x:Tensor, w:Tensor, noise:tuple) -> bool:  # whether matmul draws a site's noise: Gaussian, one weight, runs of 16 rows
  return w.ndim == 2 and tuple(noise[2:]) in ((), ("gaussian",)) and x.numel() // x.shape[-1] % (16 * parts(noise[0])) == 0

def product(x:Tensor, w:Tensor, act:str|None) -> Tensor:  # linear where matmul's tiles don't apply
  if w.ndim == 2 and cuda_kernels(x.device): return untiled(activate(x, act).reshape(-1, x.shape[-1]), w).reshape(*x.shape[:-1], w.shape[0])
  if w.ndim == 2: return (activate(x, act) @ w.cast(x.dtype).T).contiguous()
  xg = activate(x, act).reshape(w.shape[0], -1, x.shape[-1])
  return (xg @ w.cast(x.dtype).transpose(-1, -2)).reshape(*x.shape[:-1], w.shape[-2]).contiguous()

def untiled(x:Tensor, w:Tensor) -> Tensor:
  """x [M, K] @ w [N, K].T, materialized, for a weight that the tiles don't divide (the value-embedding gate, 32 -> 8) on a GPU that runs
  the kernels: tinygrad's matmul, with a gradient (untiled_grad) that sums dw over the tokens in parts of 256 and then the parts. As one
  sum of 16,384 tokens into 256 values, tinygrad ran it in one warp: 0.37 ms a gate at the dust preset (H200)."""
  return x.call(w, fxn=(x.as_param(0) @ w.as_param(1).cast(x.dtype).T).contiguous(), grad_fxn=untiled_grad)

def untiled_grad(dy:UOp, call:UOp) -> tuple[UOp|None, ...]:
  x, w, g = Tensor(call.src[1]), Tensor(call.src[2]), Tensor(dy)
  S = x.shape[0] // 256 if x.shape[0] % 256 == 0 else 1
  dw = (g.reshape(S, -1, w.shape[0]).transpose(1, 2).float() @ x.reshape(S, -1, x.shape[1]).float()).contiguous().sum(0)
  return (g @ w.cast(g.dtype)).uop, dw.uop
