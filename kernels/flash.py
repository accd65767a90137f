"""The causal windowed attention of kernels/attention.py as one CUDA kernel that never writes the T x T weights out (flash attention).

q, k, v and the output are [B, T, H, 64], as the projections lay them out: a head's row of 64 values sits H x 64 values after the
previous token's, and cp.async reads the rows in place. Each block of 256 threads takes 128 queries of one (sequence, head), and walks
the 64-key blocks they can see, [s0 - window, s0 + 128), through a two-stage cp.async pipeline. Each of its 8 warps owns 16 queries:
S = q k^T on the tensor cores, w = exp(S / sqrt(hd)) under the mask, rounded to half, then o += w v with w taken straight from S's
registers (an mma's accumulator layout is the next mma's operand layout, two 8-key tiles to one 16-key step), and the row sums of w
on the side. QK-norm bounds every score by sqrt(hd), so exp needs no running max and nothing is rescaled (kernels/attention.py); the
result is the tensor version's, summed in another order. Key blocks that a warp's queries can't see are skipped, and the mask is
applied only in the blocks that a window edge cuts. hd = 64 only: a 128 x 64 block of q and two stages of 64 x 64 blocks of k and v
fill the 48 KB of static shared memory. A float32 version (SOURCE32), for the Dust draws that take a difference of two attention
outputs, runs on the CUDA cores.
"""
import math
from tinygrad import Tensor, dtypes
from kernels.cuda import available, program

HD, BQ = 64, 128  # head dim, queries per block (of the half kernel; the float32 one takes 64)

SOURCE = r"""
#define T {T}
#define WINDOW {WINDOW}
#define RS {RS}  // the stride of a head's rows: H heads of 64
// a tile row is 64 halves, 8 chunks of 16 bytes; chunk c of row r is stored at c ^ (r & 7): the 8 rows that one ldmatrix phase
// reads, plain or transposed, fall in 8 different 16-byte bank groups
__device__ __forceinline__ int swz(int r, int c) {{ return r * 64 + ((c ^ (r & 7)) << 3); }}

extern "C" __global__ void __launch_bounds__(256) {NAME}(half *__restrict__ O, const half *__restrict__ Q, const half *__restrict__ K,
                                                          const half *__restrict__ V) {{
  __shared__ __align__(128) half sq[128 * 64], sk[2][64 * 64], sv[2][64 * 64];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int s0 = (gridDim.x - 1 - blockIdx.x) * 128;  // the longest rows first: the last blocks to start are the short ones
  const size_t head = ((size_t)(blockIdx.y / (RS / 64)) * T * RS + blockIdx.y % (RS / 64) * 64);  // (sequence, head) of the block
  const half *k = K + head, *v = V + head;
  auto tile = [&](half *dst, const half *src, int rows) {{  // rows x 64 halves, 8 chunks of 16 bytes a row
    for (int c = tid; c < rows * 8; c += 256) cp_async(dst + swz(c >> 3, c & 7), src + (size_t)(c >> 3) * RS + (c & 7) * 8);
  }};
  const int first = max(0, s0 - WINDOW) / 64, last = (s0 + 127) / 64;  // the key blocks that some query of the block sees
  tile(sq, Q + head + (size_t)s0 * RS, 128); tile(sk[0], k + (size_t)first * 64 * RS, 64); tile(sv[0], v + (size_t)first * 64 * RS, 64);
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
    if (j == first)
      for (int kk = 0; kk < 4; kk++) ldsm(qf[kk], sq + swz(warp * 16 + (lane & 15), kk * 2 + (lane >> 4)));
    if (j * 64 <= q0 + 15 && j * 64 + 63 >= q0 - WINDOW) {{  // some of the warp's 16 queries see some of these 64 keys
      float s[8][4] = {{}};
      #pragma unroll
      for (int kk = 0; kk < 4; kk++)  // S = q k^T: 16 queries x 64 keys, over the head dim in steps of 16
        #pragma unroll
        for (int nj = 0; nj < 4; nj++) {{
          unsigned b[4];
          ldsm(b, sk[st] + swz(nj * 16 + (lane & 7) + ((lane >> 4) << 3), kk * 2 + ((lane >> 3) & 1)));
          mma(s[2 * nj], qf[kk], b[0], b[1]); mma(s[2 * nj + 1], qf[kk], b[2], b[3]);
        }}
      unsigned p[8][2];  // w in half: rows qr, qr + 8; keys 8 ni + 2 (lane % 4) and the next
      const bool edge = j * 64 + 63 > q0 || j * 64 < q0 + 15 - WINDOW;  // the mask hides some of the warp's (query, key) pairs
      #pragma unroll
      for (int ni = 0; ni < 8; ni++) {{
        const int t = j * 64 + ni * 8 + (lane & 3) * 2;
        float e[4];
        #pragma unroll
        for (int c = 0; c < 4; c++) {{
          const int lag = qr + (c >> 1) * 8 - (t + (c & 1));
          e[c] = !edge || (lag >= 0 && lag <= WINDOW) ? __expf(s[ni][c] * {SCALE}f) : 0.f;
        }}
        p[ni][0] = pack(e[0], e[1]); p[ni][1] = pack(e[2], e[3]);
        const float2 w0 = __half22float2(*(half2 *)&p[ni][0]), w1 = __half22float2(*(half2 *)&p[ni][1]);
        l0 += w0.x + w0.y; l1 += w1.x + w1.y;  // the sums of the rounded weights, which are what multiply v
      }}
      #pragma unroll
      for (int kk = 0; kk < 4; kk++) {{  // o += w v: 16 queries x 64 dims, over the 64 keys in steps of 16
        const unsigned a[4] = {{p[2 * kk][0], p[2 * kk][1], p[2 * kk + 1][0], p[2 * kk + 1][1]}};
        #pragma unroll
        for (int nj = 0; nj < 4; nj++) {{
          unsigned b[4];
          ldsm_t(b, sv[st] + swz(kk * 16 + (lane & 15), nj * 2 + (lane >> 4)));
          mma(o[2 * nj], a, b[0], b[1]); mma(o[2 * nj + 1], a, b[2], b[3]);
        }}
      }}
    }}
    __syncthreads();  // every warp is done with this stage before the next step's copies overwrite it
  }}
  l0 += __shfl_xor_sync(0xffffffff, l0, 1); l0 += __shfl_xor_sync(0xffffffff, l0, 2);  // the 4 lanes of a row hold its keys
  l1 += __shfl_xor_sync(0xffffffff, l1, 1); l1 += __shfl_xor_sync(0xffffffff, l1, 2);
  half *out = O + head + (size_t)qr * RS + (lane & 3) * 2;
  #pragma unroll
  for (int ni = 0; ni < 8; ni++) {{
    *(unsigned *)(out + ni * 8) = pack(o[ni][0] / l0, o[ni][1] / l0);
    *(unsigned *)(out + 8 * RS + ni * 8) = pack(o[ni][2] / l1, o[ni][3] / l1);
  }}
}}
"""

# float32, for the local q and k draws, whose o' - o is a small difference: no tensor cores. A block takes 64 queries and walks the
# keys in steps of 64; thread (i, j) computes the scores of queries 4i..4i+3 with keys 4j..4j+3, then the output of the same queries
# in dims 4j..4j+3. q and k are stored d-major, so that a thread's 4 queries or 4 keys at one d are one float4: 16 FMAs per 2 reads of
# shared memory (a thread with 2 queries x 4 keys did 8 per 3, and shared memory, not the FMAs, set the pace). The weights take k's
# place once the scores are made.
SOURCE32 = r"""
#define T {T}
#define WINDOW {WINDOW}
#define RS {RS}
extern "C" __global__ void __launch_bounds__(256) {NAME}(float *__restrict__ O, const float *__restrict__ Q, const float *__restrict__ K,
                                                          const float *__restrict__ V) {{
  __shared__ __align__(16) float sqt[64][64], skt[64][64], sv[64][64];  // q, k d-major; v as it is; skt then holds the weights key-major
  const int tid = threadIdx.x, i = tid >> 4, j = tid & 15;
  const int s0 = (gridDim.x - 1 - blockIdx.x) * 64;
  const size_t head = ((size_t)(blockIdx.y / (RS / 64)) * T * RS + blockIdx.y % (RS / 64) * 64);
  auto transposed = [&](float (*dst)[64], const float *src) {{  // 64 rows of 64 -> dst[d][row]; a warp's threads take 32 rows
    for (int c = tid; c < 64 * 16; c += 256) {{
      const int r = c & 63, d = (c >> 6) * 4;
      const float4 x = *(const float4 *)(src + (size_t)r * RS + d);
      dst[d][r] = x.x; dst[d + 1][r] = x.y; dst[d + 2][r] = x.z; dst[d + 3][r] = x.w;
    }}
  }};
  transposed(sqt, Q + head + (size_t)s0 * RS);
  float o[4][4] = {{}}, l[4] = {{}};
  for (int t0 = max(0, s0 - WINDOW) / 64 * 64; t0 < s0 + 64; t0 += 64) {{
    transposed(skt, K + head + (size_t)t0 * RS);
    for (int c = tid; c < 64 * 16; c += 256)
      *(float4 *)&sv[c >> 4][(c & 15) * 4] = *(const float4 *)(V + head + (size_t)(t0 + (c >> 4)) * RS + (c & 15) * 4);
    __syncthreads();
    float s[4][4] = {{}};
    #pragma unroll 8
    for (int d = 0; d < 64; d++) {{
      const float4 q = *(const float4 *)&sqt[d][4 * i], k = *(const float4 *)&skt[d][4 * j];
      const float qa[4] = {{q.x, q.y, q.z, q.w}}, ka[4] = {{k.x, k.y, k.z, k.w}};
      #pragma unroll
      for (int a = 0; a < 4; a++)
        #pragma unroll
        for (int b = 0; b < 4; b++) s[a][b] += qa[a] * ka[b];
    }}
    __syncthreads();  // every thread is done with k: skt takes the weights
    #pragma unroll
    for (int b = 0; b < 4; b++) {{
      float e[4];
      #pragma unroll
      for (int a = 0; a < 4; a++) {{
        const int lag = s0 + 4 * i + a - (t0 + 4 * j + b);
        e[a] = lag >= 0 && lag <= WINDOW ? expf(s[a][b] * {SCALE}f) : 0.f;
        l[a] += e[a];
      }}
      *(float4 *)&skt[4 * j + b][4 * i] = make_float4(e[0], e[1], e[2], e[3]);
    }}
    __syncthreads();
    #pragma unroll 8
    for (int t = 0; t < 64; t++) {{
      const float4 w = *(const float4 *)&skt[t][4 * i], v = *(const float4 *)&sv[t][4 * j];
      const float wa[4] = {{w.x, w.y, w.z, w.w}}, va[4] = {{v.x, v.y, v.z, v.w}};
      #pragma unroll
      for (int a = 0; a < 4; a++)
        #pragma unroll
        for (int b = 0; b < 4; b++) o[a][b] += wa[a] * va[b];
    }}
    __syncthreads();  // everyone is done with this step's weights and v before the next step's overwrite them
  }}
  #pragma unroll
  for (int a = 0; a < 4; a++) {{
    for (int m = 1; m < 16; m <<= 1) l[a] += __shfl_xor_sync(0xffffffff, l[a], m);  // the 16 lanes j of query 4i + a hold its keys
    *(float4 *)(O + head + (size_t)(s0 + 4 * i + a) * RS + 4 * j) = make_float4(o[a][0] / l[a], o[a][1] / l[a], o[a][2] / l[a], o[a][3] / l[a]);
  }}
}}
"""

def fits(q:Tensor, v:Tensor) -> bool:
  """q, v [B, T, H, hd]: both half, or both float32, hd = 64, T a multiple of the query block, on a GPU that runs kernels/cuda.py's."""
  return available(q.device) and q.dtype == v.dtype and q.dtype in (dtypes.half, dtypes.float32) and q.shape[-1] == HD and \
    q.shape[1] % BQ == 0

def flash(q:Tensor, k:Tensor, v:Tensor, window:int) -> Tensor:
  """softmax(q k^T / sqrt(hd) + mask) v for unit-RMS q and k, [B, T, H, 64] each, half or float32 -> [B, T, H, 64] in their dtype."""
  B, T, H, _ = q.shape
  half = q.dtype == dtypes.half
  name = f"flash_{B * H}_{T}_{window}" + ("" if half else "_f32")
  src = (SOURCE if half else SOURCE32).format(NAME=name, T=T, WINDOW=window, RS=H * HD, SCALE=repr(1 / math.sqrt(HD)))
  seen = sum(min(s, window) + 1 for s in range(T))  # (query, key) pairs under the mask: two matmuls of 2 hd flops each
  fxn = program(q.device, name, src, (T // (BQ if half else 64), B * H), 256, 4, 4 * HD * B * H * seen, q.dtype.itemsize * 4 * B * H * T * HD)
  return Tensor.empty(B, T, H, HD, dtype=q.dtype, device=q.device).custom_kernel(q, k, v, fxn=fxn)[0]
