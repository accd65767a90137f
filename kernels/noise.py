"""Counter-based noise: a pure function of (key, index), never stored.

A key is a uint32 tensor of shape (..., 2). The noise at flat index i is threefry-2x32-20(key, counter=(i, 0)), the
generator of Salmon et al. (2011) that JAX and tinygrad use too. Because it is a function and not a state, the same
(key, shape) gives the same numbers on every backend and every call, so noise can be regenerated wherever it is needed
(the perturbed forward, the update) instead of being kept in memory. Everything here is a lazy tinygrad expression:
the consumer kernel computes the noise in its own loop.

Child keys come from `fold`, on counters (d, 1): the data stream only ever uses counters (i, 0), so the two never meet.
"""
import functools, math
from math import prod
import numpy as np
from tinygrad import Tensor, dtypes
from kernels import native_sin
import engine

def key(seed:int) -> Tensor:
  """The root key of an integer seed, realized: pass it to a TinyJit as an input, so a new seed never recompiles."""
  return engine.tensor(np.array([seed & 0xffffffff, (seed >> 32) & 0xffffffff], np.uint32))

def _k64(key:Tensor) -> Tensor: return (key[..., 1].cast(dtypes.uint64) << 32) | key[..., 0].cast(dtypes.uint64)
def _words(x:Tensor) -> Tensor: return Tensor.stack(x.cast(dtypes.uint32), (x >> 32).cast(dtypes.uint32), dim=-1)

def fold(key:Tensor, *data:int|Tensor) -> Tensor:
  """Child key of `key` for each integer in `data`, applied in turn: fold(k, step, member) is a key per (step, member).
  A tensor of ints gives a batch of keys: fold(k, Tensor.arange(n)) has shape (n, 2). An int is data of the kernels, not
  a constant of them, so that the noises of one shape (every parameter's, every site's) share their compiled kernels."""
  for d in data:
    ctr = (d if isinstance(d, Tensor) else engine.scalar(d, np.uint32, key.device)).cast(dtypes.uint64) | (1 << 32)
    k = _k64(key)
    key = _words(ctr.reshape(ctr.shape + (1,)*k.ndim).expand(ctr.shape + k.shape).threefry(k.expand(ctr.shape + k.shape)))
  return key

def bits(key:Tensor, shape:tuple[int, ...]) -> Tensor:
  """Raw threefry output as uint64 (hi word << 32 | lo word), shape key.shape[:-1] + shape."""
  batch, n = key.shape[:-1], prod(shape)
  ctr = Tensor.arange(n, dtype=dtypes.uint32).cast(dtypes.uint64).reshape((1,)*len(batch) + (n,)).expand(batch + (n,))
  return ctr.threefry(_k64(key).reshape(batch + (1,)).expand(batch + (n,))).reshape(batch + tuple(shape))

def _uniform(w:Tensor) -> Tensor:  # uint32 -> float32 in [0, 1): the top 23 bits become the mantissa of a number in [1, 2)
  return ((w >> 9) | 0x3f800000).bitcast(dtypes.float32) - 1.0

# sin and cos on [0, pi/2] by their Taylor series to x^11 and x^12, Horner in x^2: the first term left out is below 6e-8, float32's rounding
SIN, COS = [(-1) ** i / math.factorial(2 * i + 1) for i in range(6)], [(-1) ** i / math.factorial(2 * i) for i in range(7)]
def _horner(x2:Tensor, coefs:list[float]) -> Tensor: return functools.reduce(lambda acc, c: x2 * acc + c, reversed(coefs[:-1]), coefs[-1])

def cos_turn(w:Tensor) -> Tensor:
  """cos(2 pi u) for the uniform u = _uniform(w) of a uint32 word. A backend with a sin of its own (CUDA, Metal, AMD) takes it
  (kernels/__init__.py's table). For the others (the CPU) tinygrad renders a software sin whose range reduction was 2/3 of a
  Gaussian's time: there, w's top 2 bits are the quadrant q = floor(4u), phi = (4u - q) pi/2 the angle within it (both exact),
  and cos(q pi/2 + phi) is +-cos or +-sin of phi, short polynomials on [0, pi/2). The two agree to float32 rounding."""
  u = _uniform(w)
  if native_sin(w.device): return (u * (2 * math.pi)).cos()
  q = w >> 30
  phi = (u * 4 - q.cast(dtypes.float32)) * (math.pi / 2)
  x2 = phi * phi
  # quadrant q: cos(q pi/2 + phi) is cos phi, -sin phi, -cos phi, sin phi
  return ((q & 1) == 1).where(phi * _horner(x2, SIN), _horner(x2, COS)) * (1 - ((q + 1) & 2).cast(dtypes.float32))

def gaussian(key:Tensor, shape:tuple[int, ...], dtype=dtypes.float32) -> Tensor:
  """N(0, 1) by Box-Muller, four values from each threefry call: each of its two words w gives the pair r (cos t, sin t), with
  r = sqrt(-2 ln(1 - u1)), u1 the low 16 bits of w, and t = 2 pi u2, u2 its high 16 bits. The generator's 20 rounds are most of a
  value's cost, and a fourth of a call is enough: the two outputs of Box-Muller are independent Gaussians, and 16-bit uniforms only
  cut the tails at r = sqrt(32 ln 2) = 4.71 (probability 2.5e-6) and quantize the angle to 2^-16 of a turn."""
  batch, n = key.shape[:-1], prod(shape)
  b = bits(key, ((n + 3) // 4,))
  w = Tensor.stack(b.cast(dtypes.uint32), (b >> 32).cast(dtypes.uint32), dim=-1)
  r = ((1.0 - _uniform(w << 16)).log() * -2.0).sqrt()
  t = w & 0xffff0000  # sin(t) = cos(t - pi/2): a quarter turn back is 3/4 of one forward, modulo 2^32
  z = Tensor.stack(r * cos_turn(t), r * cos_turn(t + 0xc0000000), dim=-1).reshape(batch + (-1,))
  return (z if z.shape[-1] == n else z[..., :n]).reshape(batch + tuple(shape)).cast(dtype)

def rademacher(key:Tensor, shape:tuple[int, ...], dtype=dtypes.float32) -> Tensor:
  """+-1 with equal probability: the top bit of the low word. No transcendentals, so it fuses into a matmul for free."""
  return ((bits(key, shape).cast(dtypes.uint32) >> 31).cast(dtype) * 2 - 1)

NOISES = {"gaussian": gaussian, "rademacher": rademacher}  # Dust's jitter (--noise): both have mean 0 and variance 1

def runs(key:Tensor, shape:tuple[int, ...], noise:str="gaussian") -> Tensor:
  """Noise of `shape` whose first axis is split into equal runs, one per key (key [2]: one run; [G, 2]: G runs), each run the noise
  of its key alone: G chunks of draws batched into one pass draw what each would draw by itself."""
  G = prod(key.shape[:-1])
  return NOISES[noise](key, (shape[0] // G, *shape[1:])).reshape(shape)
