#!/usr/bin/env python3
"""The benchmark: speed and memory measured side by side in one run, printed as one table per preset.

  DEV=CUDA python tests/bench.py                     the small and dust presets (8x256 and 8x2048 tokens): the forwards, then a step
                                                     of every method and population (the table of docs/performance.md)
  DEV=CUDA python tests/bench.py --presets small --rows mezo:16 es:256:1 dust:1024     some rows of one preset
  DEV=CUDA python tests/bench.py --cold              each row's first step twice: with an empty compile cache, and with that cache
  DEV=CUDA python tests/bench.py --default           the default command's wall time, and backprop's time to the same val loss
  DEV=CPU  python tests/bench.py --quick             the tiny model, a CPU-sized table (tests/test_bench.py runs this, so the harness
                                                     never rots); minutes on 2 CPU cores, nearly all of it compiling kernels
  DEV=CUDA python tests/bench.py --loops 4 16 64 256   only the looped model's table: every estimator at each loop count
  DEV=CUDA python tests/bench.py --presets dust --rows dust:1024 --devices 1 2    a Dust update on one GPU and spread over two
  DEV=CUDA python tests/bench.py --presets small --rows conmezo:16 --profile 12     under the clean forward and each row: the 12 kernels
                                                     of most time, then every kernel grouped by op with its share, rates and roofline
  DEV=MOCK+NULL:CUDA:sm_90 python tests/bench.py --presets small --rows dust:1024 --census    no GPU needed: each row's kernels as a GPU
                                                     would run them (the NULL device compiles, runs nothing), launches, FLOPs, bytes

A row is a step of one method (the estimate and its SGD update, as the training loop runs them), in a process of its own, so that no row
inherits another's compiled kernels or memory. Its columns: seconds a step (the mean of the timed steps, at least 0.2 s of them, after
one that compiles and one that captures the JITs), that time in clean forwards, the forwards its arithmetic needs (as the estimator
declares them, registry.py: mezo 2 per direction, es 1 per member, dust the capture, the direct draws' reruns from their block and the
scalars' forwards, backprop 3, a forward and a backward of twice its work), the overhead (the ratio of the two), the peak of tinygrad's
allocated bytes during the row (parameters and batch included) and that peak over the clean forward's, and the first step's seconds. The
clean forward is a TinyJit like every step, measured the same way. Under the backprop row, PyTorch's backprop step on the same model and
batch (bf16, SGD), eager and under torch.compile, where torch is importable (tests/torch_ref.py). Before the rows, the noise's rate: the
generator alone against a MeZO/ES update made dense from its keys and against the seed replay of its momentum (`noise_row`).
"""
import argparse, collections, contextlib, gc, importlib.util, io, json, os, re, shutil, subprocess, sys, tempfile, time
from dataclasses import asdict
from typing import Any, Callable
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import numpy as np
from tinygrad import Context, Device, GlobalCounters, Tensor, TinyJit
from tinygrad.device import Buffer
from kernels.noise import fold, gaussian, key
from model import GPT, GPTConfig, Looped, LoopedConfig
from registry import ESTIMATORS
from devices import keyed
import dust, engine, estimators, optim, zo

PEAK = [0]
_allocate = Buffer.allocate
def _tracked(self, *a, **kw):
  r = _allocate(self, *a, **kw)
  PEAK[0] = max(PEAK[0], GlobalCounters.mem_used)
  return r
Buffer.allocate = _tracked

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PRESETS = {"small": 8, "dust": 8, "tiny": 8}  # the batch: 8 sequences of the preset's context
ROWS = ["mezo:1", "mezo:16", "mezo:64", "es:64", "es:256:1", "es:256:4", "es:1024:1", "es:1024:4", "dust:256", "dust:1024", "backprop:1"]
QUICK = ["mezo:1", "es:8", "es:8:1", "dust:64", "backprop:1"]

def sync(): Device[Device.DEFAULT].synchronize()

def timed(fn, n:int) -> float:
  # a full collection first: compiling and capturing leave many long-lived objects, and Python's first full collection of them
  # (175 ms of host time on the H200's machine, small preset) otherwise lands in a timed step; a run pays it once, like the compile
  gc.collect()
  sync()
  st = time.perf_counter()
  for _ in range(n): fn()
  sync()
  return (time.perf_counter() - st) / n

def setup(preset:str, quick:bool) -> tuple[GPT, Tensor, Tensor]:
  cfg = GPTConfig.preset("tiny", seq_len=32, vocab=64) if quick else GPTConfig.preset(preset)
  model, rng = GPT(cfg, dtype=zo.compute_dtype()), np.random.default_rng(0)
  B = 2 if quick else PRESETS[preset]
  x, y = (Tensor(rng.integers(0, cfg.vocab, (B, cfg.seq_len)).astype(np.int32)).realize() for _ in range(2))
  return model, x, y

def direct_sites(model) -> list[str]:  # every site that Dust's direct draws jitter: writers, hidden, hubs, the embedding
  L = model.cfg.n_layer
  return ["transformer.wte"] + [f"transformer.h.{l}.{s}" for l in range(L) for s in ("attn.c_proj", "mlp.c_fc", "mlp.c_proj")] + \
         [f"o@{l}" for l in range(L)]

def forward_row(model, x:Tensor, y:Tensor, n:int) -> dict:
  """The clean forward and the forward jittered at every Dust direct site (Gaussian, and Rademacher: --noise), as TinyJits; the peak
  is the clean one's."""
  clean = TinyJit(lambda x, y: model.losses(x, y).realize())
  def jittered(noise:str) -> TinyJit:
    return TinyJit(lambda x, y, k: model.losses(x, y, {s: (k, 0.2, noise) for s in direct_sites(model)}).realize())
  gauss, signs, k = jittered("gaussian"), jittered("rademacher"), key(1)
  PEAK[0] = GlobalCounters.mem_used
  for _ in range(2): clean(x, y)
  peak = PEAK[0]
  for _ in range(2): gauss(x, y, k); signs(x, y, k)
  row = {"clean_s": timed(lambda: clean(x, y), 10 * n), "jittered_s": timed(lambda: gauss(x, y, k), 10 * n),
         "rademacher_s": timed(lambda: signs(x, y, k), 10 * n), "peak": peak}
  if int(os.environ.get("BENCH_PROFILE", 0)): row["kernels"] = kernel_times(lambda: clean(x, y))
  if os.environ.get("BENCH_CENSUS"): row["census"] = census(lambda: clean(x, y))
  return row

DIRECTIONS, WINDOW = 8, 64  # the noise row: an estimate of 8 directions, and a seed replay of 64 steps of them

def noise_row(model, n:int) -> dict:
  """Noise values a second: the generator alone, every parameter's Gaussian written once (D values); the SGD update of an estimate
  of DIRECTIONS directions made dense from their keys (DIRECTIONS·D values); the same update with its momentum replayed from
  WINDOW steps of seeds (WINDOW·DIRECTIONS·D values). Each a TinyJit, timed like the forward; the updates move the weights by 1e-12."""
  params, k = model.params, key(1)
  gen = TinyJit(lambda k: Tensor.realize(*[gaussian(fold(k, i), p.shape) for i, p in enumerate(params.values())]))
  g = estimators.Compact(k, Tensor.full((DIRECTIONS,), 1e-9).contiguous().realize())
  dense, replay = (optim.Optimizer(params, {p: 1e-3 for p in params}, "sgd", 0.9, w) for w in (0, WINDOW))
  for _ in range(2): gen(k); dense.step(g); replay.step(g)  # capture
  D = model.num_params()
  return {"gen": D / timed(lambda: gen(k), n), "dense": DIRECTIONS * D / timed(lambda: dense.step(g), n),
          "replay": WINDOW * DIRECTIONS * D / timed(lambda: replay.step(g), n)}

class ByKind:
  """Seconds of each kind of Dust chunk group in a step: dust.sum_draws timed between device syncs (one device only). The step is
  an extra one, after the timed ones: at each sync the device idles while the host queues the next group. What the kinds leave out
  is the capture, the reassembly and the update."""
  def __init__(self): self.times, self.step = {}, 0.0  # seconds per kind; of the whole step
  def __call__(self, chunk, *args, **static):
    sync()
    st = time.perf_counter()
    out = self.sum_draws(chunk, *args, **static)
    sync()
    kind = chunk.__name__.removesuffix("_chunk") + (f":{static['kind']}" if "kind" in static else "")
    self.times[kind] = self.times.get(kind, 0.0) + time.perf_counter() - st
    return out
  def __enter__(self):
    self.sum_draws, dust.sum_draws = dust.sum_draws, self
    return self
  def __exit__(self, *exc): dust.sum_draws = self.sum_draws

def forwards(model, method:str, pop:int) -> float:
  """The forwards a step's arithmetic needs, as the estimator declares them (registry.py)."""
  entry = ESTIMATORS[method]
  return entry.forwards(entry.run(model, pop)) if entry.forwards else float("nan")

RATE = {"G": 1e9, "T": 1e12}
UNIT = {"us": 1e-6, "ms": 1e-3, "s": 1.0}

ANSI = re.compile(r"\x1b\[[0-9;]*m")  # the colours of tinygrad's kernel names and DEBUG lines

@contextlib.contextmanager
def each_jit(seen:Callable[[str], Any]):
  """Each of zo's JITs (engine.jit) calls seen(its name, `jit_name`) before it runs, so that the kernels that run next are traced to it."""
  call = engine.Function.__call__
  def named(self, *inputs):
    seen(jit_name(self))
    return call(self, *inputs)
  engine.Function.__call__ = named
  try: yield
  finally: engine.Function.__call__ = call

def kernel_times(fn) -> list[tuple[str, float, int, float, float, str]]:
  """Every kernel of a call of fn, summed by name, most time first: (name, seconds, launches, FLOPs, bytes, the JITs that ran it). tinygrad
  prints each kernel's time and its rates (of the FLOPs and bytes it estimates for the kernel; zo's CUDA kernels declare theirs) at
  DEBUG=2, in a JIT's replay too when it runs its kernels one by one, without a graph (JIT=2: profiled()); each of zo's JITs (engine.jit)
  prints its function's name first (`jit_name`), so a kernel is traced to the code that ran it."""
  out, rows, jit = io.StringIO(), collections.defaultdict(lambda: [0.0, 0, 0.0, 0.0, collections.Counter()]), "-"
  with contextlib.redirect_stdout(out), Context(DEBUG=2), each_jit(lambda name: print(f"@@ {name}")):
    fn()
    sync()  # a kernel's line is printed when it has run
  for line in ANSI.sub("", out.getvalue()).splitlines():
    if line.startswith("@@ "): jit = line[3:]
    elif m := re.search(r"\*\*\*\s+\S+\s+\d+\s+(\S+).*?tm\s+([\d.]+)(us|ms|s)\s*/.*?\(\s*([\d.]+) ([GT])FLOPS\s+([\d.]+)\|\S+\s+([GT])B/s", line):
      t, r = float(m[2]) * UNIT[m[3]], rows[m[1]]
      r[0] += t; r[1] += 1; r[2] += float(m[4]) * RATE[m[5]] * t; r[3] += float(m[6]) * RATE[m[7]] * t; r[4][jit] += 1
  return sorted(((k, *v[:4], ", ".join(j for j, _ in v[4].most_common(3))) for k, v in rows.items()), key=lambda r: -r[1])

def census(fn) -> list[tuple[str, int, float, float, str]]:
  """Every kernel of a call of fn by name, most bytes first: (name, launches, FLOPs, bytes, the JITs that ran it), from tinygrad's own
  estimate of each kernel's work (zo's CUDA kernels declare theirs). Nothing is timed, so it holds on the NULL device, which compiles
  for a GPU it hasn't got (`DEV=MOCK+NULL:CUDA:sm_90`): the step's bytes, where no GPU is to be had. Under JIT=2 (which --census
  sets), a JIT's kernels are launched one by one, each counted."""
  import tinygrad.engine.realize as realize
  from tinygrad.uop.ops import Ops, sym_infer
  rows, jit = collections.defaultdict(lambda: [0, 0.0, 0.0, collections.Counter()]), ["-"]
  track = realize.track_stats
  def counted(ctx, c, *a):
    if c.src[0].op is Ops.PROGRAM:
      e, r = realize.estimate_uop(c), rows[ANSI.sub("", c.src[0].arg.name)]
      r[0] += 1; r[1] += float(sym_infer(e.ops, ctx.var_vals)); r[2] += float(sym_infer(e.mem, ctx.var_vals)); r[3][jit[0]] += 1
    return track(ctx, c, *a)
  realize.track_stats = counted
  try:
    with each_jit(lambda name: jit.__setitem__(0, name)):
      fn()
      sync()
  finally: realize.track_stats = track
  return sorted(((k, n, f, b, ", ".join(j for j, _ in js.most_common(3))) for k, (n, f, b, js) in rows.items()), key=lambda r: -r[3])

def print_census(kernels:list, what:str):
  """--census's tables under a row: every kernel grouped by op, then by the JIT that ran it most, with launches, GFLOP and GB."""
  print(f"  {what}: {sum(k[1] for k in kernels)} launches, {sum(k[2] for k in kernels) / 1e9:.1f} GFLOP, "
        f"{sum(k[3] for k in kernels) / 1e9:.2f} GB (tinygrad's estimates)", flush=True)
  for label, key_of in (("op", lambda k: op_of(k[0])), ("JIT", lambda k: k[4].split(", ")[0])):
    groups = collections.defaultdict(lambda: [0, 0.0, 0.0])
    for k in kernels:
      g = groups[key_of(k)]
      g[0] += k[1]; g[1] += k[2]; g[2] += k[3]
    print(f"  {'by ' + label:<32} {'launches':>8} {'GFLOP':>9} {'GB':>8}", flush=True)
    for name, (n, f, b) in sorted(groups.items(), key=lambda g: -g[1][2]): print(f"  {name:<32} {n:8d} {f / 1e9:9.1f} {b / 1e9:8.2f}", flush=True)

def jit_name(f:engine.Function) -> str:
  """A JIT's function by name, with the function that a chunk JIT sums or stacks (through devices.keyed, the draws it keys) and the kind
  of Dust's local draws: `adding(local_chunk:k)`."""
  inner = f.static.get("draws", f.static.get("fn")) if f.static.get("fn") is keyed else f.static.get("fn")
  return f.fn.__name__ + (f"({inner.__name__}" + (f":{f.static['kind']}" if "kind" in f.static else "") + ")" if inner else "")

# A kernel's op, by its name: zo's CUDA kernels are named by kernels/*.py (matmul's by M_N_K), tinygrad's own by their kind
# (E_: elementwise, r_: a reduction); what the name doesn't tell is "other"
OPS = ((r"^(?:wgmma|gemm)_(\d+)_(\d+)_(\d+)", lambda m: f"GEMM {m[1]}x{m[2]}x{m[3]}"),
       (r"^grad_w_(\d+)_(\d+)_(\d+)", lambda m: f"GEMM dW {m[1]}x{m[2]}x{m[3]}"),
       (r"^flash_delta", "attention draws (flash delta)"), (r"^flash_d", "attention gradient"), (r"^flash", "attention (flash)"),
       (r"^qk_norm", "RoPE + QK-norm"), (r"^norm", "RMS norms"), (r"^loss", "loss (head's cross-entropy)"), (r"^jitter", "jitter"),
       (r"^(?:embed|dot|sgd)", "embedding, mix, SGD"), (r"^E_", "elementwise (tinygrad)"), (r"^r_", "reductions (tinygrad)"),
       (r"(?i)copy|xfer", "copies"))
# a GPU's datasheet peaks: dense half-precision tensor-core FLOP/s and memory bytes/s, by the name the driver reports
PEAKS = {"H100": (989e12, 3.35e12), "H200": (989e12, 4.8e12)}

def op_of(name:str) -> str:
  for pat, label in OPS:
    if m := re.search(pat, name): return label(m) if callable(label) else label
  return "other"

def by_op(kernels:list[tuple], peaks:tuple[float, float]|None) -> list[tuple]:
  """The kernels grouped by op, most time first: (op, share of the kernels' time, seconds, launches, FLOP/s, bytes/s, and the fraction
  of the roofline: the time the op's FLOPs and bytes need at the card's peaks (the larger of the two) over the time it took)."""
  ops = collections.defaultdict(lambda: [0.0, 0, 0.0, 0.0])
  for name, t, n, flops, nbytes, *_ in kernels:
    o = ops[op_of(name)]
    o[0] += t; o[1] += n; o[2] += flops; o[3] += nbytes
  total = sum(o[0] for o in ops.values())
  return sorted(((op, t / total, t, n, f / t, b / t, max(f / peaks[0], b / peaks[1]) / t if peaks else float("nan"))
                 for op, (t, n, f, b) in ops.items() if t > 0), key=lambda r: -r[2])

def gpu_peaks() -> tuple[float, float]|None:
  """The card's peaks (PEAKS) where the driver names a card PEAKS knows."""
  r = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True) \
    if shutil.which("nvidia-smi") else None
  return next((v for k, v in PEAKS.items() if r and k in r.stdout), None)

def print_profile(kernels:list, top:int, what:str):
  """--profile's tables under a row: the `top` kernels of most time, then every kernel grouped by op."""
  for k, t, n, _, _, where in kernels[:top]: print(f"  {t * 1e3:9.3f} ms {n:6d}x {k:<40} in {where}", flush=True)
  peaks = gpu_peaks()
  print(f"  {what}, by op ({sum(k[1] for k in kernels) * 1e3:.3f} ms in {sum(k[2] for k in kernels)} kernels; roofline at "
        + (f"{peaks[0] / 1e12:.0f} TFLOP/s and {peaks[1] / 1e12:.2f} TB/s" if peaks else "unknown peaks") + "):", flush=True)
  print(f"  {'op':<32} {'share':>6} {'ms':>9} {'launches':>8} {'TFLOP/s':>8} {'GB/s':>7} {'roofline':>8}", flush=True)
  for op, share, t, n, f, b, frac in by_op(kernels, peaks):
    print(f"  {op:<32} {share:6.1%} {t * 1e3:9.3f} {n:8d} {f / 1e12:8.1f} {b / 1e9:7.0f} {frac:8.1%}", flush=True)

def profiled(top:int) -> dict[str, str]:
  """The environment of --profile's rows: the number of kernels to print, and JITs without graphs (a graph is one launch)."""
  return {"BENCH_PROFILE": str(top), "JIT": "2"}

def step_row(model, x:Tensor, y:Tensor, method:str, pop:int, rank:int, n:int, fill:float, devices:int=1) -> dict:
  """One estimate + its SGD update, as the training loop runs them (the population spread over `devices`, for mezo/es/dust). The timed
  steps are at least n and fill about `fill` seconds, sized by one step: three steps of the small preset's backprop (~2 ms each) varied
  by 20% between runs (H200)."""
  d = ESTIMATORS[method].defaults_for(ESTIMATORS[method].run(model, pop))
  opt, step = optim.Optimizer(model.params, optim.learning_rates(model.params, d, None), "sgd", d.momentum, 0), [0]
  opts = ({"rank": rank} if method == "es" else {}) | ({"devices": devices} if devices > 1 else {})
  state = {"state": {}} if "state" in ESTIMATORS[method].takes else {}  # what an estimator keeps from step to step, as zo.py's loop
  def estimate(): return estimators.run(model, x, y, method, pop, step[0], **opts, **state, **estimators.at_step(ESTIMATORS[method], step[0]))
  def run():
    step[0] += 1
    g, loss = estimate()
    opt.step(g)
    zo.checked(model, loss, g, step[0], "")
  def first_step():  # as zo.py's: the step's kernels compiled ahead, then the step
    engine.compile_ahead(estimate, repr(("bench", method, pop, opts, model.cfg, x.shape)))
    run()
  PEAK[0] = GlobalCounters.mem_used
  first = timed(first_step, 1)
  run()  # untimed: the first replay of every JIT
  steps = max(n, round(fill / timed(run, 1))) if fill else n
  row = {"first_s": first, "s": timed(run, steps), "peak": PEAK[0], "needs": forwards(model, method, pop)}
  if method == "dust" and devices == 1:  # one more step for the split: it syncs the device around every group of chunks
    with ByKind() as by_kind: row["split_s"] = timed(run, 1)
    row["split"] = by_kind.times
  if int(os.environ.get("BENCH_PROFILE", 0)): row["kernels"] = kernel_times(run)
  if os.environ.get("BENCH_CENSUS"): row["census"] = census(run)
  return row

def one_row(preset:str, spec:str, quick:bool, devices:int) -> dict:
  model, x, y = setup(preset, quick)
  name, *rest = spec.split(":")
  n = 1 if quick else 3
  if name == "forward": return forward_row(model, x, y, n)
  if name == "noise": return noise_row(model, n)
  return step_row(model, x, y, name, int(rest[0]), int(rest[1]) if len(rest) > 1 else 0, n, 0.0 if quick else 0.2, devices)

def run_row(preset:str, row:str, quick:bool, devices:int=1, cache:str|None=None, kernels:bool=True) -> dict:
  """One row in a process of its own; with --quick, in this one, so that the rows share their compiled kernels (on 2 CPU cores a
  process of its own spent 30-200 s compiling each row)."""
  if quick: return one_row("tiny", row, True, devices)
  # cache: tinygrad's compile cache db, and beside it the CUDA driver's own cache (of PTX compiled to machine code)
  env = os.environ | ({"CACHEDB": cache, "CUDA_CACHE_PATH": cache + ".cuda"} if cache else {}) | ({} if kernels else {"CUDA_KERNELS": "0"})
  cmd = [sys.executable, __file__, "--row", row, "--presets", preset, "--devices", str(devices)] + (["--quick"] if quick else [])
  r = subprocess.run(cmd, env=env, capture_output=True, text=True)
  if r.returncode: raise RuntimeError(f"{preset} {row}: {(r.stderr.strip().splitlines() or ['?'])[-1]}")
  return json.loads(next(line for line in r.stdout.splitlines() if line.startswith("ROW "))[4:])

def first_steps(preset:str, row:str, quick:bool) -> tuple[dict, float]:
  """The row with empty compile caches, tinygrad's and the driver's (its first step cold, as on a new machine), and the first step of
  the row run again on those caches (warm)."""
  with tempfile.TemporaryDirectory() as d:
    cold = run_row(preset, row, quick, cache=os.path.join(d, "cache.db"))
    return cold, run_row(preset, row, quick, cache=os.path.join(d, "cache.db"))["first_s"]

def torch_run(model, x:Tensor, y:Tensor, mode:str) -> list[float]|str:
  """tests/torch_ref.py on this model and batch in `mode` (forward, backprop): the numbers it prints, or why there are none. It runs in
  a process of its own: in this one tinygrad's CUDA context is the current one, and torch's kernels fail to launch ("CUDA driver error:
  invalid resource handle")."""
  if importlib.util.find_spec("torch") is None: return "torch is not importable here"
  with tempfile.TemporaryDirectory() as d:
    arrays = {n: p.numpy() for n, p in model.params.items()} | {"cos": model.cos.numpy(), "sin": model.sin.numpy()}
    np.savez(f"{d}/in.npz", x=x.numpy(), y=y.numpy(), **arrays)
    r = subprocess.run([sys.executable, os.path.join(os.path.dirname(__file__), "torch_ref.py"), f"{d}/in.npz", json.dumps(asdict(model.cfg)),
                        mode], capture_output=True, text=True)
  return f"failed: {(r.stderr.strip().splitlines() or ['?'])[-1]}" if r.returncode else [float(v) for v in r.stdout.split()]

def torch_reference(model, x:Tensor, y:Tensor) -> str:
  """The same clean forward in PyTorch under torch.compile: a reference column."""
  if isinstance(r := torch_run(model, x, y, "forward"), str): return f"torch.compile fwd: {r}"
  tok_s, loss = r[-2:]
  return f"torch.compile fwd {x.numel() / tok_s * 1e3:.3f} ms | its mean loss {loss:.4f}, tinygrad's {model.losses(x, y).mean().item():.4f}"

def torch_backprop(model, x:Tensor, y:Tensor, clean:float) -> str:
  """PyTorch's backprop step on the same model and batch (bf16, SGD with momentum), eager and under torch.compile, in clean forwards."""
  if isinstance(r := torch_run(model, x, y, "backprop"), str): return f"PyTorch backprop: {r}"
  return "PyTorch backprop (bf16, SGD): " + " | ".join(f"{how} {s:.4f} s ({s / clean:.1f} fwd-equiv), peak {gib * 1024:.1f} MiB"
                                                      for how, s, gib in (("eager", *r[:2]), ("torch.compile", *r[2:])))

def table(preset:str, rows:list[str], args) -> list[dict]:
  model, x, y = setup(preset, args.quick)
  print(f"device {Device.DEFAULT}, preset {'tiny' if args.quick else preset}, {model.num_params():,} params, {model.dtype}, "
        f"batch {x.shape[0]}x{x.shape[1]}", flush=True)
  f = run_row(preset, "forward", args.quick)
  clean = f["clean_s"]
  print(f"clean forward {clean * 1e3:.3f} ms ({x.numel() / clean:,.0f} tok/s), peak {f['peak'] / 2**20:.1f} MiB | jittered "
        f"{f['jittered_s'] * 1e3:.3f} ms, ratio {clean / f['jittered_s']:.3f} | Rademacher jitter {f['rademacher_s'] * 1e3:.3f} ms, ratio "
        f"{clean / f['rademacher_s']:.3f}", flush=True)
  if "kernels" in f: print_profile(f["kernels"], args.profile, "the clean forward")
  if "census" in f: print_census(f["census"], "the clean forward")
  if not args.quick:  # on tinygrad's own kernels (kernels/cuda.py's off), and in PyTorch
    ours = run_row(preset, "forward", args.quick, kernels=False)
    print(f"tinygrad's own kernels: clean {ours['clean_s'] * 1e3:.3f} ms, ratio {ours['clean_s'] / ours['jittered_s']:.3f} | "
          + torch_reference(model, x, y), flush=True)
  v = run_row(preset, "noise", args.quick)
  print(f"noise values/s: generator {v['gen']:.3g} | dense update of {DIRECTIONS} directions {v['dense']:.3g} ({v['dense'] / v['gen']:.2f}x) "
        f"| seed replay of {WINDOW} steps of them {v['replay']:.3g} ({v['replay'] / v['gen']:.2f}x)", flush=True)
  print(f"{'method':>8} {'pop':>5} {'rank':>4} {'s/step':>9} {'fwd-equiv':>10} {'needs':>7} {'overhead':>8} {'peak MiB':>9} "
        f"{'x clean':>7} {'first s':>8}" + (f" {'warm s':>7}" if args.cold else ""), flush=True)
  out = []
  for spec in rows:
    for devices in (args.devices if spec.startswith("dust") else [1]):
      name, pop, *r = spec.split(":")
      if args.cold: row, warm = first_steps(preset, spec, args.quick)
      else: row, warm = run_row(preset, spec, args.quick, devices), None
      fe = row["s"] / clean
      label = name + (f" x{devices}" if devices > 1 else "")
      print(f"{label:>8} {pop:>5} {(r[0] if r else '-'):>4} {row['s']:9.4f} {fe:10.1f} {row['needs']:7.0f} {fe / row['needs']:8.2f} "
            f"{row['peak'] / 2**20:9.1f} {row['peak'] / f['peak']:7.2f} {row['first_s']:8.1f}" + (f" {warm:7.1f}" if warm is not None else ""),
            flush=True)
      if name == "backprop" and not args.quick: print("  " + torch_backprop(model, x, y, clean), flush=True)
      if "kernels" in row: print_profile(row["kernels"], args.profile, f"a step of {label} {pop}")
      if "census" in row: print_census(row["census"], f"a step of {label} {pop}")
      if "split" in row:
        print(f"  by chunk kind, in a step of {row['split_s']:.3f} s with the syncs: " +
              ", ".join(f"{k} {v:.3f} s" for k, v in row["split"].items()), flush=True)
      out.append({"preset": preset, "method": name, "pop": int(pop), "rank": int(r[0]) if r else 0, "devices": devices, **row,
                  "clean_s": clean, "clean_peak": f["peak"]})
  return out

def default_run(args) -> dict:
  """The default command, `python zo.py --method dust --pop 1024`, end to end (a process of its own; its wall time, its final val loss
  and the floor it printed), and backprop on the same defaults run until its val loss is at most Dust's final one."""
  with tempfile.TemporaryDirectory() as d:
    def run(*flags) -> tuple[float, list[dict], str]:
      st = time.perf_counter()
      r = subprocess.run([sys.executable, os.path.join(ROOT, "zo.py"), *flags, "--out", d, "--force"], capture_output=True, text=True, cwd=ROOT)
      if r.returncode: raise RuntimeError(f"zo.py {' '.join(flags)}: {(r.stderr.strip().splitlines() or ['?'])[-1]}")
      return time.perf_counter() - st, [json.loads(line) for line in open(os.path.join(d, "metrics.jsonl"))], r.stdout
    wall, dm, said = run("--method", "dust", "--pop", "1024")
    final = [m["val_loss"] for m in dm if "val_loss" in m][-1]
    bwall, bm, _ = run("--method", "backprop", "--eval-every", "1")
    reached = next((m for m in bm if m.get("val_loss", 9e9) <= final), None)
  floor = said.split("loss floor of this data is ")[-1].split()[0] if "loss floor" in said else "?"
  print(f"default command: {wall:.1f} s, {len(dm)} steps, final val {final:.4f} (floor {floor}) | backprop on the defaults: "
        + (f"val {reached['val_loss']:.4f} at step {reached['step']}, {reached['seconds']:.1f} s into its loop" if reached else
           f"never reached it in {len(bm)} steps ({bwall:.1f} s)"), flush=True)
  return {"default_s": wall, "final_val": final, "floor": floor, "backprop_to_same_s": reached["seconds"] if reached else None}

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
    resident = GlobalCounters.mem_used
    cells = [step_row(model, x, y, m, p, 0, 1, 0.0) for m, p in pops.items()]
    print(f"{loops:>6}" + "".join(f"{c['s']:>10.3f} s {(c['peak'] - resident) / 2**20:>8.1f} MiB" for c in cells), flush=True)

def main():
  p = argparse.ArgumentParser()
  p.add_argument("--quick", action="store_true", help="the tiny model, CPU-sized")
  p.add_argument("--presets", nargs="+", default=["small", "dust"], choices=list(PRESETS))
  p.add_argument("--rows", nargs="+", default=None, help="method:pop[:rank] rows (default: every row)")
  p.add_argument("--cold", action="store_true", help="each row's first step with an empty compile cache, then warm")
  p.add_argument("--default", action="store_true", help="only the default command's wall time against backprop's")
  p.add_argument("--loops", type=int, nargs="+", default=None, help="only the looped model's table, at these loop counts")
  p.add_argument("--devices", type=int, nargs="+", default=[1], help="time each dust row on each of these device counts")
  p.add_argument("--profile", type=int, default=0, metavar="N", help="under the clean forward and each row, the N kernels of most "
                 "time, then every kernel grouped by op (the rows run without CUDA graphs, so their times are not the table's)")
  p.add_argument("--census", action="store_true", help="under the clean forward and each row, every kernel's launches, FLOPs and bytes "
                 "(tinygrad's estimates) by op and by JIT: with DEV=MOCK+NULL:CUDA:sm_90, a GPU's kernels counted without one")
  p.add_argument("--json", default=None, help="also write the rows to this file (plot.py --bench draws from it)")
  p.add_argument("--row", default=None, help=argparse.SUPPRESS)  # internal: one row, in this process
  args = p.parse_args()
  if args.profile: os.environ |= profiled(args.profile)  # the rows' processes inherit it
  if args.census: os.environ |= {"BENCH_CENSUS": "1", "JIT": "2"}
  if args.row: return print("ROW " + json.dumps(one_row(args.presets[0], args.row, args.quick, args.devices[0])), flush=True)
  if args.loops: return looped_table(args.loops, args.quick, 64 if args.quick else 1024)
  if args.default: return print(json.dumps(default_run(args)))
  rows = [r for preset in (["tiny"] if args.quick else args.presets) for r in table(preset, args.rows or (QUICK if args.quick else ROWS), args)]
  if args.json: json.dump(rows, open(args.json, "w"), indent=1)
  if args.quick: looped_table([2], True, 64)  # one depth: that the memory is flat in it is tests/test_zo.py's to check

if __name__ == "__main__": main()
