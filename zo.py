#!/usr/bin/env python3
"""zo: train a network with forward passes only. The command line, the training loop, checkpoints, evaluation and sampling.

The estimators are in estimators.py (MeZO, ES) and dust.py (Dust), the optimizer in optim.py, the models in model.py; README has the
math. How zo runs fast on tinygrad is in engine.py, and which kernels run where in kernels/__init__.py.
"""
from __future__ import annotations
import argparse, contextlib, fcntl, inspect, json, math, os, signal, socket, sys, threading, time
from typing import Any, Callable
import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file
from tqdm import tqdm
from tinygrad import Device, Tensor, dtypes
from kernels.noise import NOISES
from data import BPE, Bytes
from devices import names, shares
from estimators import ESTIMATORS, TOKENS, Compact, Flat, estimate, run
from optim import Optimizer, group_lrs
import dust, engine, kernels

# ***** training: checkpoints, evaluation, the loop *****

class UsageError(Exception): pass  # a mistake the user can fix: one line, exit code 2, no traceback

def step_key(seed:int, step:int) -> int: return (seed << 32) | step  # the key words are (step, seed)

def save(out:str, model, opt:Optimizer, step:int):
  """Atomic: write a temp file, fsync it, rename it over the old checkpoint, so a crash mid-save leaves the previous one intact.
  Written from host copies by the safetensors package: tinygrad's safe_save goes through its CPU device, which compiles helper
  programs with clang even under DEV=CUDA, so a GPU machine without clang lost the whole run at its first checkpoint.
  A write that fails (a full disk, a file size limit, permissions) stops the run with the path and the OS's error, the temp file
  removed and the previous checkpoint as it was."""
  path, tmp = os.path.join(out, "model.safetensors"), os.path.join(out, "model.safetensors.tmp")
  tensors = {k: t.numpy() for k, t in {**{f"param.{n}": p for n, p in model.params.items()}, **opt.state()}.items()}
  try:
    save_file(tensors, tmp, metadata={"step": str(step)})
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(tmp, 0o666 & ~mask)  # safetensors creates its file private (0600); a checkpoint gets the mode of any file the user writes
    with open(tmp, "rb+") as f: os.fsync(f.fileno())
    os.replace(tmp, path)
  except (OSError, SafetensorError) as e:
    with contextlib.suppress(OSError): os.remove(tmp)
    kept = f"the checkpoint of an earlier step is intact in {path}" if os.path.exists(path) else "no checkpoint was written"
    raise UsageError(f"cannot write the checkpoint of step {step} to {tmp}: {e}; {kept}") from None

def load_checkpoint(out:str, model, flag:str, keep:str="") -> tuple[dict[str, Tensor], int]:
  """The model's parameters set from the checkpoint in out; returns the checkpoint's tensors whose names start with `keep`, and its step."""
  path = os.path.join(out, "model.safetensors")
  hint = f"--force starts the run in {out} over" if flag == "--resume" else "train a run there first"
  if not os.path.exists(path): raise UsageError(f"{flag}: no checkpoint at {path}; {hint}")  # a run killed before its first save
  try:
    with safe_open(path, "np") as f:
      st, step = {k: Tensor(f.get_tensor(k)) for k in f.keys() if k.startswith(keep)}, int((f.metadata() or {})["step"])
  except (OSError, SafetensorError, KeyError, ValueError) as e:
    problem = "no step in its metadata" if isinstance(e, KeyError) else str(e)
    raise UsageError(f"{flag}: cannot read the checkpoint {path} ({problem}); {hint}") from None
  for n, p in model.params.items():
    if f"param.{n}" not in st or st[f"param.{n}"].shape != p.shape:
      what = "no" if f"param.{n}" not in st else f"a {st[f'param.{n}'].shape} (the model's is {p.shape})"
      raise UsageError(f"{flag}: {path} holds another model: {what} tensor param.{n}; {hint}")
    p.assign(st[f"param.{n}"].to(p.device)).realize()
  return st, step

def resume(out:str, model, opt:Optimizer) -> int:
  st, step = load_checkpoint(out, model, "--resume")
  opt.load(st)
  return step

def mean_loss(model, x:Tensor, y:Tensor, **kw) -> Tensor: return model.losses(x, y, **kw).mean().realize()

def val_loss(model, data, args, batches:int=4) -> float:
  """The mean loss over the first validation batches, as a JIT, whose memory plan lives in the arena every JIT shares (engine.Scratch):
  an eager forward keeps every materialized activation until its schedule ends (the dust preset at 8x2048 tokens: 5.3 GiB eagerly,
  0.4 GiB in a JIT)."""
  kw = {"loops": args.eval_loops} if args.model == "looped" and args.eval_loops else {}
  jit = engine.jit(mean_loss, model, **kw)
  return float(np.mean([jit(*map(Tensor, data.batch("val", i, args.batch, args.seq))).item() for i in range(batches)]))

def compute_dtype():  # half precision (float32 accumulation, float32 master weights) on accelerators; float32 on the CPU
  return dtypes.float32 if Device.DEFAULT == "CPU" else dtypes.half

def make_model(args):
  from model import GPT, GPTConfig, Looped, LoopedConfig
  over = {"vocab": args.vocab} if args.vocab else {}
  if args.model == "looped":
    model = Looped(LoopedConfig.preset("tiny", **over, **({"loops": args.loops} if args.loops else {})), args.seed, compute_dtype())
  else: model = GPT(GPTConfig.preset(args.model, **over), args.seed, compute_dtype())
  args.seq = args.seq or model.cfg.seq_len
  return model

def text_tokenizer(args, flag:str|None=None) -> Bytes|BPE:
  """--tokenizer for --data: bytes, or a BPE: under `flag` (--resume, --sample) the run's own, OUT/tokenizer.json, else one trained
  on the text. A BPE of size N sets --vocab to N."""
  from data import bpe_size, tokenizer
  saved = os.path.join(args.out, "tokenizer.json")
  if flag and bpe_size(args.tokenizer) and not os.path.exists(saved):
    raise UsageError(f"{flag}: {args.out} has no tokenizer.json: it is not a run of --tokenizer {args.tokenizer}")
  tok = tokenizer(args.tokenizer, args.data, saved if flag else None)
  if isinstance(tok, BPE):
    if args.vocab not in (None, tok.vocab): raise UsageError(f"--vocab {args.vocab}: --tokenizer {tok.spec} sets the vocab to {tok.vocab}")
    args.vocab = tok.vocab
  return tok

SCALES = ("direct_scale", "qkv_scale")  # Dust's multiples of its recipe's draws: --direct-scale, --qkv-scale

def typed(dest:str) -> str: return dest.replace("_", "-")  # a flag's argparse name as the user types it (less its dashes)

def budget(tokens:int) -> str:
  """Dust's recipe for a run of this many tokens: the release tuned its recipes for 1M and 10M tokens; a run takes the nearer one on a
  log scale (10M above 3.16M)."""
  return "10M" if tokens > math.sqrt(1e6 * 1e7) else "1M"

def takes(method:str) -> set[str]: return set(inspect.signature(ESTIMATORS[method]).parameters)  # the options an estimator names

def options(args, tokens:int) -> dict:
  """The flags that the method's estimator takes, by the names of its parameters."""
  flags = {"eps": args.eps, "sigma": args.sigma, "shaping": args.shaping, "rank": args.rank, "devices": args.devices,
           "optimizer": args.optim, "noise": args.noise, "head": args.head, "direct_scale": args.direct_scale, "qkv_scale": args.qkv_scale,
           "budget": budget(tokens)}
  return {k: v for k, v in flags.items() if k in takes(args.method)}

def run_config(path:str) -> dict:  # a run from before --tokenizer, --noise, --head, --direct-scale or --qkv-scale: bytes, Gaussians, slabs, 1, 1
  return {"tokenizer": "bytes", "noise": "gaussian", "head": "slabs", "direct_scale": 1.0, "qkv_scale": 1.0} | json.load(open(path))

def dust_recipe(args, pop:int, tokens:int, model) -> dust.Recipe:
  """The run's Dust recipe, made before anything is written: a --direct-scale or --qkv-scale whose counts don't split into chunks
  stops here."""
  def make(direct:float, qkv:float) -> dust.Recipe:
    return dust.recipe(pop, budget(tokens), args.optim, model.n_pblocks, args.noise, direct_scale=direct, qkv_scale=qkv)
  try: return make(args.direct_scale, args.qkv_scale)
  except ValueError as e:
    make(1.0, 1.0)  # a fault of the population or the optimizer itself is reported as such
    scales = " ".join(f"--{typed(f)} {getattr(args, f)}" for f in SCALES if getattr(args, f) != 1)
    raise UsageError(f"{scales}: {e}") from None

def same_run(flag:str, args, keys:tuple[str, ...]):
  """Check that the run in --out was made with these flags' values: another one is refused, each named as it is typed."""
  path = os.path.join(args.out, "config.json")
  if not os.path.exists(path): raise UsageError(f"{flag}: no run in {args.out}")
  old = run_config(path)
  if diff := [k for k in keys if old.get(k) != getattr(args, k)]:
    flags = [typed(k) for k in diff]
    raise UsageError(f"{flag}: {args.out} was trained with other {', '.join(flags)} ({', '.join(f'{f}={old.get(k)}' for f, k in zip(flags, diff))})")

def check_sizes(args, model, rc:dust.Recipe|None):
  """Sizes that can't run, refused before any work or any file. A chunked loop (engine.stack, engine.mean) numbers its items from 0:
  mezo's directions and es's pairs on each device, Dust's chunks of each group's draws across the devices; each call's first item
  is bound to engine.START, at most START.vmax, and the last call, of c items, starts at n - c. And a step whose memory plainly
  exceeds the machine's (forward_bytes)."""
  most, B, T = engine.START.vmax, args.batch, args.seq
  if args.method in ("mezo", "es"):
    what = "directions" if args.method == "mezo" else "antithetic pairs"
    if max(len(r) - engine.per_call(len(r), B * T, TOKENS) for r in shares(population(args), args.devices)) > most:
      fits = (most + 1) * args.devices * (1 if args.method == "mezo" else 2)
      raise UsageError(f"--pop {args.pop}: {args.method}'s kernels number its {what} up to {most + 1:,} a device: --pop {fits:,} fits")
  if rc:
    cap, S = dust.TOKENS if kernels.batches_chunks(Device.DEFAULT) else 0, dust.slabs(model)
    counts = [*rc.writers, *rc.hidden, *rc.hubs, rc.embedding, *(c for v in rc.local.values() for c in v)]
    groups = [(c // rc.nrep, rc.nrep * B * T, 1) for c in counts] + [(rc.head // rc.nrep, S * rc.nrep * B * T, S)] * (args.head == "slabs")
    # the last device's share of whole units of chunks holds the last call
    if (n := max(n - engine.per_call(len(shares(n // u, args.devices)[-1]), t, cap) * u for n, t, u in groups)) > most:
      raise UsageError(f"--pop {args.pop}: Dust's kernels number a group's chunks of draws up to {most + 1:,}, and one starts a call at {n:,}")
  need, have = forward_bytes(args, model, rc), device_memory()
  if have and need > have:
    raise UsageError(f"--batch {B} --seq {T}: a step needs at least {need / 2**30:,.1f} GiB, this machine has {have / 2**30:,.1f} GiB: "
                     f"--batch {max(1, B * have // need):,} may fit")

def population(args) -> int: return args.pop // 2 if args.method == "es" else args.pop  # mezo's directions, es's antithetic pairs

def forward_bytes(args, model, rc:dust.Recipe|None) -> int:
  """A lower bound of a step's memory: one forward's tokens (the batch times the directions a call of mezo and es, or Dust's draws of a
  chunk) hold at once an MLP's input and hidden layer (1 + 4 widths) or the head's input and logits (a width and the vocab), each a
  matmul's output, in the compute dtype. The peak is higher: --batch 100000 at the tiny preset held 9 GB in its first step on the CPU."""
  c = rc.nrep if rc else engine.per_call(population(args), args.batch * args.seq, TOKENS) if args.method in ("mezo", "es") else 1
  return c * args.batch * args.seq * max(5 * model.cfg.n_embd, model.cfg.n_embd + model.cfg.vocab) * compute_dtype().itemsize

def device_memory() -> int|None:  # the CPU's is the machine's RAM; tinygrad doesn't tell a GPU's
  return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") if Device.DEFAULT.split(":")[0] == "CPU" else None

_locks:dict[str, int] = {}  # the run folders this process holds: their lock files' descriptors, open for the process's life

def lock(out:str):
  """One writer per run folder: an exclusive flock on OUT/lock, taken before anything in the folder changes and held until the process
  ends, when the OS releases it (kill -9 included), so a crashed run never blocks the next. The file names its holder's pid and host,
  for the refusal of a second run."""
  if not out: raise UsageError("--out is empty: name a folder for the run")
  if (key := os.path.realpath(out)) in _locks: return  # this process holds it already (zo.main called again in one process)
  with files("--out"):
    os.makedirs(out, exist_ok=True)
    fd = os.open(os.path.join(out, "lock"), os.O_RDWR | os.O_CREAT, 0o666)
  try: fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
  except BlockingIOError:
    pid, host = (os.read(fd, 256).decode(errors="replace").split() + ["?", "?"])[:2]
    raise UsageError(f"{out} is in use by a live run, pid {pid} on {host}: wait for it, stop it, or pick another --out") from None
  os.ftruncate(fd, 0)
  os.write(fd, f"{os.getpid()} {socket.gethostname()}\n".encode())
  _locks[key] = fd

@contextlib.contextmanager
def files(what:str):
  """An OSError of a run folder's file (a path under a file, too long a name, a directory where a file goes, a full disk) as one
  line naming the path and the OS's error."""
  try: yield
  except OSError as e: raise UsageError(f"{what}: {e.filename}: {e.strerror}" if e.filename else f"{what}: {e}") from None

def prepare(args, config:dict, model, opt:Optimizer) -> tuple[int, float]:
  """The run folder made ready under its lock, each check before anything changes: --resume's checkpoint loaded and its log trimmed to
  it; or a fresh run's refusal of another run's folder, or --force's deletion of that run. Then config.json, metrics.jsonl checked
  writable first. Returns the step to start at, and the seconds its steps took before a --resume."""
  cfg_path, log_path = os.path.join(args.out, "config.json"), os.path.join(args.out, "metrics.jsonl")
  if os.path.exists(args.out) and not os.path.isdir(args.out): raise UsageError(f"--out {args.out}: not a directory")
  if args.resume:
    same_run("--resume", args, ("method", "model", "vocab", "seq", "loops", "optim", "pop", "rank", "replay", "tokenizer", "noise", "head",
                                *SCALES))
  lock(args.out)
  start, trained = 0, 0.0
  with files("--out"):
    if args.resume:
      start = resume(args.out, model, opt)
      keep = [line for line in open(log_path) if logged_step(line) < start] if os.path.exists(log_path) else []
      with open(log_path, "w") as f: f.writelines(keep)  # steps logged after the checkpoint are run again
      trained = json.loads(keep[-1])["seconds"] if keep else 0.0
    elif not args.force and (os.path.exists(cfg_path) or os.path.exists(log_path)):
      if not os.path.exists(os.path.join(args.out, "model.safetensors")):
        raise UsageError(f"{args.out} holds a run with no checkpoint yet, nothing to resume: pass --force to start it over")
      raise UsageError(f"{args.out} holds another run: pass --resume to continue it or --force to overwrite")
    # --force: nothing of the old run stays; --resume drops the temp file of a save cut short
    old = [p for f in ("model.safetensors.tmp",) + (() if args.resume else ("metrics.jsonl", "model.safetensors", "tokenizer.json"))
           if os.path.exists(p := os.path.join(args.out, f))]
    if bad := next((p for p in old if os.path.isdir(p) and not os.path.islink(p)), None):
      raise UsageError(f"cannot delete {bad}: it is a directory; nothing was deleted")
    for p in old: os.remove(p)
    open(log_path, "a").close()  # writable, before config.json is written
    json.dump(config, open(cfg_path, "w"), indent=1)
  return start, trained

def train(args):
  from data import load
  tok = text_tokenizer(args, "--resume" if args.resume else None)  # resumed, a run keeps its tokenizer, whatever the text is now
  model = make_model(args)
  if args.seq > model.cfg.seq_len: raise UsageError(f"--seq {args.seq} is longer than the model's context of {model.cfg.seq_len}")
  data = load(args.data, model.cfg.vocab, args.seq, args.seed, tok)
  steps = args.steps or max(1, args.tokens // (args.batch * args.seq))
  tokens = steps * args.batch * args.seq
  lrs, momentum = group_lrs(model, args.method, args.optim, args.lr, args.pop, budget(tokens))
  opt = Optimizer(model.params, lrs, args.optim, args.momentum or momentum, args.replay)
  rc = dust_recipe(args, args.pop, tokens, model) if args.method == "dust" else None
  warmdown = rc.warmdown if rc else 0.0
  if args.warmdown is not None: warmdown = args.warmdown
  config = {k: v for k, v in vars(args).items() if k not in ("resume", "force", "cosine", "sample", "prompt", "temperature", "top_k")}
  check_sizes(args, model, rc)
  start, trained = prepare(args, config, model, opt)  # the step to start at, and the seconds its steps took before a --resume
  if isinstance(tok, BPE) and not args.resume: tok.save(os.path.join(args.out, "tokenizer.json"))
  what = args.method if args.method == "backprop" else f"{args.method} pop {args.pop}"  # backprop has no population
  path = kernels.path(Device.DEFAULT)
  print(path)  # which kernels run here
  print(f"{what} on {type(model).__name__} ({model.num_params():,} params), {data.name}, {steps} steps of "
        f"{args.batch}x{args.seq} tokens" + (f"; the loss floor of this data is {data.floor:.3f}" if data.floor is not None else ""))
  stop:list[int] = []  # Ctrl-C (SIGINT) or a scheduler's SIGTERM: the step in flight finishes and saves; a second one quits at once
  saved = [start]  # the step of the checkpoint on disk (0: none)
  def kept() -> str: return f"the checkpoint of step {saved[0]} in {args.out} is kept" if saved[0] else "no checkpoint is saved yet"
  val, t0 = None, time.perf_counter() - trained  # a resumed run's seconds go on from its parts' sum (its compiling counted again)
  print("the first step and the first evaluation compile their kernels (tinygrad caches them for the next run)")
  opts = options(args, tokens)
  def estimate(x:Tensor, y:Tensor, step:int): return run(model, x, y, args.method, args.pop, step_key(args.seed, step), **opts)
  # the work a step does, for the cache of which kernels it compiled (engine.compile_ahead)
  work = repr((args.method, args.pop, opts, model.cfg, args.batch, args.seq, path))
  with on_signals(stop, kept), open(os.path.join(args.out, "metrics.jsonl"), "a") as log, \
       tqdm(initial=start, total=steps, dynamic_ncols=True, desc="compiling") as bar:
    for step in range(start, steps):
      x, y = map(Tensor, data.batch("train", step, args.batch, args.seq))
      ts = time.perf_counter()
      if step == start: engine.compile_ahead(lambda: estimate(x, y, step), work)  # all of the step's kernels at once, then the step
      g, loss = estimate(x, y, step)
      opt.scale = min(1.0, (steps - step) / (warmdown * steps)) if warmdown else 1.0
      opt.step(g)  # queued before the check's read, which waits for it: a bad step stops the run before anything saves its weights
      loss = checked(model, loss, g, step, args.out)
      dt = time.perf_counter() - ts
      rec = {"step": step, "tokens": (step + 1) * args.batch * args.seq, "train_loss": loss, "seconds": round(time.perf_counter() - t0, 3)}
      if step % args.eval_every == 0 or step == steps - 1:
        bar.set_description_str("evaluating")
        rec["val_loss"] = val = val_loss(model, data, args)
      bar.set_description_str("")
      log.write(json.dumps(rec) + "\n"); log.flush()
      bar.set_postfix(loss=f"{loss:.3f}", val=f"{val:.3f}" if val is not None else "-", tok_s=f"{args.batch * args.seq / dt:,.0f}",
                      draws_s=f"{args.pop / dt:,.0f}")
      bar.update()  # counted when the step is done (iterating the bar would count it when the next one begins)
      if (step + 1) % args.ckpt_every == 0 or step == steps - 1 or stop:
        save(args.out, model, opt, step + 1)
        saved[0] = step + 1
      if stop:
        bar.write(f"{signal.Signals(stop[0]).name}: interrupted after {step + 1} steps: checkpoint saved in {args.out}; continue with "
                  "--resume", file=sys.stderr)  # a line of its own, not one the bar redraws over
        sys.exit(128 + stop[0])  # the shell's code for a process ended by that signal: 130 for SIGINT, 143 for SIGTERM

@contextlib.contextmanager
def on_signals(stop:list[int], kept:Callable[[], str]):
  """SIGINT and SIGTERM: the first appends to `stop`, for the loop to stop after the step in flight, and says so at once; the second
  quits at once, with the exit code of a process ended by it. A thread sees them, on the pipe that Python's C-level handler writes
  each signal to: a Python handler runs only between the main thread's bytecodes, so it waits for a kernel or a compile in C code
  (minutes in a cold first step, past a scheduler's grace period). Quitting mid-save leaves the last checkpoint whole: a save is the
  rename of a finished temp file, which --resume drops. On leaving, the handlers before are back."""
  r, w = os.pipe()
  os.set_blocking(w, False)
  wakeup, handlers = signal.set_wakeup_fd(w, warn_on_full_buffer=False), {s: signal.signal(s, lambda *_: None) for s in SIGNALS}
  def watch():
    while b := os.read(r, 1):
      name = signal.Signals(b[0]).name
      if stop:
        print(f"\n{name}: quitting now; {kept()}", file=sys.stderr, flush=True)
        os._exit(128 + b[0])  # the shell's code for a process ended by that signal: 130 for SIGINT, 143 for SIGTERM
      stop.append(b[0])
      print(f"\n{name}: stopping after this step; {kept()}; {name} again to quit now", file=sys.stderr, flush=True)
    os.close(r)
  threading.Thread(target=watch, daemon=True).start()
  try: yield
  finally:
    signal.set_wakeup_fd(wakeup)
    for sig, h in handlers.items(): signal.signal(sig, h)
    os.close(w)  # the thread reads the end of the pipe, and ends

SIGNALS = (signal.SIGINT, signal.SIGTERM)  # Ctrl-C, and a scheduler's (docker stop, kill) before its kill -9

def logged_step(line:str) -> float:  # a line torn by a crash mid-write counts as not logged
  try: return json.loads(line)["step"]
  except (ValueError, KeyError, TypeError): return math.inf

def squares(loss:Tensor, named:dict[str, Tensor]) -> Tensor:
  # each sum realized on its own: tinygrad fused the small preset's 46 sums into a kernel that took 2.2 s to lower and compile for the
  # GPU (2 CPU cores) and bounded its batch of a cold first step (H100: 3.3 s); the slowest of the 7 programs now takes 0.28 s
  return Tensor.stack(loss.float().reshape(()), *[t.float().square().sum().contiguous() for t in named.values()])

def checked(model, loss:Tensor, g:Compact|Flat|dict[str, Tensor], step:int, out:str) -> float:
  """The step's loss, once it and the estimate are seen to be finite: one JIT and one read from the device (built eagerly at every
  step, the sums' graph took longer than a small model's whole step); backprop's JIT makes the sums with its gradient. A Flat is
  summed whole (one sum a parameter was 42 kernels at the small preset), and only a non-finite one is searched for the parameter."""
  if isinstance(g, Flat):
    named, vals = {"the gradient": g.buf}, engine.read(g.sums)
  else:
    named = {"coefficients": g.coef} if isinstance(g, Compact) else g
    vals = engine.read(engine.jit(squares)(loss, named))
  if not math.isfinite(vals[0]): raise UsageError(f"step {step}: the training loss is {vals[0]}; the last good checkpoint is in {out}")
  if bad := [n for n, v in zip(named, vals[1:]) if not math.isfinite(v)]:
    if isinstance(g, Flat): bad = [n for n, t in g.dense(model.params).items() if not t.isfinite().all().item()] or bad
    raise UsageError(f"step {step}: the estimate of {bad[0]} is not finite; the last good checkpoint is in {out}")
  return float(vals[0])

# ***** --cosine: how close is each estimate to the backprop gradient, per layer type *****

LAYER_TYPES = (("mlp in", "mlp.c_fc"), ("mlp out", "mlp.c_proj"), ("attn out", "attn.c_proj"), ("q", "c_q"), ("k", "c_k"), ("v", "c_v"),
               ("gate", "ve_gate"), ("ve", "value_embeds"), ("wte", "wte"), ("head", "lm_head"), ("scalars", "lambdas"))
def layer_type(name:str) -> str: return next(t for t, pat in LAYER_TYPES if pat in name)

def cosines(g:dict[str, Tensor], ref:dict[str, Tensor]) -> dict[str, float]:
  """cos(g, ref) per layer type, over the concatenation of that type's tensors."""
  out = {}
  for t in dict.fromkeys(layer_type(n) for n in ref):
    names = [n for n in ref if layer_type(n) == t]
    a, b = (np.concatenate([d[n].float().numpy().ravel() for n in names]) for d in (g, ref))
    out[t] = float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b) + 1e-30))
  return out

def cosine_table(args):
  """--cosine: for each --pop, the cosine of the estimate to the backprop gradient per layer type, on the first training batch; at
  initialisation, or with --resume at the weights of the checkpoint in --out, where estimators differ more than at initialisation
  and two settings of one can be compared on the same trained weights. The run's model and data must be the flags' (--model,
  --vocab, --loops, --tokenizer, --data, --seed); the estimator's flags, --batch and --seq are free."""
  from data import load
  flag = "--cosine --resume" if args.resume else None
  tok = text_tokenizer(args, flag)
  model = make_model(args)
  where = "initialisation"
  if flag:
    same_run(flag, args, ("model", "vocab", "loops", "tokenizer", "data", "seed"))
    lock(args.out)  # no training run writes the checkpoint while it is read
    where = f"the checkpoint of step {load_checkpoint(args.out, model, flag, keep='param.')[1]} in {args.out}"
  if args.method == "dust":
    for pop in args.pops: dust_recipe(args, pop, args.tokens, model)  # a scale that doesn't split stops before any work
  x, y = map(Tensor, load(args.data, model.cfg.vocab, args.seq, args.seed, tok).batch("train", 0, args.batch, args.seq))
  print(kernels.path(Device.DEFAULT))
  ref = estimate(model, x, y, "backprop", 1, 0)
  rows = {pop: cosines(estimate(model, x, y, args.method, pop, step_key(args.seed, 0), **options(args, args.tokens)), ref) for pop in args.pops}
  types = list(next(iter(rows.values())))
  print(f"cosine of {args.method} to the backprop gradient, one batch of {args.batch}x{args.seq}, at {where}\n" + f"{'pop':>7} " +
        " ".join(f"{t:>8}" for t in types))
  for pop, r in rows.items(): print(f"{pop:>7} " + " ".join(f"{r[t]:>8.3f}" for t in types))

# ***** --sample: text from a checkpoint *****

def last_logits(model, window:Tensor, last:Tensor) -> Tensor: return model.logits(window)[0, last]

def next_logits(model, ids:list[int]) -> np.ndarray:
  """The logits [V] that follow ids, at one shape, [1, context], so one TinyJit serves every step: the last `context` ids left-aligned
  in the window and padded with 0s, which the causal model does not see from the positions before them."""
  T = model.cfg.seq_len
  ctx = ids[-T:]  # the window slides once the text is longer than the context
  window = np.zeros((1, T), np.int32)
  window[0, :len(ctx)] = ctx
  return engine.jit(last_logits, model)(Tensor(window), Tensor([len(ctx) - 1], dtype=dtypes.int32)).numpy()[0]

def next_probs(logits:np.ndarray, temperature:float, top_k:int|None) -> np.ndarray:
  """softmax(logits / temperature) over the top_k largest logits (all of them for None), 0 elsewhere; in float64."""
  z = logits.astype(np.float64) / temperature
  if top_k is not None and top_k < len(z): z[np.argsort(z, kind="stable")[:-top_k]] = -np.inf  # a tie goes to the later index: k stay
  p = np.exp(z - z.max())
  return p / p.sum()

def generate(model, ids:list[int], n:int, temperature:float, top_k:int|None, seed:int) -> list[int]:
  """ids and n tokens after them, each drawn from next_probs by NumPy on the host: the same seed gives the same text on every backend."""
  rng, ids = np.random.default_rng(seed), list(ids)
  for _ in range(n):
    p = next_probs(next_logits(model, ids), temperature, top_k)
    ids.append(int(rng.choice(len(p), p=p)))
  return ids

def prompt_ids(tok:Bytes|BPE, prompt:str, vocab:int) -> list[int]:
  if not prompt: raise UsageError("--prompt is empty: the model needs a token to start from")
  if bad := next((c for c in prompt if tok.encode(c).max() >= vocab), None):
    raise UsageError(f"--prompt: {bad!r} is token {tok.encode(bad).max()}, outside the model's vocab of {vocab}")
  return tok.encode(prompt).tolist()

def sample(args):
  """--sample N: N tokens after --prompt from the checkpoint in --out, printed as text; the rate goes to stderr, so stdout is the text."""
  if not os.path.exists(cfg_path := os.path.join(args.out, "config.json")): raise UsageError(f"--sample: no run in {args.out} (no config.json)")
  run = argparse.Namespace(**run_config(cfg_path) | {"out": args.out})
  tok = text_tokenizer(run, "--sample")
  model = make_model(run)
  load_checkpoint(args.out, model, "--sample", keep="param.")
  ids = prompt_ids(tok, args.prompt, model.cfg.vocab)
  print(kernels.path(Device.DEFAULT), file=sys.stderr)  # stdout is the text
  t0 = time.perf_counter()
  next_logits(model, ids)  # compiles and captures the JIT, which the rate leaves out
  t1 = time.perf_counter()
  ids = generate(model, ids, args.sample, args.temperature, args.top_k, args.seed)
  t2 = time.perf_counter()
  print(tok.decode(ids))
  print(f"{args.sample} tokens at {args.sample / (t2 - t1):,.1f} tokens/s ({t1 - t0:.1f} s to compile the forward first)", file=sys.stderr)

# ***** the command line *****

def parse(argv:list[str]|None=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description="Train a GPT with forward passes only (zeroth-order estimators).",
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  p.add_argument("--method", default="dust", choices=tuple(ESTIMATORS), help="gradient estimator (estimators.py); backprop is the reference baseline")
  p.add_argument("--pop", type=int, nargs="+", default=[1024], help="population: directions (mezo), members (es), the recipe's "
                 "population (dust: 64, 256, 1024, 4096 or 16384 under SGD; a multiple of 256 under AdamW); several values only with --cosine")
  p.add_argument("--model", default=None, choices=("tiny", "small", "dust", "looped"), help="default: tiny on the CPU, small on a GPU")
  p.add_argument("--vocab", type=int, default=None, help="override the preset's vocabulary size (default: the preset's; on the CPU "
                 "with --data synthetic, 32)")
  p.add_argument("--loops", type=int, default=None, help="loop count of the looped model (training depth)")
  p.add_argument("--eval-loops", type=int, default=None, help="loop count for evaluation (default: --loops)")
  p.add_argument("--data", default="synthetic", help="synthetic | synthetic:parity | synthetic:s5 | stdlib (this Python's "
                 "standard library sources, as bytes) | FILE.txt | FILE.bin | FILE.npy")
  p.add_argument("--tokenizer", default="bytes", help="for a .txt file: bytes (vocab 256), or bpe:N, a byte-level BPE of N tokens "
                 "trained on the text's training split (saved as OUT/tokenizer.json; the tokens are cached beside the text)")
  p.add_argument("--steps", type=int, default=None, help="optimizer steps (default: from --tokens)")
  p.add_argument("--tokens", type=int, default=None, help="training budget in tokens, when --steps is not given (default: 500,000 on "
                 "a GPU, 20,000 on the CPU, where 2 cores run it in under 10 minutes)")
  p.add_argument("--batch", type=int, default=8, help="sequences per batch")
  p.add_argument("--seq", type=int, default=None, help="training sequence length, at most the model's context (default: the context)")
  p.add_argument("--lr", type=float, default=None, help="base learning rate (default: the method's recipe)")
  p.add_argument("--optim", default="sgd", choices=("sgd", "adamw"))
  p.add_argument("--momentum", type=float, default=None, help="SGD momentum or AdamW beta1 (default: the recipe's)")
  p.add_argument("--warmdown", type=float, default=None, help="fraction of the steps at the end over which the lr falls linearly to 0 "
                 "(default: 0.3 for Dust under AdamW, the Noise record's schedule; else 0)")
  p.add_argument("--noise", default="gaussian", choices=tuple(NOISES), help="dust: the distribution of every draw "
                 "(Rademacher: +-1, the same mean and variance)")
  p.add_argument("--head", default="slabs", choices=("slabs", "exact"), help="dust: the head's per-token errors estimated from draws on "
                 "slabs of the logits (the release's), or exact: softmax - one-hot from the clean forward, no draws (docs/dust.md §3.6)")
  p.add_argument("--direct-scale", type=float, default=1.0, help="dust: the recipe's direct draws (writers, hidden, hubs, embedding) "
                 "times this, each count still a whole number of chunks (1.5 or 2 at pop 1024); 1.5 with --head exact takes about the time of the "
                 "recipe's step (docs/dust.md §3.6)")
  p.add_argument("--qkv-scale", type=float, default=1.0, help="dust: the recipe's draws of the attention's q, k and v times this, "
                 "each count still a whole number of chunks; 4 with --head exact --direct-scale 1.5 is the race's best (docs/dust.md §3.5)")
  p.add_argument("--sigma", type=float, default=1e-2, help="es: perturbation scale")
  p.add_argument("--eps", type=float, default=1e-3, help="mezo: perturbation scale")
  p.add_argument("--rank", type=int, default=0, help="es: 0 for full-rank Gaussian noise, r > 0 for EGGROLL rank-r noise")
  p.add_argument("--shaping", default="rank", choices=("rank", "zscore", "none"), help="es: fitness shaping")
  p.add_argument("--replay", type=int, default=0, help="mezo/es under SGD: 0 keeps a momentum buffer; W > 0 keeps no buffer but the "
                 "last W steps' seeds, and replays the momentum from them")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--eval-every", type=int, default=10, help="steps between validation losses")
  p.add_argument("--ckpt-every", type=int, default=50, help="steps between checkpoints")
  p.add_argument("--out", default="runs/zo", help="output directory: config.json, metrics.jsonl, model.safetensors")
  p.add_argument("--resume", action="store_true", help="continue the run in --out from its checkpoint (with --cosine: "
                 "measure at its weights)")
  p.add_argument("--force", action="store_true", help="overwrite a run already in --out")
  p.add_argument("--cosine", action="store_true", help="print the per-layer-type cosine of the estimate to backprop for each --pop, at "
                 "initialisation or (with --resume) at the checkpoint in --out, then exit")
  p.add_argument("--devices", type=int, default=1, help="devices of the default backend to split the population over")
  p.add_argument("--sample", type=int, default=None, metavar="N", help="print N tokens sampled from the checkpoint in --out, then exit")
  p.add_argument("--prompt", default="\n", help="--sample: the text to continue (default: %(default)r)")
  p.add_argument("--temperature", type=float, default=1.0, help="--sample: divides the logits before the softmax")
  p.add_argument("--top-k", type=int, default=None, help="--sample: draw from the k likeliest tokens only; None: from all")
  args = p.parse_args(argv)
  args.pops, args.pop = args.pop, args.pop[0]
  for flag, value, ok, need in checks(args):
    if value is not None and not ok(value): p.exit(2, f"zo: error: --{typed(flag)} {value}: must be {need}\n")  # one line
  if len(args.pops) > 1 and not args.cosine: p.error("several --pop values only make sense with --cosine")
  for flag in ("noise", "head", *SCALES):  # Dust's: another method refuses them rather than ignore them
    if getattr(args, flag) != p.get_default(flag) and flag not in takes(args.method):
      p.error(f"--{typed(flag)} {getattr(args, flag)} is Dust's: {args.method} does not take it")
  return args

def checks(args:argparse.Namespace) -> list[tuple[str, Any, Callable[[Any], bool], str]]:
  """Every numeric flag, its value (None: not given) and what it must be."""
  def positive(v) -> bool: return math.isfinite(v) and v > 0
  counts = [(f, getattr(args, f), lambda v: v >= 1, "at least 1") for f in ("batch", "eval_every", "ckpt_every", "steps", "tokens", "seq",
                                                                                  "loops", "eval_loops", "devices", "sample", "top_k")]
  return [("pop", min(args.pops), lambda v: v >= 1, "at least 1"), *counts, ("vocab", args.vocab, lambda v: v >= 2, "at least 2"),
          ("replay", args.replay, lambda v: v >= 0, "0 (a momentum buffer) or a number of steps"), ("rank", args.rank, lambda v: v >= 0, "0 or more"),
          *[(f, getattr(args, f), positive, "positive and finite") for f in ("lr", "sigma", "eps", "temperature", *SCALES)],
          ("momentum", args.momentum, lambda v: 0 <= v < 1, "in [0, 1)"), ("warmdown", args.warmdown, lambda v: 0 <= v <= 1, "in [0, 1]")]

def default_device() -> str:
  """The device tinygrad picks, opened: DEV names one (DEV=CUDA), or tinygrad tries each of its backends."""
  try: device = Device.DEFAULT
  except Exception: raise UsageError("tinygrad found no usable device: install clang for the CPU backend (apt-get install clang), "
                                     "or run on a GPU with DEV=CUDA / DEV=AMD / DEV=METAL") from None
  try: Device[device]
  except Exception as e:
    raise UsageError(f"DEV={os.environ.get('DEV', device)}: tinygrad cannot open device {device} ({type(e).__name__}: {e}); "
                     f"its backends are {', '.join(sorted(Device._devices))}") from None
  return device

def check_devices(args:argparse.Namespace):
  """--devices N: N devices of the default backend (DEV, DEV:1, ...), each with at least one direction (mezo) or pair (es); Dust
  splits each group's chunks, and a device whose share of a small group is empty sits that group out."""
  n = args.devices
  if n == 1: return
  if "devices" not in takes(args.method): raise UsageError(f"--devices {n}: {args.method} runs on one device")
  if args.method != "dust" and n > (draws := min(args.pops) // (2 if args.method == "es" else 1)):
    unit = "antithetic pair" if args.method == "es" else "direction"
    raise UsageError(f"--devices {n}: every device needs at least one {unit}, and --pop {min(args.pops)} has {draws}")
  for d in names(Device.DEFAULT, n):
    try: Device[d]
    except Exception as e: raise UsageError(f"--devices {n}: {d} does not open ({type(e).__name__}: {e})") from None

def device_defaults(args, device:str):
  """The default run of each kind of device (README): on a GPU the small model and 500,000 tokens; on the CPU the tiny model on a
  synthetic chain of 32 states (a 256-token vocab's head made a Dust pop-1024 step 52-58 s on 2 cores) for 20,000 tokens: 39 steps
  of ~10 s, so that the run takes under 10 minutes on 2 cores (docs/performance.md: "The CPU's step: sums of exps written out")."""
  cpu = device == "CPU"
  args.model = args.model or ("tiny" if cpu else "small")
  if args.tokens is None: args.tokens = 20_000 if cpu else 500_000
  if cpu and args.data == "synthetic" and args.vocab is None: args.vocab = 32

def main(argv:list[str]|None=None):
  from data import DataError
  args = parse(argv)
  try:
    device_defaults(args, default_device())
    check_devices(args)
    sample(args) if args.sample else cosine_table(args) if args.cosine else train(args)
  except (UsageError, DataError, ValueError) as e:
    print(f"zo: error: {e}", file=sys.stderr)
    sys.exit(2)
  except KeyboardInterrupt:  # Ctrl-C before training started: nothing to save
    sys.exit(130)

if __name__ == "__main__": main()
