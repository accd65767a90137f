"""A site's jitter y = x + sigma z, z the Gaussian noise of kernels/noise.py (`runs`), and on NVIDIA GPUs that as a CUDA kernel.

tinygrad 0.14 writes such an elementwise pass with blocks of 32 threads, and on the H200 those run at a sixth of the memory's rate
whatever they compute: the jitter cost as much as a pass that adds a constant (docs/performance.md). This kernel gives each of 256
threads 8 values, two threefry calls: on the H200 a [16384, 2048] jitter takes 45.5 us, where tinygrad's pass of x + 0.2 takes 158.6.
Its noise is kernels/noise.py's gaussian, computed with CUDA's own functions: the threefry words are the same bits, the Gaussians agree
to float32 rounding, and the sum is rounded to half as tinygrad's half addition rounds it.
"""
from tinygrad import Tensor, dtypes
from kernels import cuda_kernels
from kernels.cuda import program
from kernels.noise import runs

NOISE = r"""
// threefry-2x32-20 at counter (c, 0), as tinygrad's THREEFRY: the key schedule (k1, k0 ^ k1 ^ C240, k0) and injection i + 1
__device__ __forceinline__ uint2 threefry(unsigned c, unsigned k0, unsigned k1) {
  const unsigned ks[3] = {k1, k0 ^ k1 ^ 0x1BD11BDAu, k0};
  constexpr int R[2][4] = {{13, 15, 26, 6}, {17, 29, 16, 24}};
  unsigned x0 = c + k0, x1 = k1;
  #pragma unroll
  for (int i = 0; i < 5; i++) {
    #pragma unroll
    for (int j = 0; j < 4; j++) { x0 += x1; x1 = __funnelshift_l(x1, x1, R[i & 1][j]) ^ x0; }
    x0 += ks[i % 3]; x1 += ks[(i + 1) % 3] + i + 1;
  }
  return make_uint2(x0, x1);
}
// Box-Muller on one word: r (cos t, sin t), u1 its low 16 bits, t = 2 pi u2 with u2 its high 16 bits. The hardware's approximate
// log2 and sincos (SFU, 2^-21 absolute error) are far below the half that the sum is rounded to; sincos is accurate on [-pi, pi],
// so it takes t - pi, which negates both
__device__ __forceinline__ float2 pair(unsigned w) {
  const float r = sqrtf(__log2f(1.f - (float)(w & 0xffffu) * (1.f / 65536.f)) * 0.6931471805599453f * -2.f);
  float s, c;
  __sincosf((float)(w >> 16) * (6.283185307179586f / 65536.f) - 3.141592653589793f, &s, &c);
  return make_float2(-r * c, -r * s);
}
// h (two halves) plus sigma times the pair of word w, rounded as tinygrad's half addition rounds it
__device__ __forceinline__ unsigned jittered(unsigned h, unsigned w, float sigma) {
  const float2 z = pair(w);
  const half2 y = __hadd2(*(half2 *)&h, __floats2half2_rn(sigma * z.x, sigma * z.y));
  return *(const unsigned *)&y;
}
"""

SOURCE = r"""
#define RUN {RUN}  // values of one key's run
{NOISE}
extern "C" __global__ void __launch_bounds__(256) {NAME}(half *__restrict__ Y, const half *__restrict__ X, const unsigned *__restrict__ key) {{
  const size_t f = ((size_t)blockIdx.x * 256 + threadIdx.x) * 8;  // this thread's 8 values: 2 threefry calls of its run's key
  const unsigned *k = key + f / RUN * 2, c = (unsigned)(f % RUN) / 4;
  uint4 v = *(const uint4 *)(X + f);
  unsigned *h = (unsigned *)&v;
  #pragma unroll
  for (int j = 0; j < 2; j++) {{
    const uint2 w = threefry(c + j, k[0], k[1]);
    h[2 * j] = jittered(h[2 * j], w.x, {SIGMA});
    h[2 * j + 1] = jittered(h[2 * j + 1], w.y, {SIGMA});
  }}
  *(uint4 *)(Y + f) = v;
}}
"""

def parts(key:Tensor) -> int: return key.shape[0] if key.ndim == 2 else 1  # the runs of a key [2] or [G, 2]

def literal(sigma:float) -> str: return repr(float(sigma)) + "f"  # sigma in the source: each scale compiles its own kernels
def tag(key:Tensor, sigma:float) -> str: return f"{parts(key)}_" + literal(sigma)[:-1].replace(".", "p").replace("-", "m")  # in a name

def jitter(x:Tensor, key:Tensor, sigma:float, noise:str="gaussian") -> Tensor:
  """x + sigma * runs(key, x.shape, noise) in x's dtype, written once (it is never recomputed inside the consumer's matmul loops).
  key [2], or [G, 2]: G runs along the first axis. The kernel takes half x, Gaussian noise, and runs of 8 values and blocks of 2048."""
  G, n = parts(key), x.numel()
  if not (cuda_kernels(x.device) and x.dtype == dtypes.half and noise == "gaussian" and n % 2048 == 0 and n // G % 8 == 0):
    return (x + (sigma * runs(key, x.shape, noise)).cast(x.dtype)).contiguous()
  name = f"jitter_{n}_{tag(key, sigma)}"
  fxn = program(x.device, name, SOURCE.format(NAME=name, NOISE=NOISE, RUN=n // G, SIGMA=literal(sigma)), (n // 2048,), 256, 3, 40 * n, 4 * n)
  return Tensor.empty(*x.shape, dtype=dtypes.half, device=x.device).custom_kernel(x, key.cast(dtypes.uint32), fxn=fxn)[0]
