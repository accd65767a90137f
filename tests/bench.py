#!/usr/bin/env python3
"""The benchmark: speed and memory measured side by side in one run, printed as one table.

  DEV=CUDA python tests/bench.py            the dust preset, 8x2048 tokens (the GPU numbers of GPU.md)
  DEV=CPU  python tests/bench.py --quick    the tiny model, both tables (tests/test_bench.py runs this, so the harness never
                                            rots); minutes on 2 CPU cores, nearly all of it compiling kernels
  DEV=CUDA python tests/bench.py --loops 4 16 64 256   only the looped model's table: every estimator at each loop count
  DEV=CUDA python tests/bench.py --pops 1024 --devices 1 2    a Dust update on one GPU and spread over two

Peak memory is the peak of tinygrad's allocated bytes (GlobalCounters.mem_used) during the measured call, minus what was
allocated before it (the parameters, the batch): what the step itself needs.
"""
import argparse, importlib.util, json, os, subprocess, sys, tempfile, time
from dataclasses import asdict
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import numpy as np
from tinygrad import Context, Device, GlobalCounters, Tensor, TinyJit
from tinygrad.device import Buffer
from kernels.noise import key
from model import GPT, GPTConfig, Looped, LoopedConfig
import dust, zo

PEAK = [0]
_allocate = Buffer.allocate
def _tracked(self, *a, **kw):
  r = _allocate(self, *a, **kw)
  PEAK[0] = max(PEAK[0], GlobalCounters.mem_used)
  return r
Buffer.allocate = _tracked

def measure(fn, n:int=3, warm:int=2, eager_memory:bool=True) -> tuple[float, float]:
  """(seconds per call after warm-up calls, peak extra bytes of one call). A replayed TinyJit allocates nothing (its buffers were
  planned at capture and stay), so the memory is read from an eager call (JIT=0); or, with eager_memory=False, from the timed
  calls themselves, for Dust, whose JITs free their scratch after each group and allocate it again at every replay."""
  for _ in range(warm): fn()
  Device[Device.DEFAULT].synchronize()
  base = PEAK[0] = GlobalCounters.mem_used
  st = time.perf_counter()
  for _ in range(n): fn()
  Device[Device.DEFAULT].synchronize()
  t = (time.perf_counter() - st) / n
  if eager_memory:
    base = PEAK[0] = GlobalCounters.mem_used
    with Context(JIT=0): fn()
  return t, PEAK[0] - base

def direct_sites(model) -> list[str]:  # every site that Dust's direct draws jitter: writers, hidden, hubs, the embedding
  L = model.cfg.n_layer
  return ["transformer.wte"] + [f"transformer.h.{l}.{s}" for l in range(L) for s in ("attn.c_proj", "mlp.c_fc", "mlp.c_proj")] + \
         [f"o@{l}" for l in range(L)]

def forward_bench(model, x:Tensor, y:Tensor) -> dict[str, float]:
  clean = TinyJit(lambda x, y: model.losses(x, y).realize())
  k = key(1)
  jittered = TinyJit(lambda x, y, k: model.losses(x, y, {s: (k, 0.2) for s in direct_sites(model)}).realize())
  tc, mc = measure(lambda: clean(x, y))
  tj, _ = measure(lambda: jittered(x, y, k))
  return {"clean fwd tok/s": x.numel() / tc, "jittered fwd tok/s": x.numel() / tj, "ratio": tc / tj, "clean fwd MiB": mc / 2**20}

def torch_reference(model, x:Tensor, y:Tensor):
  """The same clean forward in PyTorch under torch.compile (tests/torch_ref.py), where torch is importable: a reference column. It runs
  in a process of its own: in this one tinygrad's CUDA context is the current one, and torch's kernels fail to launch ("CUDA driver
  error: invalid resource handle")."""
  if importlib.util.find_spec("torch") is None: return print("torch.compile fwd: torch is not importable here", flush=True)
  with tempfile.TemporaryDirectory() as d:
    arrays = {n: p.numpy() for n, p in model.params.items()} | {"cos": model.cos.numpy(), "sin": model.sin.numpy()}
    np.savez(f"{d}/in.npz", x=x.numpy(), y=y.numpy(), **arrays)
    r = subprocess.run([sys.executable, os.path.join(os.path.dirname(__file__), "torch_ref.py"), f"{d}/in.npz", json.dumps(asdict(model.cfg))],
                       capture_output=True, text=True)
  if r.returncode: return print(f"torch.compile fwd: failed: {(r.stderr.strip().splitlines() or ['?'])[-1]}", flush=True)
  tok_s, loss = map(float, r.stdout.split()[-2:])
  ours = model.losses(x, y).mean().item()
  print(f"torch.compile fwd tok/s {tok_s:,.3f} | its mean loss {loss:.4f}, tinygrad's {ours:.4f} (the same model)", flush=True)

class ByKind:
  """Seconds of each kind of Dust chunk group in a step: dust.accumulate timed between device syncs (one device only). The step is
  an extra one, after the timed ones: at each sync the device idles while the host queues the next group. What the kinds leave out
  is the capture, the reassembly and the update."""
  def __init__(self): self.times, self.step = {}, 0.0  # seconds per kind; of the whole step
  def __call__(self, chunk, *args, **static):
    Device[Device.DEFAULT].synchronize()
    st = time.perf_counter()
    out = self.accumulate(chunk, *args, **static)
    Device[Device.DEFAULT].synchronize()
    kind = chunk.__name__.removesuffix("_chunk") + (f":{static['kind']}" if "kind" in static else "")
    self.times[kind] = self.times.get(kind, 0.0) + time.perf_counter() - st
    return out
  def __enter__(self):
    self.accumulate, dust.accumulate = dust.accumulate, self
    return self
  def __exit__(self, *exc): dust.accumulate = self.accumulate

def step_bench(model, x:Tensor, y:Tensor, method:str, pop:int, devices:int=1, by_kind:ByKind|None=None) -> tuple[float, float]:
  """One estimate + its SGD update, as the training loop runs it (the population spread over `devices`, for mezo/es/dust)."""
  lrs, mom = zo.group_lrs(model, method, "sgd", None, pop)
  opt = zo.Optimizer(model.params, lrs, "sgd", mom, 8)
  step = [0]
  def run():
    step[0] += 1
    g, loss = zo.run_estimator(model, x, y, method, pop, step[0], **({"devices": devices} if devices > 1 else {}))
    opt.step(g)
    loss.realize()
  t, m = measure(run, eager_memory=method != "dust")
  if by_kind:  # one more step for the split: it syncs the device around every group of chunks, so it isn't the timed one
    with by_kind: by_kind.step, _ = measure(run, n=1, warm=0, eager_memory=False)
  return t, m

def looped_table(depths:list[int], quick:bool, dust_pop:int):
  """One row per loop count, each estimator's step time and peak memory above the parameters and the batch, side by side: MeZO's
  and ES's peaks stay flat in the depth (one loop's activations at a time), backprop's grows linearly, and so does Dust's, which
  caches every loop's clean activations."""
  preset, B = ("tiny", 2) if quick else ("small", 8)
  pops = {"mezo": 1, "es": 4, "dust": dust_pop, "backprop": 1}
  rng = np.random.default_rng(0)
  print(f"looped model ({preset}), batch {B}x{LoopedConfig.preset(preset).seq_len}: seconds per step, peak MiB", flush=True)
  print(f"{'loops':>6}" + "".join(f"{f'{m} pop {p}':>24}" for m, p in pops.items()), flush=True)
  for loops in depths:
    model = Looped(LoopedConfig.preset(preset, loops=loops), dtype=zo.compute_dtype())
    x, y = (Tensor(rng.integers(0, model.cfg.vocab, (B, model.cfg.seq_len)).astype(np.int32)).realize() for _ in range(2))
    cells = [step_bench(model, x, y, m, p) for m, p in pops.items()]
    print(f"{loops:>6}" + "".join(f"{t:>10.3f} s {m / 2**20:>8.1f} MiB" for t, m in cells), flush=True)

def main():
  p = argparse.ArgumentParser()
  p.add_argument("--quick", action="store_true", help="the tiny model, CPU-sized")
  p.add_argument("--pops", type=int, nargs="+", default=None, help="dust populations to time")
  p.add_argument("--loops", type=int, nargs="+", default=None, help="only the looped model's table, at these loop counts")
  p.add_argument("--devices", type=int, nargs="+", default=[1], help="time each dust population on each of these device counts")
  args = p.parse_args()
  pops = args.pops or ([64] if args.quick else [256, 1024])
  if args.loops: return looped_table(args.loops, args.quick, pops[0])
  cfg = GPTConfig.preset("tiny", seq_len=32, vocab=64) if args.quick else GPTConfig.preset("dust")
  B, T = (2, 32) if args.quick else (8, 2048)
  model = GPT(cfg, dtype=zo.compute_dtype())
  rng = np.random.default_rng(0)
  x, y = (Tensor(rng.integers(0, cfg.vocab, (B, T)).astype(np.int32)).realize() for _ in range(2))
  print(f"device {Device.DEFAULT}, {model.num_params():,} params, {model.dtype}, batch {B}x{T}", flush=True)
  f = forward_bench(model, x, y)
  def row(f:dict[str, float]) -> str: return " | ".join(f"{k} {v:,.3f}" for k, v in f.items())
  print(row(f), flush=True)
  with Context(CUDA_KERNELS=0): print("tinygrad's kernels: " + row(forward_bench(model, x, y)), flush=True)  # kernels/cuda.py's off
  torch_reference(model, x, y)
  resident = sum(p.nbytes() for p in model.params.values()) + x.nbytes() + y.nbytes()  # peaks below include the parameters and batch
  print(f"clean forward peak {(f['clean fwd MiB'] * 2**20 + resident) / 2**20:.1f} MiB", flush=True)
  for method, pop, n in [("backprop", 1, 1), ("mezo", 1, 1), *[("dust", p, n) for p in pops for n in args.devices]]:
    by_kind = ByKind() if method == "dust" and n == 1 else None
    t, m = step_bench(model, x, y, method, pop, n, by_kind)
    peak, clean = m + resident, f["clean fwd MiB"] * 2**20 + resident  # on several devices: all of them together
    name = f"{method} pop {pop} step" + (f" on {n} devices" if n > 1 else "")
    print(f"{name:34s} {t:9.3f} s  peak {peak / 2**20:9.1f} MiB  ({peak / clean:.2f}x a clean forward)", flush=True)
    if by_kind:
      print(f"  by chunk kind, in a step of {by_kind.step:.3f} s with the syncs: " + ", ".join(f"{k} {v:.3f} s" for k, v in by_kind.times.items()),
            flush=True)
  if args.quick: looped_table([2, 8], True, pops[0])

if __name__ == "__main__": main()
