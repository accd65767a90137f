"""The causal windowed attention of kernels/attention.py as one CUDA kernel that never writes the T x T weights out (flash attention).

q, k, v and the output are [B, T, H, 64], as the projections lay them out: a head's row of 64 values sits H x 64 values after the
previous token's, and cp.async reads the rows in place. Each block of 256 threads takes 128 queries of one (sequence, head), and walks
the 64-key blocks they can see, [s0 - window, s0 + 128), through a two-stage cp.async pipeline. Each of its 8 warps owns 16 queries:
S = q k^T on the tensor cores, w = exp(S / sqrt(hd)) under the mask, rounded to half, then o += w v with w taken straight from S's
registers (an mma's accumulator layout is the next mma's operand layout, two 8-key tiles to one 16-key step), and the row sums of w
on the side. QK-norm bounds every score by sqrt(hd), so exp needs no running max and nothing is rescaled (kernels/attention.py); the
result is the tensor version's, summed in another order. Key blocks that a warp's queries can't see are skipped, and the mask is
applied only in the blocks that a window edge cuts. hd = 64 only: a 128 x 64 block of q and two stages of 64 x 64 blocks of k and v
fill the 48 KB of static shared memory. q and k may hold fewer sequences than v, QB, each shared by the v sequences s with the same
s % QB: a Dust draw batch's n copies of the clean q and k, never made (SOURCE_DELTA below takes the same).

The gradient (`grad`, for backprop) is FlashAttention-2's, in two kernels that recompute the weights instead of storing them: with
P = w / Z (Z, the row sums), D_i = do_i . o_i and dS = P (do v^T - D), dq = dS k / sqrt(hd) by blocks of queries (SOURCE_DQ), and
dk = dS^T q / sqrt(hd), dv = P^T do by blocks of keys (SOURCE_DKV). The forward's second output is 1 / Z, so that the backward
multiplies where it would divide (without fast math a division is a sequence of instructions, and these kernels made one a weight).
"""
import functools, math
from typing import Callable
from tinygrad import Tensor, dtypes
from tinygrad.uop.ops import UOp
from kernels import cuda_kernels
from kernels.cuda import operands, program

HD, BQ = 64, 128  # head dim, queries per block

# shared by the half kernels: a warp's 16 queries against a 64-key block in shared memory, on the tensor cores
TILE = r"""
#define T {T}
#define WINDOW {WINDOW}
#define RS {RS}  // the stride of a head's rows: H heads of 64
#define QB {QB}  // the sequences of q and k: sequence s of the others reads sequence s % QB of them
// where block y's (sequence, head) starts in the tensors that have all the sequences, and in those with QB
__device__ __forceinline__ size_t head_of(int y) {{ return (size_t)(y / (RS / 64)) * T * RS + y % (RS / 64) * 64; }}
__device__ __forceinline__ size_t shared_head(int y) {{ return (size_t)(y / (RS / 64) % QB) * T * RS + y % (RS / 64) * 64; }}
// a tile row is 64 halves, 8 chunks of 16 bytes; chunk c of row r is stored at c ^ (r & 7): the 8 rows that one ldmatrix phase
// reads, plain or transposed, fall in 8 different 16-byte bank groups
__device__ __forceinline__ int swz(int r, int c) {{ return r * 64 + ((c ^ (r & 7)) << 3); }}
__device__ __forceinline__ void load_rows(unsigned (&f)[4][4], const half *tile, int row, int lane) {{  // 16 rows x 64 as 4 A operands
  for (int kk = 0; kk < 4; kk++) ldsm(f[kk], tile + swz(row + (lane & 15), kk * 2 + (lane >> 4)));
}}
__device__ __forceinline__ void scores(float (&s)[8][4], const unsigned (&qf)[4][4], const half *sk, int lane) {{  // s += q k^T, 16 x 64
  #pragma unroll
  for (int kk = 0; kk < 4; kk++)  // over the head dim in steps of 16
    #pragma unroll
    for (int nj = 0; nj < 4; nj++) {{
      unsigned b[4];
      ldsm(b, sk + swz(nj * 16 + (lane & 7) + ((lane >> 4) << 3), kk * 2 + ((lane >> 3) & 1)));
      mma(s[2 * nj], qf[kk], b[0], b[1]); mma(s[2 * nj + 1], qf[kk], b[2], b[3]);
    }}
}}
// o += w v, 16 x 64, over the 64 keys in steps of 16; w in half, rows lane / 4 and lane / 4 + 8, keys 8 ni + 2 (lane % 4) and the next:
// an mma's accumulator layout is the next mma's operand layout, two 8-key tiles to one 16-key step
__device__ __forceinline__ void mix(float (&o)[8][4], const unsigned (&w)[8][2], const half *sv, int lane) {{
  #pragma unroll
  for (int kk = 0; kk < 4; kk++) {{
    const unsigned a[4] = {{w[2 * kk][0], w[2 * kk][1], w[2 * kk + 1][0], w[2 * kk + 1][1]}};
    #pragma unroll
    for (int nj = 0; nj < 4; nj++) {{
      unsigned b[4];
      ldsm_t(b, sv + swz(kk * 16 + (lane & 15), nj * 2 + (lane >> 4)));
      mma(o[2 * nj], a, b[0], b[1]); mma(o[2 * nj + 1], a, b[2], b[3]);
    }}
  }}
}}
// whether query qr + 8 (c / 2) sees key t + c % 2: c indexes an accumulator's 4 values
__device__ __forceinline__ bool seen(int qr, int t, int c) {{ const int lag = qr + (c >> 1) * 8 - (t + (c & 1)); return lag >= 0 && lag <= WINDOW; }}
__device__ __forceinline__ float rowsum(float x) {{  // the 4 lanes of a row hold its keys
  x += __shfl_xor_sync(0xffffffff, x, 1); return x + __shfl_xor_sync(0xffffffff, x, 2);
}}
// a weight w = exp(S / sqrt(hd)) as the forward kernel rounds it to half, 0 where the mask hides it
__device__ __forceinline__ float weight(float s, bool seen) {{ return seen ? __half2float(__float2half_rn(__expf(s * {SCALE}f))) : 0.f; }}
"""

SOURCE = TILE + r"""
extern "C" __global__ void __launch_bounds__(256) {NAME}(half *__restrict__ O, float *__restrict__ Z, const half *__restrict__ Q,
                                                          const half *__restrict__ K, const half *__restrict__ V) {{
  __shared__ __align__(128) half sq[128 * 64], sk[2][64 * 64], sv[2][64 * 64];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int s0 = (gridDim.x - 1 - blockIdx.x) * 128;  // the longest rows first: the last blocks to start are the short ones
  const size_t head = head_of(blockIdx.y);  // (sequence, head) of the block
  const half *q = Q + shared_head(blockIdx.y), *k = K + shared_head(blockIdx.y), *v = V + head;
  auto tile = [&](half *dst, const half *src, int rows) {{  // rows x 64 halves, 8 chunks of 16 bytes a row
    for (int c = tid; c < rows * 8; c += 256) cp_async(dst + swz(c >> 3, c & 7), src + (size_t)(c >> 3) * RS + (c & 7) * 8);
  }};
  const int first = max(0, s0 - WINDOW) / 64, last = (s0 + 127) / 64;  // the key blocks that some query of the block sees
  tile(sq, q + (size_t)s0 * RS, 128); tile(sk[0], k + (size_t)first * 64 * RS, 64); tile(sv[0], v + (size_t)first * 64 * RS, 64);
  commit();
  const int q0 = s0 + warp * 16, qr = q0 + (lane >> 2);  // the warp's first query; this lane's rows are qr and qr + 8
  unsigned qf[4][4];
  float o[8][4] = {{}}, l0 = 0.f, l1 = 0.f;
  for (int j = first; j <= last; j++) {{
    const int st = (j - first) & 1;
    if (j < last) {{ tile(sk[st ^ 1], k + (size_t)(j + 1) * 64 * RS, 64); tile(sv[st ^ 1], v + (size_t)(j + 1) * 64 * RS, 64); }}
    commit();
    wait<1>();  // block j (and q) landed, for this thread
    __syncthreads();  // ... and for every thread
    if (j == first) load_rows(qf, sq, warp * 16, lane);
    if (j * 64 <= q0 + 15 && j * 64 + 63 >= q0 - WINDOW) {{  // some of the warp's 16 queries see some of these 64 keys
      float s[8][4] = {{}};
      scores(s, qf, sk[st], lane);
      unsigned p[8][2];  // w = exp(S / sqrt(hd)) in half
      const bool edge = j * 64 + 63 > q0 || j * 64 < q0 + 15 - WINDOW;  // the mask hides some of the warp's (query, key) pairs
      #pragma unroll
      for (int ni = 0; ni < 8; ni++) {{
        const int t = j * 64 + ni * 8 + (lane & 3) * 2;
        float e[4];
        #pragma unroll
        for (int c = 0; c < 4; c++) e[c] = !edge || seen(qr, t, c) ? __expf(s[ni][c] * {SCALE}f) : 0.f;
        p[ni][0] = pack(e[0], e[1]); p[ni][1] = pack(e[2], e[3]);
        const float2 w0 = __half22float2(*(half2 *)&p[ni][0]), w1 = __half22float2(*(half2 *)&p[ni][1]);
        l0 += w0.x + w0.y; l1 += w1.x + w1.y;  // the sums of the rounded weights, which are what multiply v
      }}
      mix(o, p, sv[st], lane);
    }}
    __syncthreads();  // every warp is done with this stage before the next step's copies overwrite it
  }}
  l0 = rowsum(l0); l1 = rowsum(l1);
  if (!(lane & 3)) {{ Z[(size_t)blockIdx.y * T + qr] = 1.f / l0; Z[(size_t)blockIdx.y * T + qr + 8] = 1.f / l1; }}  // for the gradient
  half *out = O + head + (size_t)qr * RS + (lane & 3) * 2;
  #pragma unroll
  for (int ni = 0; ni < 8; ni++) {{
    *(unsigned *)(out + ni * 8) = pack(o[ni][0] / l0, o[ni][1] / l0);
    *(unsigned *)(out + 8 * RS + ni * 8) = pack(o[ni][2] / l1, o[ni][3] / l1);
  }}
}}
"""

# o' - o when the scores move by delta = D k^T (D: the change of q, QDRAW) or q D^T (the change of k), for the local q and k draws.
# Only the small quantities are made in half: with w = exp(S / sqrt(hd)) and e = w (exp(delta / sqrt(hd)) - 1), the moved weights are
# w + e, so o' = (w u + e u) / (Z + B) with Z, B the row sums of w and e, and o' - o = (e u - B o) / (Z + B), o = w u / Z. e and delta
# keep their own relative precision, where o' and o in half would lose it all to the difference. Each warp's 16 queries take both
# products, w u and e u; 4 warps, 64 queries a block, so that two blocks share an SM despite their registers (~180 a thread). q, k and u
# have QB sequences, D and the output one per draw. On the H200, 8 draws of 8 x 2048 tokens took 3.7 ms, where the float32 attention
# on the CUDA cores that it replaces (o' and o each in float32) took 8.7 ms.
SOURCE_DELTA = TILE + r"""
#define QDRAW {QDRAW}
extern "C" __global__ void __launch_bounds__(128) {NAME}(float *__restrict__ O, const half *__restrict__ Q, const half *__restrict__ K,
                                                          const half *__restrict__ V, const half *__restrict__ D) {{
  __shared__ __align__(128) half buf[6 * 64 * 64];  // stage s: k in slot s, D's k in slot 2 + s (k draws), v in slot 4 + s
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int s0 = (gridDim.x - 1 - blockIdx.x) * 64;
  const size_t head = head_of(blockIdx.y);
  const half *q = Q + shared_head(blockIdx.y), *k = K + shared_head(blockIdx.y), *u = V + shared_head(blockIdx.y), *d = D + head;
  auto tile = [&](half *dst, const half *src, int row) {{
    for (int c = tid; c < 64 * 8; c += 128) cp_async(dst + swz(c >> 3, c & 7), src + (size_t)(row + (c >> 3)) * RS + (c & 7) * 8);
  }};
  unsigned qf[4][4], df[4][4];  // the warp's rows of q (and of D, q draws), through the first slots of shared memory
  tile(buf, q, s0);
  if (QDRAW) tile(buf + 4096, d, s0);
  commit(); wait<0>(); __syncthreads();
  load_rows(qf, buf, warp * 16, lane);
  if (QDRAW) load_rows(df, buf + 4096, warp * 16, lane);
  __syncthreads();  // every warp has its rows before the first keys overwrite them
  const int first = max(0, s0 - WINDOW) / 64, last = (s0 + 63) / 64;
  auto stage = [&](int st, int j) {{
    tile(buf + st * 4096, k, j * 64); tile(buf + (4 + st) * 4096, u, j * 64);
    if (!QDRAW) tile(buf + (2 + st) * 4096, d, j * 64);
  }};
  stage(0, first);
  commit();
  const int q0 = s0 + warp * 16, qr = q0 + (lane >> 2);
  float wu[8][4] = {{}}, eu[8][4] = {{}}, z0 = 0.f, z1 = 0.f, b0 = 0.f, b1 = 0.f;
  for (int j = first; j <= last; j++) {{
    const int st = (j - first) & 1;
    if (j < last) stage(st ^ 1, j + 1);
    commit();
    wait<1>();
    __syncthreads();
    if (j * 64 <= q0 + 15 && j * 64 + 63 >= q0 - WINDOW) {{
      float s[8][4] = {{}}, ds[8][4] = {{}};  // S and delta
      scores(s, qf, buf + st * 4096, lane);
      scores(ds, QDRAW ? df : qf, buf + (QDRAW ? st : 2 + st) * 4096, lane);
      unsigned w[8][2], e[8][2];
      #pragma unroll
      for (int ni = 0; ni < 8; ni++) {{
        const int t = j * 64 + ni * 8 + (lane & 3) * 2;
        float wf[4], ef[4];
        #pragma unroll
        for (int c = 0; c < 4; c++) wf[c] = seen(qr, t, c) ? __expf(s[ni][c] * {SCALE}f) : 0.f;
        w[ni][0] = pack(wf[0], wf[1]); w[ni][1] = pack(wf[2], wf[3]);
        const float2 w0 = __half22float2(*(half2 *)&w[ni][0]), w1 = __half22float2(*(half2 *)&w[ni][1]);  // as rounded: what multiplies u
        ef[0] = w0.x * expm1f(ds[ni][0] * {SCALE}f); ef[1] = w0.y * expm1f(ds[ni][1] * {SCALE}f);
        ef[2] = w1.x * expm1f(ds[ni][2] * {SCALE}f); ef[3] = w1.y * expm1f(ds[ni][3] * {SCALE}f);
        e[ni][0] = pack(ef[0], ef[1]); e[ni][1] = pack(ef[2], ef[3]);
        const float2 e0 = __half22float2(*(half2 *)&e[ni][0]), e1 = __half22float2(*(half2 *)&e[ni][1]);
        z0 += w0.x + w0.y; z1 += w1.x + w1.y; b0 += e0.x + e0.y; b1 += e1.x + e1.y;
      }}
      mix(wu, w, buf + (4 + st) * 4096, lane);
      mix(eu, e, buf + (4 + st) * 4096, lane);
    }}
    __syncthreads();
  }}
  z0 = rowsum(z0); z1 = rowsum(z1); b0 = rowsum(b0); b1 = rowsum(b1);
  float *out = O + head + (size_t)qr * RS + (lane & 3) * 2;
  #pragma unroll
  for (int ni = 0; ni < 8; ni++) {{
    *(float2 *)(out + ni * 8) = make_float2((eu[ni][0] - b0 * wu[ni][0] / z0) / (z0 + b0), (eu[ni][1] - b0 * wu[ni][1] / z0) / (z0 + b0));
    *(float2 *)(out + 8 * RS + ni * 8) = make_float2((eu[ni][2] - b1 * wu[ni][2] / z1) / (z1 + b1), (eu[ni][3] - b1 * wu[ni][3] / z1) / (z1 + b1));
  }}
}}
"""

# dq for 64 queries a block (4 warps of 16), and the D of those queries, for SOURCE_DKV: over the key blocks the queries see, dP = do v^T
# (v as the B operand, like k in S = q k^T), dS = w / Z (dP - D) with 1 / Z from the forward, and dq += dS k (k as the B operand, like
# v in o += w v).
SOURCE_DQ = TILE + r"""
extern "C" __global__ void __launch_bounds__(128) {NAME}(half *__restrict__ DQ, float *__restrict__ DS, const half *__restrict__ Q,
    const half *__restrict__ K, const half *__restrict__ V, const half *__restrict__ O, const half *__restrict__ DO, const float *__restrict__ RZ) {{
  __shared__ __align__(128) half buf[4 * 64 * 64];  // q and do at first; then stage s: k in slot s, v in slot 2 + s
  __shared__ float sd[64];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int s0 = (gridDim.x - 1 - blockIdx.x) * 64;  // the longest rows first
  const size_t head = head_of(blockIdx.y), row0 = (size_t)blockIdx.y * T + s0;  // 1 / Z and D are [sequence x head, T]
  const half *k = K + head, *v = V + head;
  auto tile = [&](half *dst, const half *src, int row) {{
    for (int c = tid; c < 64 * 8; c += 128) cp_async(dst + swz(c >> 3, c & 7), src + (size_t)(row + (c >> 3)) * RS + (c & 7) * 8);
  }};
  tile(buf, Q + head, s0); tile(buf + 4096, DO + head, s0);
  commit();
  {{  // D_i = do_i . o_i, two threads a query, 32 values each
    const size_t at = head + (size_t)(s0 + (tid >> 1)) * RS + (tid & 1) * 32;
    float d = 0.f;
    for (int c = 0; c < 4; c++) {{
      const uint4 a = *(const uint4 *)(O + at + c * 8), b = *(const uint4 *)(DO + at + c * 8);
      for (int e = 0; e < 4; e++) {{
        const float2 x = __half22float2(((const half2 *)&a)[e]), y = __half22float2(((const half2 *)&b)[e]);
        d += x.x * y.x + x.y * y.y;
      }}
    }}
    d += __shfl_xor_sync(0xffffffff, d, 1);
    if (!(tid & 1)) {{ sd[tid >> 1] = d; DS[row0 + (tid >> 1)] = d; }}
  }}
  wait<0>(); __syncthreads();
  unsigned qf[4][4], df[4][4];  // the warp's rows of q and do
  load_rows(qf, buf, warp * 16, lane); load_rows(df, buf + 4096, warp * 16, lane);
  const int r0 = warp * 16 + (lane >> 2);  // this lane's rows are r0 and r0 + 8 of the block
  const float d0 = sd[r0], d1 = sd[r0 + 8], rz0 = RZ[row0 + r0], rz1 = RZ[row0 + r0 + 8];
  __syncthreads();  // every warp has its rows before the keys overwrite them
  const int first = max(0, s0 - WINDOW) / 64, last = (s0 + 63) / 64;
  const int q0 = s0 + warp * 16, qr = s0 + r0;
  auto stage = [&](int st, int j) {{ tile(buf + st * 4096, k, j * 64); tile(buf + (2 + st) * 4096, v, j * 64); }};
  float dq[8][4] = {{}};
  stage(0, first);
  commit();
  for (int j = first; j <= last; j++) {{
    const int st = (j - first) & 1;
    if (j < last) stage(st ^ 1, j + 1);
    commit();
    wait<1>();
    __syncthreads();
    if (j * 64 <= q0 + 15 && j * 64 + 63 >= q0 - WINDOW) {{
      float s[8][4] = {{}}, dp[8][4] = {{}};
      scores(s, qf, buf + st * 4096, lane);
      scores(dp, df, buf + (2 + st) * 4096, lane);
      const bool edge = j * 64 + 63 > q0 || j * 64 < q0 + 15 - WINDOW;
      unsigned ds[8][2];
      #pragma unroll
      for (int ni = 0; ni < 8; ni++) {{
        const int t = j * 64 + ni * 8 + (lane & 3) * 2;
        float g[4];
        #pragma unroll
        for (int c = 0; c < 4; c++) {{
          const float w = weight(s[ni][c], !edge || seen(qr, t, c));
          g[c] = c < 2 ? w * rz0 * (dp[ni][c] - d0) : w * rz1 * (dp[ni][c] - d1);
        }}
        ds[ni][0] = pack(g[0], g[1]); ds[ni][1] = pack(g[2], g[3]);
      }}
      mix(dq, ds, buf + st * 4096, lane);
    }}
    __syncthreads();
  }}
  half *out = DQ + head + (size_t)qr * RS + (lane & 3) * 2;
  #pragma unroll
  for (int ni = 0; ni < 8; ni++) {{
    *(unsigned *)(out + ni * 8) = pack(dq[ni][0] * {SCALE}f, dq[ni][1] * {SCALE}f);
    *(unsigned *)(out + 8 * RS + ni * 8) = pack(dq[ni][2] * {SCALE}f, dq[ni][3] * {SCALE}f);
  }}
}}
"""

# dk and dv for 64 keys a block (4 warps of 16), over the blocks of 64 queries that see them: each warp takes S^T = k q^T and
# dP^T = v do^T (q and do as B operands), then dv += P^T do and dk += dS^T q (q and do as B operands the other way, like v in mix)
SOURCE_DKV = TILE + r"""
extern "C" __global__ void __launch_bounds__(128) {NAME}(half *__restrict__ DK, half *__restrict__ DV, const half *__restrict__ Q,
    const half *__restrict__ K, const half *__restrict__ V, const half *__restrict__ DO, const float *__restrict__ RZ,
    const float *__restrict__ DS) {{
  __shared__ __align__(128) half buf[4 * 64 * 64];  // k and v at first; then stage s: q in slot s, do in slot 2 + s
  __shared__ __align__(16) float srz[2][64], sd[2][64];  // the stages' queries' 1 / Z and D
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int t0 = blockIdx.x * 64;  // the first keys, which the most queries see, first
  const size_t head = head_of(blockIdx.y), row0 = (size_t)blockIdx.y * T;
  const half *q = Q + head, *dout = DO + head;
  auto tile = [&](half *dst, const half *src, int row) {{
    for (int c = tid; c < 64 * 8; c += 128) cp_async(dst + swz(c >> 3, c & 7), src + (size_t)(row + (c >> 3)) * RS + (c & 7) * 8);
  }};
  unsigned kf[4][4], vf[4][4];  // the warp's rows of k and v
  tile(buf, K + head, t0); tile(buf + 4096, V + head, t0);
  commit(); wait<0>(); __syncthreads();
  load_rows(kf, buf, warp * 16, lane); load_rows(vf, buf + 4096, warp * 16, lane);
  __syncthreads();
  const int first = t0 / 64, last = min(T - 1, t0 + 63 + WINDOW) / 64;
  auto stage = [&](int st, int j) {{
    tile(buf + st * 4096, q, j * 64); tile(buf + (2 + st) * 4096, dout, j * 64);
    if (tid < 16) cp_async((half *)(srz[st] + 4 * tid), (const half *)(RZ + row0 + j * 64 + 4 * tid));
    else if (tid < 32) cp_async((half *)(sd[st] + 4 * (tid - 16)), (const half *)(DS + row0 + j * 64 + 4 * (tid - 16)));
  }};
  stage(0, first);
  commit();
  const int k0 = t0 + warp * 16, kr = k0 + (lane >> 2);  // the warp's first key; this lane's rows are keys kr and kr + 8
  float dk[8][4] = {{}}, dv[8][4] = {{}};
  for (int j = first; j <= last; j++) {{
    const int st = (j - first) & 1;
    if (j < last) stage(st ^ 1, j + 1);
    commit();
    wait<1>();
    __syncthreads();
    if (j * 64 + 63 >= k0 && j * 64 <= k0 + 15 + WINDOW) {{  // some of these 64 queries see some of the warp's 16 keys
      float s[8][4] = {{}}, dp[8][4] = {{}};
      scores(s, kf, buf + st * 4096, lane);
      scores(dp, vf, buf + (2 + st) * 4096, lane);
      const bool edge = j * 64 < k0 + 15 || j * 64 + 63 > k0 + WINDOW;
      unsigned p[8][2], ds[8][2];
      #pragma unroll
      for (int ni = 0; ni < 8; ni++) {{
        const int i = ni * 8 + (lane & 3) * 2;  // this lane's queries j * 64 + i and the next
        float pf[4], g[4];
        #pragma unroll
        for (int c = 0; c < 4; c++) {{
          const int qi = i + (c & 1), lag = j * 64 + qi - (kr + (c >> 1) * 8);
          pf[c] = weight(s[ni][c], !edge || (lag >= 0 && lag <= WINDOW)) * srz[st][qi];
          g[c] = pf[c] * (dp[ni][c] - sd[st][qi]);
        }}
        p[ni][0] = pack(pf[0], pf[1]); p[ni][1] = pack(pf[2], pf[3]); ds[ni][0] = pack(g[0], g[1]); ds[ni][1] = pack(g[2], g[3]);
      }}
      mix(dv, p, buf + (2 + st) * 4096, lane);
      mix(dk, ds, buf + st * 4096, lane);
    }}
    __syncthreads();
  }}
  const size_t at = head + (size_t)kr * RS + (lane & 3) * 2;
  #pragma unroll
  for (int ni = 0; ni < 8; ni++) {{
    *(unsigned *)(DK + at + ni * 8) = pack(dk[ni][0] * {SCALE}f, dk[ni][1] * {SCALE}f);
    *(unsigned *)(DK + at + 8 * RS + ni * 8) = pack(dk[ni][2] * {SCALE}f, dk[ni][3] * {SCALE}f);
    *(unsigned *)(DV + at + ni * 8) = pack(dv[ni][0], dv[ni][1]);
    *(unsigned *)(DV + at + 8 * RS + ni * 8) = pack(dv[ni][2], dv[ni][3]);
  }}
}}
"""

def fits(q:Tensor, v:Tensor) -> bool:
  """q [QB, T, H, hd] and v [B, T, H, hd]: half, hd = 64, T a multiple of the query block, QB dividing B, on a GPU that runs kernels/cuda.py's."""
  return cuda_kernels(q.device) and q.dtype == v.dtype == dtypes.half and q.shape[-1] == HD and q.shape[1] % BQ == 0 and \
    v.shape[0] % q.shape[0] == 0

def pairs(T:int, window:int) -> int: return sum(min(s, window) + 1 for s in range(T))  # (query, key) pairs under the mask

def flash(q:Tensor, k:Tensor, v:Tensor, window:int) -> Tensor:
  """softmax(q k^T / sqrt(hd) + mask) v for unit-RMS q and k [QB, T, H, 64], v [B, T, H, 64], all half -> [B, T, H, 64] half."""
  (QB, T, H, _), B = q.shape, v.shape[0]
  name = f"flash_{B * H}_{T}_{window}" + (f"_{QB}" if QB != B else "")
  src = SOURCE.format(NAME=name, T=T, WINDOW=window, RS=H * HD, QB=QB, SCALE=repr(1 / math.sqrt(HD)))
  # two matmuls of 2 hd flops a (query, key) pair
  fxn = program(q.device, name, src, (T // BQ, B * H), 256, 5, 4 * HD * B * H * pairs(T, window), 2 * 4 * B * H * T * HD, outs=2)
  out, z = Tensor.empty(B, T, H, HD, dtype=dtypes.half, device=q.device), Tensor.empty(B * H * T, device=q.device)  # z: 1 / the row sums
  return out.custom_kernel(z, q, k, v, fxn=fxn, grad_fxn=grad(window) if QB == B else None)[0]

@functools.cache
def grad(window:int) -> Callable:
  """flash's grad_fxn (for q and k of every sequence, as backprop has them): SOURCE_DQ, then SOURCE_DKV, which reads its D and the forward's 1 / Z."""
  def fxn(do:UOp, call:UOp) -> tuple[UOp|None, ...]:
    o, z, q, k, v = operands(call)
    g, (B, T, H, _), dev = Tensor(do).cast(dtypes.half), q.shape, q.device
    fmt, n = dict(T=T, WINDOW=window, RS=H * HD, QB=B, SCALE=repr(1 / math.sqrt(HD))), B * T * H * HD
    name = f"flash_dq_{B * H}_{T}_{window}"
    fxn = program(dev, name, SOURCE_DQ.format(NAME=name, **fmt), (T // 64, B * H), 128, 8, 6 * HD * B * H * pairs(T, window), 2 * 6 * n, outs=2)
    dq, d = Tensor.empty(B, T, H, HD, dtype=dtypes.half, device=dev).custom_kernel(Tensor.empty(B * H * T, device=dev), q, k, v, o, g, z, fxn=fxn)[:2]
    name = f"flash_dkv_{B * H}_{T}_{window}"
    fxn = program(dev, name, SOURCE_DKV.format(NAME=name, **fmt), (T // 64, B * H), 128, 8, 8 * HD * B * H * pairs(T, window), 2 * 6 * n, outs=2)
    dk, dv = Tensor.empty(B, T, H, HD, dtype=dtypes.half, device=dev).custom_kernel(Tensor.empty(B, T, H, HD, dtype=dtypes.half, device=dev),
                                                                                     q, k, v, g, z, d, fxn=fxn)[:2]
    return None, None, dq.uop, dk.uop, dv.uop
  return fxn

def delta(q:Tensor, k:Tensor, u:Tensor, d:Tensor, moved:str, window:int) -> Tensor:
  """The change o' - o of attention(q, k, u) in float32 when `moved` ("q" or "k") moves by d: q, k [QB, T, H, 64] unit-RMS and u [QB, ...],
  d [B, T, H, 64], all half (SOURCE_DELTA) -> [B, T, H, 64]."""
  (QB, T, H, _), B = q.shape, d.shape[0]
  name = f"flash_delta_{moved}_{B * H}_{T}_{window}_{QB}"
  src = SOURCE_DELTA.format(NAME=name, T=T, WINDOW=window, RS=H * HD, QB=QB, SCALE=repr(1 / math.sqrt(HD)), QDRAW=int(moved == "q"))
  fxn = program(q.device, name, src, (T // 64, B * H), 128, 5, 8 * HD * B * H * pairs(T, window), 2 * 5 * B * H * T * HD)
  return Tensor.empty(B, T, H, HD, dtype=dtypes.float32, device=q.device).custom_kernel(q, k, u, d, fxn=fxn)[0]
