#!/usr/bin/env python3
"""The looped model's claim, measured (docs/depth.md): is backprop's gradient through many loops wrong because rounding
accumulates, how close are the zeroth-order estimates, what each costs, and which trains at depth. Every table and
figure of docs/depth.md comes from here:

  python docs/depth/depth.py grad    backprop's gradient in float32 and half against float64, per loop count (item 1)
  python docs/depth/depth.py zo      MeZO's, ES's and Dust's estimates against the same float64 gradient (item 2)
  python docs/depth/depth.py cost    a step's seconds and peak memory per method and loop count (item 3)
  python docs/depth/depth.py learn   each of --methods trained by zo.py for the same CPU seconds at each loop count (item 4)
  python docs/depth/depth.py report  prints the tables (markdown) and draws cosine.png and val.png, from the rows alone

Each command writes its rows to docs/depth/NAME.json (docs/depth.md: the exact commands). The model is the tiny looped model (d 32, 2 heads) on
synthetic:parity, at CPU size.

The precisions of a gradient:
  float64  the reference: the model's own code with every float32 and half value in float64 (`in_float64`)
  float32  as zo trains on the CPU
  half     as zo trains on an NVIDIA GPU (zo.compute_dtype): the weights float32 masters, each layer's input and output in
           half, the residual stream, the sums and the weight gradients in float32. At the tiny model's shapes zo's CUDA
           kernels fit only the linear layers (and the residual mix's gradient, a float32 sum either way): there the weight's
           gradient of each loop is summed over the tokens in float32 from half operands, and added over the loops in
           float32. `gpu_linears` runs kernels/matmul.py's `untiled`, which does that in tensor ops, here
  half, tinygrad's matmul
           tinygrad's own half matmul (as zo's CPU path would run half), whose weight gradient is rounded to half at every
           loop and summed over the loops in half: the accumulation that the claim is about
"""
from __future__ import annotations
import argparse, contextlib, json, math, os, resource, signal, subprocess, sys, time
from typing import Any, Callable, Iterator
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
import numpy as np
from tinygrad import Tensor, dtypes
from data import load
from cosine import layer_type
from estimators import TOKENS, Compact, es_coefficients, estimate, perturbed_losses, spsa, values
from kernels.matmul import activate, untiled
from kernels.norm import norm, rms
from kernels.noise import key as root_key
from model import Looped, LoopedConfig, Pass
from registry import ESTIMATORS
from engine import per_call
from optim import Optimizer, learning_rates
import engine, model as model_py

HERE = os.path.dirname(os.path.abspath(__file__))
WTE, HEAD = "transformer.wte.weight", "lm_head.weight"
PRECISIONS = ("float64", "float32", "half", "half, tinygrad's matmul")

# ***** the task and the model *****

def batch(seq:int, size:int, split:str="train", i:int=0) -> tuple[Tensor, Tensor]:
  """The fixed batch: synthetic:parity (x random bits, y their running parity), seed 0."""
  return tuple(Tensor(a).realize() for a in load("synthetic:parity", 2, seq, 0).batch(split, i, size, seq))

def looped(loops:int, seq:int, precision:str, weights:dict[str, np.ndarray]|None=None) -> Looped:
  """The tiny looped model at vocab 2 in a precision, with the given float32 weights (default: its initialisation, seed
  0). In float64 the weights are float64 copies of them."""
  dtype = {"float64": dtypes.float64, "float32": dtypes.float32}.get(precision, dtypes.half)
  m = Looped(LoopedConfig.preset("tiny", vocab=2, seq_len=seq, loops=loops), 0, dtype)
  if weights is not None:
    for n, p in m.params.items(): p.assign(Tensor(weights[n].astype(np.float32))).realize()
  if precision == "float64": m.params = {n: p.cast(dtypes.float64).contiguous().realize() for n, p in m.params.items()}
  return m

def weights_of(path:str) -> dict[str, np.ndarray]:
  """The float32 weights of a zo run's checkpoint (RUN/model.safetensors)."""
  from safetensors.numpy import load_file
  return {k.removeprefix("param."): v for k, v in load_file(os.path.join(path, "model.safetensors")).items()
          if k.startswith("param.")}

@contextlib.contextmanager
def in_float64() -> Iterator[None]:
  """Every cast to float32 made while this is open casts to float64: with float64 weights and dtype, the model's graph then
  computes every value in float64 (the test checks that no arithmetic is left in another float). Only graph building
  reads it, so a JIT captured inside replays in float64 after."""
  cast = Tensor.cast
  Tensor.cast = lambda self, dtype: cast(self, dtypes.float64 if dtype == dtypes.float32 else dtype)
  try: yield
  finally: Tensor.cast = cast

@contextlib.contextmanager
def gpu_linears() -> Iterator[None]:
  """The model's linear layers in the dtypes of zo's NVIDIA path at the tiny model's shapes: kernels/matmul.py's `untiled`
  (half in, float32 sums, half out; the weight's gradient in float32), where the CPU would run tinygrad's half matmul,
  whose weight gradient is half. zo's tiled GEMM, which the MLP's c_fc (128 x 32) takes there, has the same dtypes."""
  linear = model_py.linear
  def gpu(x:Tensor, w:Tensor, act:str|None=None, noise:tuple|None=None) -> Tensor:
    if noise is not None or w.ndim != 2: return linear(x, w, act, noise)
    return untiled(activate(x, act).reshape(-1, x.shape[-1]), w).reshape(*x.shape[:-1], w.shape[0])
  model_py.linear = gpu
  try: yield
  finally: model_py.linear = linear

def context(precision:str) -> contextlib.AbstractContextManager:
  return {"float64": in_float64, "half": gpu_linears}.get(precision, contextlib.nullcontext)()

# ***** backprop's gradient, one loop at a time *****

class Backprop:
  """The gradient of the mean token loss by tinygrad's autograd, one loop at a time: the forward keeps every loop's input,
  then each loop's backward maps the gradient of its output to those of its input, of x0 and of the block's weights, which
  add up over the loops. The same ops in the same dtypes as autograd of the whole graph (the test compares them), which
  tinygrad 0.14 schedules in a time that grows faster than the loop count (150 s at 64 loops on 2 cores); a loop here is a
  JIT, captured once. `half_sums`: the gradients of the weights' half copies are summed over the loops in half, as
  tinygrad's autograd sums them where its half matmul reads them."""
  def __init__(self, model:Looped, half_sums:bool=False) -> None:
    self.model, self.half_sums = model, half_sums
    self.block = [n for n in model.params if n not in (WTE, HEAD)]
    self.acc = {n: Tensor.zeros(*model.params[n].shape, dtype=self.target(n).dtype).contiguous() for n in self.block}
    self.dx0:Tensor|None = None

  def target(self, name:str) -> Tensor:  # what a block weight's gradient is taken for
    p = self.model.params[name]
    return p.cast(self.model.dtype) if self.half_sums and p.ndim == 2 else p

  def __call__(self, x:Tensor, y:Tensor) -> tuple[float, dict[str, np.ndarray]]:
    """(the mean loss, the gradient of every parameter in float64 NumPy)."""
    m, P = self.model, self.model.params
    p = Pass(m, None, None)
    x0 = embedded(p, x).contiguous().realize()
    xs = [x0.clone().realize()]  # loop 0's input, a buffer apart from x0's: the gradients of the two are taken apart
    step = engine.jit(forward_loop, m)
    for _ in range(m.loops): xs.append(step(xs[-1], x0, x).clone().realize())
    losses = m.head(p, xs[-1], y)
    dx, head = losses.sum().gradient(xs[-1], P[HEAD])
    dx = dx.realize()
    self.dx0 = x0.zeros_like().contiguous()
    Tensor.realize(self.dx0, *[a.assign(a.zeros_like()) for a in self.acc.values()])
    back = engine.jit(backward_loop, self)
    for i in reversed(range(m.loops)): dx = back(xs[i], x0, dx, x).clone().realize()
    (wte,) = embedded(p, x).gradient(P[WTE], gradient=dx + self.dx0)
    g = {WTE: wte, **{n: a.cast(P[n].dtype) for n, a in self.acc.items()}, HEAD: head}
    n = losses.numel()  # the sum's gradient over the token count, as estimators.gradient
    return losses.mean().item(), {k: (g[k] / n).numpy().astype(np.float64) for k in P}

def embedded(p:Pass, x:Tensor) -> Tensor: return rms(p.embed("transformer.wte", x).float())  # x0, as GPT._forward

def forward_loop(model:Looped, x:Tensor, x0:Tensor, idx:Tensor) -> Tensor:
  return model.block(Pass(model, None, None), 0, x, x0, idx)

def backward_loop(bp:Backprop, x:Tensor, x0:Tensor, dx:Tensor, idx:Tensor) -> Tensor:
  """One loop's backward: the gradient of its input, returned; x0's and the weights' added to the sums."""
  out = forward_loop(bp.model, x, x0, idx)
  dxi, dx0, *gs = out.gradient(x, x0, *[bp.target(n) for n in bp.block], gradient=dx)
  # realized here, so that the capture holds the sums' kernels
  Tensor.realize(dxi, bp.dx0.assign(bp.dx0 + dx0), *[bp.acc[n].assign(bp.acc[n] + g) for n, g in zip(bp.block, gs)])
  return dxi

def gradient(loops:int, seq:int, precision:str, weights:dict[str, np.ndarray]|None, x:Tensor,
             y:Tensor) -> tuple[float, dict[str, np.ndarray]]:
  """Backprop's mean loss and gradient in a precision."""
  with context(precision):
    return Backprop(looped(loops, seq, precision, weights), half_sums=precision == "half, tinygrad's matmul")(x, y)

# ***** comparing a gradient to the reference *****

def compare(g:dict[str, np.ndarray], ref:dict[str, np.ndarray]) -> dict[str, dict[str, float]]:
  """Per layer type (zo's --cosine types), "block" (the looped block's six matrices) and "whole": the cosine of g to
  ref and its relative error |g - ref| / |ref|, each over the concatenation of that group's tensors."""
  groups = {t: [n for n in ref if layer_type(n) == t] for t in dict.fromkeys(map(layer_type, ref))}
  groups |= {"block": [n for n in ref if n.startswith("transformer.h.")], "whole": list(ref)}
  out = {}
  for t, names in groups.items():
    a, b = (np.concatenate([d[n].astype(np.float64).ravel() for n in names]) for d in (g, ref))
    na, nb = np.linalg.norm(a), np.linalg.norm(b)
    out[t] = {"cos": float(a @ b / (na * nb)) if na and nb else math.nan,
              "rel": float(np.linalg.norm(a - b) / nb) if nb else math.nan}
  return out

# ***** the zeroth-order estimates *****

def zo_estimate(model:Looped, x:Tensor, y:Tensor, method:str, pop:int, seed:int) -> dict[str, np.ndarray]:
  """zo's estimate of `method` at its default options, as a step of `zo.py --method METHOD --pop POP` computes it."""
  entry = ESTIMATORS[method]
  g = estimate(model, x, y, method, pop, seed, **values(entry, entry.run(model, pop)))
  return {n: t.numpy().astype(np.float64) for n, t in g.items()}

def rewards(model:Looped, x:Tensor, y:Tensor, method:str, pop:int, seed:int) -> np.ndarray:
  """[K, 2]: the mean losses at θ ± scale·E_k of the K directions that `method` draws at this pop and seed (MeZO: K = pop,
  scale ε; ES: K = pop / 2, scale σ), in the model's precision."""
  entry = ESTIMATORS[method]
  scale, K = (entry.default("eps"), pop) if method == "mezo" else (entry.default("sigma"), pop // 2)
  c = per_call(K, x.numel(), TOKENS)  # zo's chunks of directions, each a JIT of its own (engine.stack's output is float32)
  run = engine.jit(perturbed_losses, model, scale=scale, rank=0, signs=(1, -1))
  return np.concatenate([run(engine.tensor(np.arange(k, k + c, dtype=np.int32)), x, y, root_key(seed)).numpy() for k in range(0, K, c)])

def from_rewards(model:Looped, method:str, losses:np.ndarray, seed:int) -> dict[str, np.ndarray]:
  """The estimate that `method` makes of these losses of its directions (rewards()), in float32 as zo does."""
  entry, t = ESTIMATORS[method], Tensor(losses.astype(np.float32))
  coef, _ = spsa(t, entry.default("eps")) if method == "mezo" else es_coefficients(t, entry.default("sigma"), "rank")
  return {n: v.numpy().astype(np.float64) for n, v in Compact(root_key(seed), coef.realize()).dense(model.params).items()}

# ***** weights trained at a depth *****

def train(loops:int, seq:int, size:int, steps:int, lr:float) -> tuple[dict[str, np.ndarray], list[tuple[float, float]]]:
  """Weights trained at `loops` by backprop under zo's AdamW (backprop's defaults, registry.STANDARD, but the base lr):
  `steps` steps of float32 gradients (Backprop, as zo trains on the CPU) on the parity train batches 1, 2, ... (batch 0 is
  the fixed batch the gradients are compared on). Returns them and each step's (loss, resid_lambda); a step whose loss is
  not finite ends the training, as zo's loop does."""
  m = looped(loops, seq, "float32")
  d = ESTIMATORS["backprop"].defaults_for(ESTIMATORS["backprop"].run(m, 1, "adamw"))
  opt, bp, log = Optimizer(m.params, learning_rates(m.params, d, lr), "adamw", d.momentum, 0), Backprop(m), []
  for i in range(1, steps + 1):
    loss, g = bp(*batch(seq, size, "train", i))
    log.append((loss, float(m.params["resid_lambdas"].numpy()[0])))
    print(f"  train L={loops} lr {lr:g}: step {i}/{steps}, loss {loss:.4f}, resid_lambda {log[-1][1]:.3f}", flush=True)
    if not math.isfinite(loss): break
    opt.step({n: Tensor(v.astype(np.float32)) for n, v in g.items()})
  return {n: p.numpy() for n, p in m.params.items()}, log

def trained(loops:int, args:argparse.Namespace, lr:float) -> dict[str, np.ndarray]|None:
  """train()'s weights, made once and kept in runs/depth/ with their log: --steps steps, --steps-deep deeper than --deep
  loops. None where the training's loss went non-finite."""
  steps = args.steps if loops <= args.deep else args.steps_deep
  path = os.path.join(ROOT, "runs", "depth", f"trained-L{loops}-T{args.seq}-B{args.batch}-lr{lr:g}-s{steps}.npz")
  if not os.path.exists(path):
    w, log = train(loops, args.seq, args.batch, steps, lr)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    np.savez(path, **w, _log=np.array(log))
  with np.load(path) as f:
    return {k: f[k] for k in f.files if not k.startswith("_")} if "_log" not in f or np.isfinite(f["_log"][-1, 0]) else None

def weights(loops:int, args:argparse.Namespace) -> dict[str, dict[str, np.ndarray]|None]:
  """The weights the gradients are compared at: "init" (seed 0); "trained" at this depth at backprop-AdamW's default lr
  (2e-3) up to --lr-loops loops and at --lr-deep deeper (at 64 loops the default lr drove resid_lambda to 2.7 in 20 steps:
  the stream outgrew float32, docs/depth.md), unless that training failed; and at the loop counts of --default-lr,
  "trained, lr 2e-3" as well."""
  d = ESTIMATORS["backprop"].defaults["adamw"].lr
  sets = {"init": None, "trained": trained(loops, args, d if loops <= args.lr_loops else args.lr_deep)}
  if loops in args.default_lr and loops > args.lr_loops: sets[f"trained, lr {d:g}"] = trained(loops, args, d)
  return {k: w for k, w in sets.items() if k == "init" or w is not None}

# ***** the commands *****

def timed(fn:Callable, *a:Any) -> tuple[Any, float]:
  t0 = time.perf_counter()
  return fn(*a), time.perf_counter() - t0

def save_rows(name:str, rows:list[dict]) -> None:
  """Rows appended to docs/depth/NAME.json, replacing earlier rows of the same key (loops, weights, what)."""
  path, key = os.path.join(HERE, f"{name}.json"), lambda r: (r["loops"], r["weights"], r["what"])
  old = json.load(open(path)) if os.path.exists(path) else []
  new = {key(r) for r in rows}
  with open(tmp := f"{path}.{os.getpid()}.tmp", "w") as f: json.dump([r for r in old if key(r) not in new] + rows, f, indent=1)
  os.replace(tmp, path)  # whole: two commands may write one file

def grad_rows(args:argparse.Namespace) -> None:
  """Item 1: backprop's gradient in each precision against the float64 one, per layer type."""
  for L in args.loops:
    x, y = batch(args.seq, args.batch)
    for wname, w in weights(L, args).items():
      (loss, ref), s = timed(gradient, L, args.seq, "float64", w, x, y)
      rows = [{"loops": L, "weights": wname, "what": "float64", "loss": loss, "seconds": s}]
      for prec in PRECISIONS[1:]:
        (loss, g), s = timed(gradient, L, args.seq, prec, w, x, y)
        finite = bool(np.isfinite(loss) and all(np.isfinite(v).all() for v in g.values()))
        rows.append({"loops": L, "weights": wname, "what": prec, "loss": loss, "finite": finite, "seconds": s,
                     "types": compare(g, ref)})
        print(f"L={L} {wname} {prec}: loss {loss:.6f}, block cos {rows[-1]['types']['block']['cos']:.8f} "
              f"rel {rows[-1]['types']['block']['rel']:.2e}, {s:.0f} s", flush=True)
      save_rows("grad", rows)

def zo_rows(args:argparse.Namespace) -> None:
  """Item 2: MeZO's and ES's estimates from the losses of their directions computed in half (zo's estimate on a GPU), in
  float32 and in float64, and Dust's in half, each against backprop's float64 gradient; and the rewards' rounding, the losses'
  differences L(θ + εz) - L(θ - εz) in half and float32 against float64."""
  for L in args.loops:
    x, y = batch(args.seq, args.batch)
    for wname, w in weights(L, args).items():
      _, ref = gradient(L, args.seq, "float64", w, x, y)
      rows = []
      for spec in args.zo + (args.zo_shallow if L <= args.shallow else []):
        method, pop = spec.split(":")[0], int(spec.split(":")[1])
        row, t0 = {"loops": L, "weights": wname, "what": f"{method} {pop}", "types": {}}, time.perf_counter()
        if method == "dust":  # in half only: a Dust step costs as much as its population's reruns
          with context("half"): row["types"]["half"] = compare(zo_estimate(looped(L, args.seq, "half", w), x, y, method, pop, 0), ref)
        else:
          diffs = {}
          for prec in ("half", "float32", "float64"):
            with context(prec):
              m = looped(L, args.seq, prec, w)
              losses = rewards(m, x, y, method, pop, 0)
            diffs[prec] = losses[:, 0] - losses[:, 1]
            row["types"][prec] = compare(from_rewards(looped(L, args.seq, "float32", w), method, losses, 0), ref)
          exact = diffs["float64"]
          row["rewards"] = {"rms": float(np.sqrt(np.mean(exact ** 2))),
                            **{p: float(np.sqrt(np.mean((diffs[p] - exact) ** 2))) for p in ("half", "float32")}}
        row["seconds"] = time.perf_counter() - t0
        print(f"L={L} {wname} {spec}: block cos " + ", ".join(f"{p} {t['block']['cos']:.4f}" for p, t in row["types"].items()) +
              (f"; rewards rms {row['rewards']['rms']:.2e}, half's error {row['rewards']['half']:.2e}" if "rewards" in row else "") +
              f", {row['seconds']:.0f} s", flush=True)
        rows.append(row)
        save_rows("zo", rows)

def cost_rows(args:argparse.Namespace) -> None:
  """Item 3: two steps of each method (its estimate and the optimizer's update, as zo's loop runs them, in zo's dtype
  here) at each loop count, each in a process of its own (a fresh peak, and a limit on its time): the first, which
  compiles, then one more; their seconds of CPU time (the process's: tinygrad runs the CPU's kernels in the calling
  thread, and PARALLEL=0 compiles there too) and of wall time (the machine is shared), and the peak of tinygrad's
  allocated bytes (GlobalCounters.mem_used) above the weights and the batch. A row may use --limit seconds of CPU time; a
  method whose row ran out of it at some depth is not run deeper."""
  stopped:set[str] = set()
  for L in args.loops:
    rows = []
    for spec in args.methods:
      if spec in stopped: continue
      cmd = [sys.executable, __file__, "cost-row", spec, str(L), "--seq", str(args.seq), "--batch", str(args.batch)]
      r = subprocess.run(cmd, capture_output=True, text=True, env=os.environ | {"PARALLEL": "0"},
                         preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_CPU, (args.limit, args.limit + 10)))
      if r.returncode == 0: row = json.loads(r.stdout.splitlines()[-1])
      elif r.returncode in (-signal.SIGXCPU, -signal.SIGKILL):  # the CPU time limit
        row = {"timeout": args.limit}
        stopped.add(spec)
      else: row = {"error": (r.stderr.strip().splitlines() or ["?"])[-1]}
      rows.append({"loops": L, "weights": "init", "what": spec, **row})
      print(f"L={L} {spec}: {row}", flush=True)
      save_rows("cost", rows)

def cost_row(spec:str, L:int, seq:int, size:int) -> dict:
  sys.path.insert(0, os.path.join(ROOT, "tests"))
  import bench  # its hook on Buffer.allocate keeps the peak of GlobalCounters.mem_used in bench.PEAK
  from tinygrad import GlobalCounters
  import estimators
  from zo import at_step, checked, compute_dtype
  method, pop = (spec.split(":") + ["1"])[:2]
  m = Looped(LoopedConfig.preset("tiny", vocab=2, seq_len=seq, loops=L), 0, compute_dtype())
  x, y = batch(seq, size)
  entry, resident = ESTIMATORS[method], GlobalCounters.mem_used
  run = entry.run(m, int(pop))
  d, opts, state = entry.defaults_for(run), values(entry, run), {"state": {}} if "state" in entry.takes else {}
  opt = Optimizer(m.params, learning_rates(m.params, d, None), "sgd", d.momentum, 0)
  def estimate(i:int) -> tuple: return estimators.run(m, x, y, method, int(pop), i, **opts, **at_step(entry, i), **state)
  def step(i:int) -> None:  # as zo.py's loop: the first step's kernels compiled ahead, then each step
    if i == 0: engine.compile_ahead(lambda: estimate(i), repr(("depth", spec, L, seq, size)))
    g, loss = estimate(i)
    opt.step(g)
    checked(m, loss, g, i, "")
  bench.PEAK[0] = GlobalCounters.mem_used
  times = [(time.process_time(), time.perf_counter())]
  for i in range(2):
    step(i)
    times.append((time.process_time(), time.perf_counter()))
  (c0, w0), (c1, w1), (c2, w2) = times
  return {"first_cpu": c1 - c0, "first_s": w1 - w0, "cpu": c2 - c1, "s": w2 - w1, "peak": bench.PEAK[0] - resident}

# ***** learning at depth *****

def evaluate(w:dict[str, np.ndarray], loops:int, seq:int, batches:int=8, size:int=64) -> dict[str, float]:
  """Val loss, accuracy, and the last position's accuracy (the parity of all seq bits) of float32 weights run at `loops`,
  on the first `batches` val batches of `size` sequences, loop by loop."""
  m = looped(loops, seq, "float32", w)
  p, step, out = Pass(m, None, None), engine.jit(forward_loop, m), []
  for i in range(batches):
    x, y = batch(seq, size, "val", i)
    x0 = embedded(p, x).contiguous().realize()
    h = x0.clone().realize()
    for _ in range(loops): h = step(h, x0, x).clone().realize()
    right = (p.linear("lm_head", norm(h, m.dtype)).argmax(-1) == y).float()  # the softcap keeps the logits' order
    out.append([m.head(p, h, y).mean().item(), right.mean().item(), right[:, -1].mean().item()])
  loss, acc, last = np.mean(out, 0)
  return {"loss": float(loss), "acc": float(acc), "last_acc": float(last)}

def cpu_seconds(pid:int) -> float:
  """The CPU time a process has used (user and system), from /proc."""
  with open(f"/proc/{pid}/stat") as f: fields = f.read().rsplit(")", 1)[1].split()
  return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

def learn_rows(args:argparse.Namespace) -> None:
  """Item 4: zo.py trains the looped model at each loop count with each method for the same seconds of CPU time of its
  steps (counted from the end of its first step, which compiles; CPU time, as the machine is shared: tinygrad runs the
  CPU's kernels in the calling thread, and PARALLEL=0 compiles there too), stopped then by SIGINT (zo saves its checkpoint
  and exits); the checkpoint is then evaluated at L, 2L and 4L loops."""
  for seq in args.tasks:
    for L in args.loops:
      rows = []
      for spec in args.methods:
        method, *pop = spec.split(":")
        out = os.path.join(ROOT, "runs", "depth", "learn", f"T{seq}-L{L}-{method}")
        cmd = [sys.executable, "zo.py", "--method", method, *(["--pop", pop[0]] if pop else []), "--optim", "adamw",
               "--model", "looped", "--loops", str(L), "--data", "synthetic:parity", "--vocab", "2", "--seq", str(seq),
               "--batch", str(args.batch), "--steps", "1000000", "--warmdown", "0", "--eval-every", "25",
               "--ckpt-every", "1000000", "--out", out, "--force"]
        print(" ".join(cmd[1:]), flush=True)
        log, start, stopped = os.path.join(out, "metrics.jsonl"), None, False
        with subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              env=os.environ | {"PARALLEL": "0"}) as proc:
          while proc.poll() is None:
            time.sleep(1)
            if start is None and os.path.exists(log) and os.path.getsize(log): start = cpu_seconds(proc.pid)
            if not stopped and start is not None and (cpu := cpu_seconds(proc.pid)) - start >= args.budget:
              proc.send_signal(signal.SIGINT)  # once: a second one would quit without saving
              stopped = True
        steps = [json.loads(line) for line in open(log)]
        row = {"loops": L, "weights": f"T{seq}", "what": spec, "steps": len(steps), "cpu": cpu - start,
               "first_s": steps[0]["seconds"], "seconds": steps[-1]["seconds"] - steps[0]["seconds"],
               "curve": [(r["step"], r["val_loss"]) for r in steps if "val_loss" in r],
               "eval": {str(k * L): evaluate(weights_of(out), k * L, seq) for k in (1, 2, 4)}}
        print(f"T={seq} L={L} {spec}: {row['steps']} steps in {row['cpu']:.0f} CPU s, " +
              ", ".join(f"at {k} loops val {e['loss']:.3f} acc {e['acc']:.3f}" for k, e in row["eval"].items()), flush=True)
        rows.append(row)
        save_rows("learn", rows)

# ***** the report *****

def rows(name:str) -> list[dict]:
  path = os.path.join(HERE, f"{name}.json")
  return json.load(open(path)) if os.path.exists(path) else []

def table(head:list[str], body:list[list]) -> str:
  return "\n".join(["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] + ["| " + " | ".join(map(str, r)) + " |" for r in body])

def report(args:argparse.Namespace) -> None:
  """Prints the tables of docs/depth.md (markdown) and draws docs/depth/cosine.png and val.png, from the rows only."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  grad, zo, cost, learn = rows("grad"), rows("zo"), rows("cost"), rows("learn")
  by = {(r["loops"], r["weights"], r["what"]): r for r in grad}
  sets = list(dict.fromkeys(r["weights"] for r in grad))
  keys = [(L, w) for L in sorted({r["loops"] for r in grad}) for w in sets if (L, w, "float64") in by]
  def rel(r:dict, t:str, cos:bool=False) -> str:  # a zero gradient has no cosine: its relative error is 1
    c = r["types"][t]
    return f"{c['rel']:.1e}" + (" (g = 0)" if math.isnan(c["cos"]) else f" ({1 - c['cos']:.0e})" if cos else "")
  def worst(r:dict) -> str:
    if math.isnan(r["types"]["whole"]["cos"]): return "g = 0"
    t = max((t for t in r["types"] if t not in ("block", "whole")), key=lambda t: r["types"][t]["rel"])
    return f"{r['types'][t]['rel']:.1e} ({t})"
  print("### Table 1: backprop's gradient against float64: relative error |g - g64| / |g64| (half's 1 - cosine)\n")
  print(table(["loops", "weights", "loss (float64)", "float32: block", "float32: worst type", "half: block", "half: all",
               "half, tinygrad's matmul: block"],
              [[L, w, f"{by[L, w, 'float64']['loss']:.4f}", rel(by[L, w, "float32"], "block"), worst(by[L, w, "float32"]),
                rel(by[L, w, "half"], "block", True), rel(by[L, w, "half"], "whole"), rel(by[L, w, "half, tinygrad's matmul"], "block")]
               for L, w in keys]))
  types = [t for t in next((r["types"] for r in grad if "types" in r), {}) if t not in ("block", "whole")]
  print("\n### Table 2: half (zo's GPU dtypes) per layer type: relative error (where the gradient is not zero)\n")
  print(table(["loops", "weights"] + types, [[L, w] + [f"{by[L, w, 'half']['types'][t]['rel']:.1e}" for t in types]
                                            for L, w in keys if (L, w, "half") in by and not math.isnan(by[L, w, "half"]["types"]["whole"]["cos"])]))
  zkeys = list(dict.fromkeys((r["loops"], r["weights"]) for r in sorted(zo, key=lambda r: (r["loops"], sets.index(r["weights"])))))
  zby, estimates = {(r["loops"], r["weights"], r["what"]): r for r in zo}, list(dict.fromkeys(r["what"] for r in zo))
  def cos(r:dict|None) -> str:
    return "-" if r is None else f"{r['types']['half']['block']['cos']:.3f} ({r['types']['half']['whole']['cos']:.3f})"
  print("\n### Table 3: cosine of each estimate to the float64 gradient, forwards in half: the block (all the weights)\n")
  print(table(["loops", "weights"] + estimates, [[L, w] + [cos(zby.get((L, w, e))) for e in estimates] for L, w in zkeys]))
  both = [r for r in zo if "float64" in r["types"]]
  gap = max((abs(r["types"]["half"][t]["cos"] - r["types"]["float64"][t]["cos"]) for r in both for t in ("block", "whole")), default=math.nan)
  print(f"\nOver the {len(both)} MeZO and ES rows, the cosine from half forwards and from float64 forwards of the same "
        f"directions differ by at most {gap:.4f}.")
  pairs, err32 = [e for e in estimates if e in ("mezo 16", "es 32")], [r["rewards"]["float32"] for r in both]
  def rew(r:dict|None) -> list[str]:
    if r is None: return ["-"] * 2
    d = r["rewards"]
    return [f"{d['rms']:.1e}", f"{d['half']:.1e} ({d['half'] / d['rms']:.1%})"]
  print("\n### Table 4: the rewards L(θ + εz) - L(θ - εz): their rms, and the rms of their error in half (its share)\n")
  print(table(["loops", "weights"] + [f"{e}: {c}" for e in pairs for c in ("rms", "half's error")],
              [[L, w] + [c for e in pairs for c in rew(zby.get((L, w, e)))] for L, w in zkeys]))
  print(f"\nIn float32 the rewards' error is {min(err32):.1e} to {max(err32):.1e} over the {len(both)} rows.")
  methods = list(dict.fromkeys(r["what"] for r in cost))
  def cell(r:dict|None) -> str:
    if r is None: return "-"
    if "timeout" in r: return f"over {r['timeout']} CPU s"
    if "error" in r: return "failed"
    return f"{r['cpu']:.2f} s, {r['peak'] / 2**20:.1f} MiB (first {r['first_cpu']:.0f} s)"
  cb = {(r["loops"], r["what"]): r for r in cost}
  print("\n### Table 5: a step's CPU seconds and peak allocated memory above the weights and the batch (first step's CPU "
        "seconds, compiling included)\n")
  print(table(["loops"] + methods, [[L] + [cell(cb.get((L, m))) for m in methods] for L in sorted({r["loops"] for r in cost})]))
  print("\n### Table 6: trained for the same CPU seconds: val loss, accuracy (last bit's accuracy) at L loops and at 2L, 4L\n")
  def ev(e:dict) -> str: return f"{e['loss']:.3f}, {e['acc']:.3f} ({e['last_acc']:.2f})"
  print(table(["task", "L", "method", "steps", "CPU s", "at L", "at 2L", "at 4L"],
              [[f"parity {r['weights'][1:]}", r["loops"], r["what"], r["steps"], f"{r['cpu']:.0f}", *[ev(e) for e in r["eval"].values()]]
               for r in sorted(learn, key=lambda r: (int(r["weights"][1:]), r["loops"]))]))
  figures(plt, grad, zo, learn)

STYLE = {"init": dict(linestyle="-", marker="o"), "trained": dict(linestyle="--", marker="s", markerfacecolor="none")}

def figures(plt:Any, grad:list[dict], zo:list[dict], learn:list[dict]) -> None:
  """cosine.png: backprop's relative error against the loop count per precision, and every estimate's cosine per
  method; val.png: val loss at L, 2L and 4L loops against the training depth L, per method, for each task trained at
  two depths or more."""
  fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
  for i, prec in enumerate(PRECISIONS[1:]):
    for w in ("init", "trained"):
      rs = sorted((r for r in grad if r["what"] == prec and r["weights"] == w), key=lambda r: r["loops"])
      a.plot([r["loops"] for r in rs], [r["types"]["block"]["rel"] for r in rs], color=f"C{i}", label=f"{prec}, {w}",
             markersize=8 - 3 * i, **STYLE[w])
  for u, name in ((2 ** -11, "half's unit roundoff"), (2 ** -24, "float32's unit roundoff")):
    a.axhline(u, color="gray", linewidth=0.8, linestyle=":")
    a.annotate(name, (1, u), xytext=(0, 3), textcoords="offset points", fontsize=7, color="gray")
  a.set(xscale="log", yscale="log", xlabel="loops", ylabel="relative error of the block's gradient",
        title="backprop against float64")
  a.legend(fontsize=7)
  lines = [("backprop half", [r for r in grad if r["what"] == "half"], lambda r: r["types"]["block"]["cos"])]
  for what in dict.fromkeys(r["what"] for r in zo):
    lines.append((f"{what} (half)", [r for r in zo if r["what"] == what], lambda r: r["types"]["half"]["block"]["cos"]))
  for i, (name, rs, f) in enumerate(lines):
    for w in ("init", "trained"):
      rw = sorted((r for r in rs if r["weights"] == w), key=lambda r: r["loops"])
      b.plot([r["loops"] for r in rw], [f(r) for r in rw], color=f"C{i}", label=name if w == "init" else None, **STYLE[w])
  b.set(xscale="log", xlabel="loops", ylabel="cosine to the float64 gradient (block)",
        title="every estimate (solid: initial weights, dashed: trained)")
  b.legend(fontsize=7)
  for ax in (a, b): ax.grid(alpha=0.3)
  fig.tight_layout()
  fig.savefig(os.path.join(HERE, "cosine.png"), dpi=90)
  tasks = [t for t in sorted({r["weights"] for r in learn}, key=lambda t: int(t[1:]))
           if len({r["loops"] for r in learn if r["weights"] == t}) > 1]
  fig, axes = plt.subplots(1, max(1, len(tasks)), figsize=(5.5 * max(1, len(tasks)), 4), sharey=True, squeeze=False)
  for ax, task in zip(axes[0], tasks):
    budget = max(r["cpu"] for r in learn if r["weights"] == task)
    for i, what in enumerate(dict.fromkeys(r["what"] for r in learn)):
      rs = sorted((r for r in learn if r["weights"] == task and r["what"] == what), key=lambda r: r["loops"])
      for k, style in zip((1, 2, 4), ("-", "--", ":")):
        ax.plot([r["loops"] for r in rs], [r["eval"][str(k * r["loops"])]["loss"] for r in rs], style, marker="o",
                color=f"C{i}", label=f"{what}, evaluated at {k}L" if k > 1 else f"{what}, evaluated at L")
    ax.axhline(math.log(2), color="gray", linewidth=0.8)
    ax.annotate("chance (ln 2)", (1, math.log(2)), xytext=(0, 3), textcoords="offset points", fontsize=7, color="gray")
    ax.set(xscale="log", xlabel="training loops L", title=f"parity of {task[1:]} bits, {budget:.0f} CPU s each")
    ax.grid(alpha=0.3)
  axes[0][0].set(ylabel="val loss")
  axes[0][0].legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(os.path.join(HERE, "val.png"), dpi=90)

def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("command", choices=("grad", "zo", "cost", "cost-row", "learn", "report"))
  p.add_argument("spec", nargs="*", help=argparse.SUPPRESS)  # cost-row's METHOD[:POP] LOOPS
  p.add_argument("--loops", type=int, nargs="+", default=[1, 4, 16, 64, 256, 1024])
  p.add_argument("--seq", type=int, default=16, help="parity's sequence length")
  p.add_argument("--batch", type=int, default=16, help="sequences a batch")
  p.add_argument("--steps", type=int, default=100, help="grad, zo: AdamW steps of the trained weights")
  p.add_argument("--deep", type=int, default=256, help="grad, zo: deeper than this, the trained weights take --steps-deep")
  p.add_argument("--steps-deep", type=int, default=25)
  p.add_argument("--lr-loops", type=int, default=16, help="grad, zo: deeper than this, the trained weights take --lr-deep")
  p.add_argument("--lr-deep", type=float, default=2e-4)
  p.add_argument("--default-lr", type=int, nargs="*", default=[64], help="grad, zo: loop counts that also get weights "
                 "trained at the default lr")
  p.add_argument("--zo", nargs="+", default=["mezo:16", "es:32"], help="zo: METHOD:POP at every loop count")
  p.add_argument("--zo-shallow", nargs="+", default=["mezo:256", "es:256", "dust:256", "dust:1024"],
                 help="zo: METHOD:POP up to --shallow loops")
  p.add_argument("--shallow", type=int, default=16)
  p.add_argument("--methods", nargs="+", default=["backprop", "mezo:16", "es:32", "dust:256"], help="cost, learn")
  p.add_argument("--limit", type=int, default=600, help="cost: CPU seconds a row may take")
  p.add_argument("--tasks", type=int, nargs="+", default=[8, 16], help="learn: parity's sequence lengths")
  p.add_argument("--budget", type=float, default=300, help="learn: CPU seconds of steps a run gets")
  args = p.parse_args()
  if args.command == "cost-row": return print(json.dumps(cost_row(args.spec[0], int(args.spec[1]), args.seq, args.batch)))
  {"grad": grad_rows, "zo": zo_rows, "cost": cost_rows, "learn": learn_rows, "report": report}[args.command](args)

if __name__ == "__main__": main()
