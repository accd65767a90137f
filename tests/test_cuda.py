"""kernels/cuda.py's kernels compile for an H200 and are chosen where they run, and backprop's graph takes each one's gradient once:
on tinygrad's NULL device, compiled but not run, so no GPU is needed. Their numerics are tested on the GPU machine:
test_matmul.test_kernel, test_attention.test_flash, test_loss, test_qk_norm and test_norm here, and tests/test_backprop.py."""
import importlib.util, os, pathlib, subprocess, sys
from collections import Counter
import numpy as np
import pytest
from tinygrad import Tensor, dtypes
from kernels.loss import fits, softcapped_loss
from kernels.norm import norm, qk_norm

ROOT = pathlib.Path(__file__).resolve().parent.parent

CHOSEN = """
from tinygrad import Context, Device, Tensor, dtypes
from kernels import loss
from kernels.attention import attention
from kernels.flash import delta, fits, flash
from kernels.matmul import linear, tuned, wgmma
from kernels.norm import norm, qk_norm
assert wgmma(Device.DEFAULT)  # an H200: the GEMMs below are wgmma's
for M, N, K in ((128, 512, 512), (128, 2048, 512), (128, 512, 2048), (128, 4096, 512)):  # the dust preset's linear layers, few tokens
  x, w = Tensor.empty(1, M, K, dtype=dtypes.half), Tensor.empty(N, K)
  assert tuned(x, w)
  for act in (None, "relu2"): assert linear(x, w, act).realize().shape == (1, M, N)  # NVRTC compiles the CUDA source
  with Context(CUDA_KERNELS=0): assert not tuned(x, w)
xg, wg = Tensor.empty(2, 128, 512, dtype=dtypes.half), Tensor.empty(2, 512, 512)  # a weight per member of a population, 128 rows each
assert tuned(xg, wg) and linear(xg, wg, "relu2").realize().shape == (2, 128, 512) and not tuned(xg, Tensor.empty(3, 512, 512))
assert not tuned(Tensor.empty(128, 32, dtype=dtypes.half), Tensor.empty(8, 32))  # the value-embedding gate: N = 8 doesn't divide
assert not tuned(Tensor.empty(64, 512, dtype=dtypes.half), Tensor.empty(512, 512))  # too few tokens for the tile
assert not tuned(Tensor.empty(128, 128), Tensor.empty(128, 128))                  # float32
q = Tensor.empty(1, 2048, 8, 64, dtype=dtypes.half)
assert fits(q, q) and not fits(q.float(), q.float()) and not fits(q, q.float()) and not fits(q[..., :32], q[..., :32])
assert not fits(q[:, :100], q[:, :100]) and fits(q, q.repeat(8, 1, 1, 1)) and not fits(q.repeat(3, 1, 1, 1), q.repeat(8, 1, 1, 1))
d = q.repeat(8, 1, 1, 1)  # a Dust chunk's 8 draws of one sequence
for W in (1024, 2048):  # the dust preset's two windows; the draws' kernels, q, k (and u) shared by the draws
  assert attention(q, q, q, W).realize().shape == q.shape and flash(q, q, d, W).realize().shape == d.shape
  for moved in ("q", "k"): assert delta(q, q, q, d, moved, W).realize().shape == d.shape
cos = Tensor.empty(2048, 1, 32)
for t, dt in ((q, dtypes.half), (q.float(), dtypes.float32)): assert qk_norm(t, cos, cos, dt).realize().shape == q.shape
x = Tensor.empty(8, 2048, 512)
for y in (None, x.half()): assert norm(x, dtypes.half, y).realize().shape == x.shape
z, y = Tensor.empty(8, 16, 4096, dtype=dtypes.half), Tensor.empty(8, 16, dtype=dtypes.int32)
assert loss.fits(z, 15.0) and not loss.fits(z.float(), 15.0) and not loss.fits(z[..., :100], 15.0) and not loss.fits(z[:1, :3], 15.0)
assert not loss.fits(z, 75.0)  # 4096 e^75 overflows float32
assert loss.softcapped_loss(z, y, 15.0).realize().shape == (8, 16)
print("chosen", tuned(Tensor.empty(128, 512, dtype=dtypes.half), Tensor.empty(512, 512)), fits(q, q), loss.fits(z, 15.0))
"""
ASKED = """
from tinygrad import Tensor, dtypes
from kernels import loss
from kernels.flash import fits
from kernels.matmul import tuned
from kernels.norm import norm_fits, qk_fits
q, z = Tensor.empty(1, 2048, 8, 64, dtype=dtypes.half), Tensor.empty(8, 16, 4096, dtype=dtypes.half)  # shapes the kernels take
x = Tensor.empty(8, 2048, 512)
print("chosen", tuned(Tensor.empty(128, 512, dtype=dtypes.half), Tensor.empty(512, 512)), fits(q, q), loss.fits(z, 15.0), qk_fits(q, q.dtype),
      norm_fits(x, dtypes.half))
"""
LATER = """
from tinygrad import Device, Tensor, dtypes
from kernels.matmul import linear, tuned, wgmma
x, w = Tensor.empty(128, 512, dtype=dtypes.half), Tensor.empty(512, 512)
print(wgmma(Device.DEFAULT), tuned(x, w), linear(x, w).realize().shape)
"""

BACKWARD = """
from collections import Counter
import numpy as np
from tinygrad import Device, Tensor, dtypes
from tinygrad.uop.ops import Ops
from model import GPT, GPTConfig
import estimators
model = GPT(GPTConfig.preset("small", n_layer=2), dtype=dtypes.half)  # windows 128 and 256, value embeddings on block 1
x = Tensor(np.zeros((8, 256), np.int32)).realize()
loss, g = estimators.gradient(model, x, x)
programs = [c.src[0] for c in loss.schedule_linear(*g).src if c.src[0].op is Ops.PROGRAM]
compiler = Device[Device.DEFAULT].renderer.compiler  # on Hopper for sm_90a (wgmma), as tinygrad's workers compile it
for p in programs: compiler.compile(p.src[2].arg)  # every kernel's CUDA source (schedule_linear compiles none)
print(sorted(Counter("_".join(w for w in p.arg.name.split("_") if not w.isdigit()) for p in programs).items()))
"""

JITTERED = """
from collections import Counter
import numpy as np
from tinygrad import Device, Tensor, dtypes
from tinygrad.uop.ops import Ops
from kernels.noise import fold, key
from model import GPT, GPTConfig
model = GPT(GPTConfig.preset("small", n_layer=2), dtype=dtypes.half)
x, ks = Tensor(np.zeros((8, 256), np.int32)).realize(), fold(key(1), Tensor.arange(2)).contiguous().realize()  # 2 runs of 4 sequences
sites = ["transformer.wte", "o@0", "o@1"] + [f"transformer.h.{l}.{s}" for l in range(2) for s in ("attn.c_proj", "mlp.c_fc", "mlp.c_proj")]
programs = [c.src[0] for c in model.losses(x, x, {s: (ks, 0.1) for s in sites}).schedule_linear().src if c.src[0].op is Ops.PROGRAM]
for p in programs: Device[Device.DEFAULT].renderer.compiler.compile(p.src[2].arg)  # every kernel's CUDA source (schedule_linear compiles none)
print(sorted(Counter("jittered gemm" if p.arg.name.endswith("_j2_0p1") else "jitter" if p.arg.name.startswith("jitter_") else
                     "tinygrad threefry" if "466688986" in p.src[2].arg else "other" for p in programs).items()))
"""

UPDATE = """
import contextlib, io, re
from collections import Counter
from tinygrad import Context, Device, Tensor, dtypes
from kernels.cuda import PRELUDE
from kernels.sgd import source
from model import GPT, GPTConfig
from registry import ESTIMATORS
import estimators, optim  # noqa: F401  estimators registers backprop
model = GPT(GPTConfig.preset("small", n_layer=2), dtype=dtypes.half)
d = ESTIMATORS["backprop"].defaults_for(ESTIMATORS["backprop"].run(model, 1))
opt = optim.Optimizer(model.params, optim.learning_rates(model.params, d, None), "sgd", d.momentum, 0)
buf, scale, out = Tensor.zeros(model.num_params()).contiguous().realize(), Tensor([1.0]).realize(), io.StringIO()
with contextlib.redirect_stdout(out), Context(DEBUG=2): optim.flat_update(opt, buf, scale)
Device[Device.DEFAULT].renderer.compiler.compile(PRELUDE + source("sgd", [3000, 5], [3, 3003], [1, 0], 0.98))  # the NULL device compiles none
names = [re.sub(r"\\x1b\\[[0-9;]*m", "", line).split()[3] for line in out.getvalue().splitlines() if "***" in line]
print(len(opt.opts), sorted(Counter("sgd" if n.startswith("sgd_") else "other" for n in names).items()))
"""

EARLY = """
from tinygrad import Device, Tensor, dtypes
Device[Device.DEFAULT].renderer  # built before engine could make its compiler target sm_90a
from kernels.matmul import linear, wgmma
print(wgmma(Device.DEFAULT), linear(Tensor.empty(128, 512, dtype=dtypes.half), Tensor.empty(512, 512)).realize().shape)
"""

MACHINE_CODE = """
from operator import attrgetter
import engine
from tinygrad.engine.worker import get_worker_pool
from tinygrad.helpers import Context, Target
from tinygrad.renderer.cstyle import CUDARenderer
r = CUDARenderer(Target("CUDA", "CUDA", "sm_90"))
src = 'extern "C" __global__ void k(float *a) { a[0] = 1.f; }'
with Context(PARALLEL=1): print(r.compiler.compile(src)[:4], get_worker_pool().map(attrgetter("compiler.ptx", "compiler.arch"), [r]))
"""

def nvrtc() -> bool:
  try: return importlib.util.find_spec("nvidia.cuda_nvrtc") is not None
  except ModuleNotFoundError: return False

def run(renderer:str, code:str, arch:str="sm_90") -> subprocess.CompletedProcess:
  """code on tinygrad's NULL device for this GPU architecture with this renderer, NVRTC and the CUDA headers from pip."""
  nvidia = pathlib.Path(importlib.util.find_spec("nvidia").submodule_search_locations[0])
  env = {**os.environ, "DEV": f"MOCK+NULL:{renderer}:{arch}", "PYTHONPATH": str(ROOT), "CUDA_PATH": str(nvidia / "cuda_runtime"),
         "LD_LIBRARY_PATH": str(nvidia / "cuda_nvrtc" / "lib")}
  return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)

@pytest.mark.skipif(not nvrtc(), reason="needs pip's nvidia-cuda-nvrtc-cu12 and nvidia-cuda-runtime-cu12 (.ci/run installs them)")
def test_compiled_for_the_h200():
  r = run("CUDA", CHOSEN)
  assert r.returncode == 0 and r.stdout.strip().endswith("chosen True True True"), r.stderr[-3000:]
  # tinygrad's PTX renderer can't compile CUDA C, so there no kernel may be chosen
  r = run("PTX", ASKED)
  assert r.returncode == 0 and r.stdout.strip() == "chosen False False False False False", r.stderr[-3000:]
  # wgmma on Hopper only: sm_90a's code doesn't load on a later GPU (a Blackwell RTX card, sm_120), which takes the mma.sync kernel
  r = run("CUDA", LATER, arch="sm_120")
  assert r.returncode == 0 and r.stdout.strip() == "False True (128, 512)", r.stderr[-3000:]

@pytest.mark.skipif(not nvrtc(), reason="needs pip's nvidia-cuda-nvrtc-cu12 and nvidia-cuda-runtime-cu12 (.ci/run installs them)")
@pytest.mark.parametrize("arch,gemm,dx", [("sm_90", "wgmma", "wgmma_n"), ("sm_80", "gemm", "gemm")])
def test_backward_for_the_h200(arch:str, gemm:str, dx:str):
  # backprop through two blocks on the kernels: 13 linear layers (6 a block and the head), each a forward GEMM, one for dx and one for
  # dw, the MLP's second layer's three with relu^2 (its input's activation, or in dx its derivative "drelu2"); on the H200 dx's GEMM
  # reads the weight as stored (N-major, "_n"), on an A100 (sm_80, mma.sync) it takes a copy of w^T; two flash attentions, each with
  # one dq and one dkv kernel; five norms (two of them adding a residual) and four QK-norms, each with its gradient; one loss and its
  # gradient; the token and value embeddings' gradients; the four residual-mix scalars' sums. Every kernel compiles for the GPU.
  # A gradient taken twice (tinygrad's autograd flows on past a target: a norm's two inputs, the stream and the attention's output, once
  # counted the attention's backward twice) or falling back to tinygrad's ops changes the counts
  r = run("CUDA", BACKWARD, arch)
  assert r.returncode == 0, r.stderr[-3000:]
  want = Counter({gemm: 11, f"{gemm}_relu2": 2}) + Counter({dx: 11, f"{dx}_drelu2": 2}) + \
    Counter({"grad_w": 11, "grad_w_relu2": 2, "flash": 2, "flash_dq": 2, "flash_dkv": 2, "loss": 1, "loss_grad": 1, "embed_grad": 2, "norm": 3,
             "norm_add": 2, "norm_grad": 3, "norm_grad_add": 2, "qk_norm_half_half": 4, "qk_norm_grad_half_half": 4, "dot": 4})
  assert r.stdout.strip().splitlines()[-1] == str(sorted(want.items())), r.stdout

@pytest.mark.skipif(not nvrtc(), reason="needs pip's nvidia-cuda-nvrtc-cu12 and nvidia-cuda-runtime-cu12 (.ci/run installs them)")
def test_update_for_the_h200():
  # backprop's SGD update: one kernels/sgd.py kernel for every parameter and each lr group's lr, nothing else (tinygrad's SGD was two
  # kernels a parameter: falling back to it, a kernel a parameter, or a copy of the gradient's parts changes the counts)
  r = run("CUDA", UPDATE)
  assert r.returncode == 0, r.stderr[-3000:]
  groups, counts = r.stdout.strip().splitlines()[-1].split(" ", 1)
  assert counts == str([("other", int(groups)), ("sgd", 1)]), r.stdout

@pytest.mark.skipif(not fits(Tensor.empty(8, 256, dtype=dtypes.half), 15.0), reason="kernels/loss.py runs on NVIDIA GPUs (sm_80+) only")
def test_loss():
  # the loss kernel (run on the GPU machine) against float64: a lane's values misplaced, the max or the sum reduced over part of the
  # warp, or the target's logit taken from another row fails; logits up to +-40 are softcapped into (-15, 15)
  rng = np.random.default_rng(0)
  z, y = (rng.normal(size=(4, 8, 4096)) * 10).astype(np.float16), rng.integers(0, 4096, (4, 8)).astype(np.int32)
  c = 15 * np.tanh(z.astype(np.float64) / 15)
  ref = np.log(np.exp(c).sum(-1)) - np.take_along_axis(c, y[..., None], -1)[..., 0]
  np.testing.assert_allclose(softcapped_loss(Tensor(z), Tensor(y), 15.0).numpy(), ref, rtol=1e-5)

@pytest.mark.skipif(not fits(Tensor.empty(8, 256, dtype=dtypes.half), 15.0), reason="kernels/norm.py runs on NVIDIA GPUs (sm_80+) only")
@pytest.mark.parametrize("dtype", [dtypes.half, dtypes.float32])
def test_qk_norm(dtype):
  # the RoPE + QK-norm kernel (run on the GPU machine) against float64: a pair rotated with another position's angles or the wrong
  # partner, or a norm over part of a head, fails; 3 heads, so a head's rows are 192 values apart
  rng = np.random.default_rng(1)
  B, T, H = 2, 128, 3
  x, ang = rng.normal(size=(B, T, H, 64)) * 3, rng.uniform(0, 6.3, (T, 1, 32))
  a, b = x[..., :32], x[..., 32:]
  r = np.concatenate([a * np.cos(ang) + b * np.sin(ang), b * np.cos(ang) - a * np.sin(ang)], -1)
  ref = r / np.sqrt((r ** 2).mean(-1, keepdims=True) + 1e-6)
  npd = np.float16 if dtype == dtypes.half else np.float32
  out = qk_norm(Tensor(x.astype(npd)), *[Tensor(f(ang).astype(np.float32)) for f in (np.cos, np.sin)], dtype).numpy()
  assert out.dtype == npd
  np.testing.assert_allclose(out.astype(np.float64), ref, atol=5e-3 if dtype == dtypes.half else 1e-5)  # half: inputs rounded to 2^-11

@pytest.mark.skipif(not fits(Tensor.empty(8, 256, dtype=dtypes.half), 15.0), reason="kernels/norm.py runs on NVIDIA GPUs (sm_80+) only")
@pytest.mark.parametrize("add", [False, True])
def test_norm(add:bool):
  # the stream's norm kernel (run on the GPU machine) against float64: a lane's values misplaced, a sum over part of the row, or y
  # added at the wrong place fails
  rng = np.random.default_rng(2)
  x, y = rng.normal(size=(2, 8, 512)) * 3, rng.normal(size=(2, 8, 512)).astype(np.float16)
  s = x.astype(np.float32).astype(np.float64) + (y if add else 0)
  ref = s / np.sqrt((s ** 2).mean(-1, keepdims=True) + 1e-6)
  out = norm(Tensor(x.astype(np.float32)), dtypes.half, Tensor(y) if add else None).numpy()
  assert out.dtype == np.float16
  np.testing.assert_allclose(out.astype(np.float64), ref, atol=4e-3)  # the output in half: 2^-11 relative, values up to ~4

@pytest.mark.skipif(not nvrtc(), reason="needs pip's nvidia-cuda-nvrtc-cu12 and nvidia-cuda-runtime-cu12 (.ci/run installs them)")
def test_machine_code():
  # with zo's engine imported, tinygrad's CUDA renderer compiles to machine code (a cubin, an ELF file), not to PTX ("//" comments
  # first), which the driver would compile again at each module load of a run; in tinygrad's pool of workers too, fresh processes
  # that build the renderer from its pickle without importing engine; on Hopper for sm_90a, so that zo's wgmma kernels compile there too
  r = run("CUDA", MACHINE_CODE)
  assert r.returncode == 0 and r.stdout.strip() == str(b"\x7fELF") + " [(False, 'sm_90a')]", r.stderr[-3000:]

@pytest.mark.skipif(not nvrtc(), reason="needs pip's nvidia-cuda-nvrtc-cu12 and nvidia-cuda-runtime-cu12 (.ci/run installs them)")
def test_wgmma_needs_sm_90a():
  # a renderer built before engine was imported compiles for sm_90, which has no wgmma: the GEMM takes the mma.sync kernel and
  # compiles, where choosing wgmma there failed in ptxas ("wgmma.wait_group not supported on .target sm_90")
  r = run("CUDA", EARLY)
  assert r.returncode == 0 and r.stdout.strip().splitlines()[-1] == "False (128, 512)", r.stderr[-3000:]

@pytest.mark.skipif(not nvrtc(), reason="needs pip's nvidia-cuda-nvrtc-cu12 and nvidia-cuda-runtime-cu12 (.ci/run installs them)")
def test_jittered_for_the_h200():
  # a forward jittered at every Dust direct site of two blocks, 2 keys' runs: the 6 linear sites' noise in their GEMMs' epilogue, the
  # embedding's and the 2 attention outputs' in kernels/jitter.py's kernel, and no noise left to tinygrad's own kernels
  r = run("CUDA", JITTERED)
  assert r.returncode == 0, r.stderr[-3000:]
  counts = dict(eval(r.stdout.strip().splitlines()[-1]))
  assert counts.get("jittered gemm") == 6 and counts.get("jitter") == 3 and "tinygrad threefry" not in counts, counts
