"""Which implementation runs for each op, on which backend, and why: the one table.

The model and the estimators call one function per op. Each runs one of two implementations:
- tinygrad's own: the op in tensor ops, which tinygrad compiles and fuses for any backend. The noise (kernels/noise.py), the jitter
  x + σz and the perturbed weights W + εz are lazy expressions that tinygrad fuses into the kernels that read them. This is zo on
  the CPU, AMD, Metal and every other backend, and on NVIDIA too with CUDA_KERNELS=0.
- zo's CUDA C kernel (kernels/cuda.py), on an NVIDIA GPU that tinygrad renders CUDA C for, sm_80 or later (cp.async and mma.sync),
  when the op's shapes fit the kernel; every other shape falls back to tinygrad's own. Each kernel has a gradient made of kernels
  too, so that backprop, the baseline, runs as fast.

| op | function | zo's CUDA kernel; the shapes it takes | tinygrad's own against it, on the H200 |
|---|---|---|---|
| GEMM | matmul.linear | wgmma (sm_90), else mma.sync; half, rows, N, K by 128, 128, 32 | 72-77 TFLOP/s against 245-356 |
| Dust's reassembly | matmul.outer_sum, mix_rows | backprop's dw kernel, float32 scaled into half | a Dust step 0.13 s longer (dust, H100) |
| attention | attention.attention | flash, QK-norm's bound for a max; half, head dim 64, T by 128 | 64 x 2048 tokens: 5.5-7.0 ms against 1.2-1.5 |
| Dust's attention draws | attention.moved, .mixed | o' - o from the change of q or k; p du, p remade | no T x T probabilities (8.6 GB at pop 1024) |
| norms | norm.norm, norm.qk_norm | a row read once: RMS norm of h + y; RoPE with QK-norm | q's and k's norms 4.3 ms a Dust chunk against 1.1 |
| loss | loss.cross_entropy | soft-capped cross-entropy, a warp a token; half, vocab by 256 | 6.1 ms a Dust chunk against 0.7 |
| embedding | embed.embedding | its gradient: a block a table row | a one-hot reduction, 34 G multiply-adds (dust preset) |
| residual mix | mix.scale | its gradient: one dot product in 264 blocks | 2.6 ms of a backprop step (dust preset) |
| jitter | jitter.jitter, matmul.linear | x + σz in the GEMM's epilogue, or alone; half, Gaussian | [16384, 2048]: 158.6 us for x + 0.2 against 45.5 |
| SGD | sgd.step | backprop's update, one kernel for every parameter | 1.6-1.9 ms (dust preset) against 0.23 |
| noise | noise.gaussian | none: always a lazy expression, fused into its reader | (the row below) |

Three more choices depend on the backend, not on the kernels:
- the noise's cos(2πu) (noise.gaussian): the backend's own sine where it has one (CUDA, Metal, AMD); on the CPU, where tinygrad
  renders a software sine whose range reduction was 2/3 of a Gaussian's time, a short polynomial within the angle's quadrant.
- Dust's chunks a JIT call (devices.CALL_TOKENS): as many as fill a GPU; one on the CPU, which runs each kernel in the calling thread, where a
  batch of chunks cost more compiling, time and memory (tiny model, pop 64, 2 cores: first step 36.6 -> 24.0 s, then 3.6 -> 3.0 s).
- a sum of exps (loss.exp_sum: the loss, Dust's head): one kernel on a GPU; on the CPU the exps written first, then summed, as
  tinygrad unrolls the fused sum of a row of 32 into a 6,500-line kernel at 51 ns an exp, against 9 ns written out (2 cores).
"""
from tinygrad import Device
from tinygrad.helpers import ContextVar
from tinygrad.renderer.cstyle import CUDARenderer
from tinygrad.uop.ops import Ops
import engine  # noqa: F401  before any renderer is built: engine has the CUDA renderer compile Hopper's kernels for sm_90a (wgmma)

CUDA_KERNELS = ContextVar("CUDA_KERNELS", 1)  # the switch: CUDA_KERNELS=0 runs tinygrad's own kernels everywhere

def sm(device:str) -> int:
  """The compute capability that tinygrad renders CUDA C for on `device` (90 on an H200), 0 where it doesn't."""
  r = Device[device].renderer
  return int(r.target.arch[3:]) if isinstance(r, CUDARenderer) and r.target.arch.startswith("sm_") else 0

def cuda_kernels(device:str) -> bool:
  """Whether zo's CUDA kernels run on `device` (for the shapes they take): an NVIDIA GPU of sm_80 or later, with the switch on."""
  return bool(CUDA_KERNELS) and sm(device) >= 80

def wgmma(device:str) -> bool:
  """Whether the GEMMs run on Hopper's wgmma on `device`: an sm_90 GPU whose kernels compile for sm_90a, the only target with wgmma
  (engine.nvrtc_for), whose code doesn't run on later GPUs (sm_100, sm_120). A renderer built before engine was imported, or NVCC's,
  compiles for sm_90, and takes the mma.sync kernel."""
  return sm(device) == 90 and getattr(Device[device].renderer.compiler, "arch", None) == "sm_90a"

def native_sin(device:str) -> bool: return Ops.SIN in Device[device].renderer.code_for_op  # the noise's cosine: the backend's own?
def batches_chunks(device:str) -> bool: return device.split(":")[0] != "CPU"  # Dust's chunks: many a JIT call, or one?
def writes_exps(device:str) -> bool: return device.split(":")[0] == "CPU"  # a sum of exps: the exps written, then summed?

def path(device:str) -> str:
  """Which implementation runs on `device`, in one line: what a run prints first."""
  name = device.split(":")[0]
  if cuda_kernels(device):
    return f"{name} sm_{sm(device)}: zo's CUDA kernels for GEMM ({'wgmma' if wgmma(device) else 'mma.sync'}), attention, norms, loss, " \
           "the jitter and backprop's gradients and update; tinygrad's for the rest"
  why = "" if sm(device) < 80 else " (CUDA_KERNELS=0)"
  return f"{name}: tinygrad's kernels{why}, the noise fused into them" + ("" if native_sin(device) else ", its cosine as a polynomial")
