"""The causal windowed attention of kernels/attention.py as one CUDA kernel that never writes the T x T weights out (flash attention).

Each block of 256 threads takes 128 queries of one (sequence, head), and walks the 64-key blocks they can see, [s0 - window, s0 + 128),
through a two-stage cp.async pipeline. Each of its 8 warps owns 16 queries: S = q k^T on the tensor cores, w = exp(S / sqrt(hd)) under
the mask, rounded to half, then o += w v with w taken straight from S's registers (an mma's accumulator layout is the next mma's
operand layout, two 8-key tiles to one 16-key step), and the row sums of w on the side. QK-norm bounds every score by sqrt(hd), so
exp needs no running max and nothing is rescaled (kernels/attention.py); the result is the tensor version's, summed in another order.
Key blocks that a warp's queries can't see are skipped. hd = 64 only: a 128 x 64 block of q and two stages of 64 x 64 blocks of k and
v fill the 48 KB of static shared memory. A float32 version (SOURCE32), for the Dust draws that take a difference of two attention
outputs, runs on the CUDA cores.
"""
import math
from tinygrad import Tensor, dtypes
from kernels.cuda import available, program

HD, BQ = 64, 128  # head dim, queries per block (of the half kernel; the float32 one takes 64)

SOURCE = r"""
#define T {T}
#define WINDOW {WINDOW}
// a tile row is 64 halves, 8 chunks of 16 bytes; chunk c of row r is stored at c ^ (r & 7): the 8 rows that one ldmatrix phase
// reads, plain or transposed, fall in 8 different 16-byte bank groups
__device__ __forceinline__ int swz(int r, int c) {{ return r * 64 + ((c ^ (r & 7)) << 3); }}

extern "C" __global__ void __launch_bounds__(256) {NAME}(half *__restrict__ O, const half *__restrict__ Q, const half *__restrict__ K,
                                                          const half *__restrict__ V) {{
  __shared__ __align__(128) half sq[128 * 64], sk[2][64 * 64], sv[2][64 * 64];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int s0 = (gridDim.x - 1 - blockIdx.x) * 128;  // the longest rows first: the last blocks to start are the short ones
  const size_t head = (size_t)blockIdx.y * T * 64;
  const half *k = K + head, *v = V + head;
  auto tile = [&](half *dst, const half *src, int rows) {{  // rows x 64 halves, 8 chunks of 16 bytes a row
    for (int c = tid; c < rows * 8; c += 256) cp_async(dst + swz(c >> 3, c & 7), src + (size_t)(c >> 3) * 64 + (c & 7) * 8);
  }};
  const int first = max(0, s0 - WINDOW) / 64, last = (s0 + 127) / 64;  // the key blocks that some query of the block sees
  tile(sq, Q + head + (size_t)s0 * 64, 128); tile(sk[0], k + (size_t)first * 4096, 64); tile(sv[0], v + (size_t)first * 4096, 64);
  commit();
  const int q0 = s0 + warp * 16, qr = q0 + (lane >> 2);  // the warp's first query; this lane's rows are qr and qr + 8
  unsigned qf[4][4];
  float o[8][4] = {{}}, l0 = 0.f, l1 = 0.f;
  for (int j = first; j <= last; j++) {{
    const int st = (j - first) & 1;
    if (j < last) {{ tile(sk[st ^ 1], k + (size_t)(j + 1) * 4096, 64); tile(sv[st ^ 1], v + (size_t)(j + 1) * 4096, 64); }}
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
      #pragma unroll
      for (int ni = 0; ni < 8; ni++) {{
        const int t = j * 64 + ni * 8 + (lane & 3) * 2;
        float e[4];
        #pragma unroll
        for (int c = 0; c < 4; c++) {{
          const int lag = qr + (c >> 1) * 8 - (t + (c & 1));
          e[c] = lag >= 0 && lag <= WINDOW ? __expf(s[ni][c] * {SCALE}f) : 0.f;
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
  half *out = O + head + (size_t)qr * 64 + (lane & 3) * 2;
  #pragma unroll
  for (int ni = 0; ni < 8; ni++) {{
    *(unsigned *)(out + ni * 8) = pack(o[ni][0] / l0, o[ni][1] / l0);
    *(unsigned *)(out + 8 * 64 + ni * 8) = pack(o[ni][2] / l1, o[ni][3] / l1);
  }}
}}
"""

# float32, for the local q and k draws, whose o' - o is a small difference: no tensor cores, a thread computes 2 queries x 4 keys of
# the scores and 2 queries x 8 dims of the output per 32-key step, reading q, k (transposed) and v from shared memory
SOURCE32 = r"""
#define T {T}
#define WINDOW {WINDOW}
extern "C" __global__ void __launch_bounds__(256) {NAME}(float *__restrict__ O, const float *__restrict__ Q, const float *__restrict__ K,
                                                          const float *__restrict__ V) {{
  __shared__ __align__(16) float sq[64][65], skt[64][36], sv[32][64], sp[64][36];  // padded so that a warp's reads hit 32 banks
  const int tid = threadIdx.x, tx = tid & 7, r0 = (tid >> 3) * 2;  // rows r0, r0 + 1; keys 4 tx..4 tx + 3; dims 8 tx..8 tx + 7
  const int s0 = (gridDim.x - 1 - blockIdx.x) * 64;
  const size_t head = (size_t)blockIdx.y * T * 64;
  for (int c = tid; c < 64 * 16; c += 256) {{
    const float4 x = *(const float4 *)(Q + head + (size_t)(s0 + (c >> 4)) * 64 + (c & 15) * 4);
    sq[c >> 4][(c & 15) * 4] = x.x; sq[c >> 4][(c & 15) * 4 + 1] = x.y; sq[c >> 4][(c & 15) * 4 + 2] = x.z; sq[c >> 4][(c & 15) * 4 + 3] = x.w;
  }}
  float o[2][8] = {{}}, l[2] = {{}};
  for (int j = max(0, s0 - WINDOW) / 32; j <= (s0 + 63) / 32; j++) {{
    for (int c = tid; c < 32 * 16; c += 256) {{  // k transposed, v as it is
      const size_t at = head + (size_t)(j * 32 + (c >> 4)) * 64 + (c & 15) * 4;
      const float4 x = *(const float4 *)(K + at);
      skt[(c & 15) * 4][c >> 4] = x.x; skt[(c & 15) * 4 + 1][c >> 4] = x.y; skt[(c & 15) * 4 + 2][c >> 4] = x.z; skt[(c & 15) * 4 + 3][c >> 4] = x.w;
      *(float4 *)&sv[c >> 4][(c & 15) * 4] = *(const float4 *)(V + at);
    }}
    __syncthreads();
    float s[2][4] = {{}};
    for (int d = 0; d < 64; d++) {{
      const float4 k4 = *(const float4 *)&skt[d][tx * 4];
      const float q0 = sq[r0][d], q1 = sq[r0 + 1][d];
      s[0][0] += q0 * k4.x; s[0][1] += q0 * k4.y; s[0][2] += q0 * k4.z; s[0][3] += q0 * k4.w;
      s[1][0] += q1 * k4.x; s[1][1] += q1 * k4.y; s[1][2] += q1 * k4.z; s[1][3] += q1 * k4.w;
    }}
    for (int a = 0; a < 2; a++) {{
      float e[4];
      for (int b = 0; b < 4; b++) {{
        const int lag = s0 + r0 + a - (j * 32 + tx * 4 + b);
        e[b] = lag >= 0 && lag <= WINDOW ? expf(s[a][b] * {SCALE}f) : 0.f;
        l[a] += e[b];
      }}
      *(float4 *)&sp[r0 + a][tx * 4] = make_float4(e[0], e[1], e[2], e[3]);
    }}
    __syncthreads();
    for (int t = 0; t < 32; t++) {{
      const float p0 = sp[r0][t], p1 = sp[r0 + 1][t];
      const float4 va = *(const float4 *)&sv[t][tx * 8], vb = *(const float4 *)&sv[t][tx * 8 + 4];
      const float v[8] = {{va.x, va.y, va.z, va.w, vb.x, vb.y, vb.z, vb.w}};
      for (int c = 0; c < 8; c++) {{ o[0][c] += p0 * v[c]; o[1][c] += p1 * v[c]; }}
    }}
    __syncthreads();  // everyone is done with this step's k, v and weights before the next step's overwrite them
  }}
  for (int a = 0; a < 2; a++) {{
    for (int m = 1; m < 8; m <<= 1) l[a] += __shfl_xor_sync(0xffffffff, l[a], m);  // the 8 lanes of a row hold its keys
    float *out = O + head + (size_t)(s0 + r0 + a) * 64 + tx * 8;
    *(float4 *)out = make_float4(o[a][0] / l[a], o[a][1] / l[a], o[a][2] / l[a], o[a][3] / l[a]);
    *(float4 *)(out + 4) = make_float4(o[a][4] / l[a], o[a][5] / l[a], o[a][6] / l[a], o[a][7] / l[a]);
  }}
}}
"""

def fits(q:Tensor, v:Tensor) -> bool:
  """q, v [B, H, T, hd]: both half, or both float32, hd = 64, T a multiple of the query block, on a GPU that runs kernels/cuda.py's."""
  return available(q.device) and q.dtype == v.dtype and q.dtype in (dtypes.half, dtypes.float32) and q.shape[-1] == HD and \
    q.shape[2] % BQ == 0

def flash(q:Tensor, k:Tensor, v:Tensor, window:int) -> Tensor:
  """softmax(q k^T / sqrt(hd) + mask) v for unit-RMS q and k, [B, H, T, 64] each, half or float32 -> [B, H, T, 64] in their dtype."""
  B, H, T, _ = q.shape
  half = q.dtype == dtypes.half
  name = f"flash_{B * H}_{T}_{window}" + ("" if half else "_f32")
  src = (SOURCE if half else SOURCE32).format(NAME=name, T=T, WINDOW=window, SCALE=repr(1 / math.sqrt(HD)))
  seen = sum(min(s, window) + 1 for s in range(T))  # (query, key) pairs under the mask: two matmuls of 2 hd flops each
  fxn = program(q.device, name, src, (T // (BQ if half else 64), B * H), 256, 4, 4 * HD * B * H * seen, q.dtype.itemsize * 4 * B * H * T * HD)
  return Tensor.empty(B, H, T, HD, dtype=q.dtype, device=q.device).custom_kernel(q, k, v, fxn=fxn)[0]
