#!/usr/bin/env python3
"""zo: train a network with forward passes only. The command line, the training loop, checkpoints, evaluation and
sampling.

The estimators are in estimators.py (MeZO, ES) and dust.py (Dust), each declared with its flags and defaults
(registry.py), the optimizer in optim.py, the models in model.py; README has the math. How zo runs fast on tinygrad is
in engine.py, and which kernels run where in kernels/__init__.py.
"""
from __future__ import annotations
import argparse, contextlib, fcntl, importlib, importlib.util, json, math, os, signal, socket, sys, threading, time
from dataclasses import replace
from typing import Any, Callable
import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file
from tqdm import tqdm
from tinygrad import Device, Tensor, dtypes
from data import BPE, Bytes
from devices import names
from estimators import Compact, Flat, estimate, run  # estimators.py registers MeZO, ES, backprop and (dust.py) Dust
from optim import Optimizer, learning_rates
from registry import ESTIMATORS, MODELS, Declared, Entry, Run, lacks, size
import engine, kernels
import model as models  # noqa: F401  model.py registers the presets as --model

# ***** training: checkpoints, evaluation, the loop *****

class UsageError(Exception): pass  # a mistake the user can fix: one line, exit code 2, no traceback

def step_key(seed:int, step:int) -> int: return (seed << 32) | step  # the key words are (step, seed)

def save(out:str, model, opt:Optimizer, step:int, state:dict[str, Tensor]|None=None):
  """Atomic: write a temp file, fsync it, rename it over the old checkpoint, so a crash mid-save leaves the previous one
  intact. Written from host copies by the safetensors package: tinygrad's safe_save goes through its CPU device, which
  compiles helper programs with clang even under DEV=CUDA, so a GPU machine without clang lost the whole run at its
  first checkpoint. A write that fails (a full disk, a file size limit, permissions) stops the run with the path and the
  OS's error, the temp file removed and the previous checkpoint as it was."""
  path, tmp = os.path.join(out, "model.safetensors"), os.path.join(out, "model.safetensors.tmp")
  tensors = {k: t.numpy() for k, t in {**{f"param.{n}": p for n, p in model.params.items()}, **opt.state(),
                                       **{f"state.{k}": t for k, t in (state or {}).items()}}.items()}
  try:
    save_file(tensors, tmp, metadata={"step": str(step)})
    mask = os.umask(0)
    os.umask(mask)
    # safetensors creates its file private (0600); a checkpoint gets the mode of any file the user writes
    os.chmod(tmp, 0o666 & ~mask)
    with open(tmp, "rb+") as f: os.fsync(f.fileno())
    os.replace(tmp, path)
  except (OSError, SafetensorError) as e:
    with contextlib.suppress(OSError): os.remove(tmp)
    kept = (f"the checkpoint of an earlier step is intact in {path}" if os.path.exists(path) else
            "no checkpoint was written")
    raise UsageError(f"cannot write the checkpoint of step {step} to {tmp}: {e}; {kept}") from None

def load_checkpoint(out:str, model, flag:str, keep:str="") -> tuple[dict[str, Tensor], int]:
  """The model's parameters set from the checkpoint in out; returns the checkpoint's tensors whose names start with
  `keep`, and its step."""
  path = os.path.join(out, "model.safetensors")
  hint = f"--force starts the run in {out} over" if flag == "--resume" else "train a run there first"
  # a run killed before its first save
  if not os.path.exists(path): raise UsageError(f"{flag}: no checkpoint at {path}; {hint}")
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

def resume(out:str, model, opt:Optimizer, state:dict[str, Tensor]|None=None) -> int:
  """The run's weights, optimizer and estimator state (into `state`) from its checkpoint; the step to go on from."""
  st, step = load_checkpoint(out, model, "--resume")
  opt.load(st)
  if state is not None:
    state.update({k.removeprefix("state."): t.contiguous().realize() for k, t in st.items() if k.startswith("state.")})
  return step

def init_from(args, model):
  """--init RUN: the model's weights from another run's checkpoint, where this run then starts with a fresh optimizer at
  step 0, on its own --data (pretrain with backprop, adapt with forward passes). The run's model flags must be this
  one's. A --resume continues from its own checkpoint, and ignores --init."""
  if not args.init or args.resume: return
  if not os.path.exists(path := os.path.join(args.init, "config.json")):
    raise UsageError(f"--init {args.init}: no run there (no config.json)")
  src = run_config(path)
  if diff := [k for k in ("model", "vocab", "loops") if src.get(k) != getattr(args, k)]:
    raise UsageError(f"--init {args.init}: that run's model is another: " +
                     ", ".join(f"--{typed(k)} {src.get(k)} there, {getattr(args, k)} here" for k in diff))
  load_checkpoint(args.init, model, "--init", keep="param.")

# the state, for an estimator that keeps one
def carried(entry:Entry, state:dict[str, Tensor]) -> dict[str, dict[str, Tensor]]:
  return {"state": state} if "state" in entry.takes else {}

def mean_loss(model, x:Tensor, y:Tensor, **kw) -> Tensor: return model.losses(x, y, **kw).mean().realize()

def val_loss(model, data, args, batches:int=4) -> float:
  """The mean loss over the first validation batches, as a JIT, whose memory plan lives in the arena every JIT shares
  (engine.Scratch): an eager forward keeps every materialized activation until its schedule ends (the dust preset at
  8x2048 tokens: 5.3 GiB eagerly, 0.4 GiB in a JIT)."""
  kw = {"loops": args.eval_loops} if args.model == "looped" and args.eval_loops else {}
  jit = engine.jit(mean_loss, model, **kw)
  return float(np.mean([jit(*map(Tensor, data.batch("val", i, args.batch, args.seq))).item() for i in range(batches)]))

# half precision (float32 accumulation, float32 master weights) on accelerators; float32 on the CPU
def compute_dtype():
  return dtypes.float32 if Device.DEFAULT == "CPU" else dtypes.half

def make_model(args):
  """--model's model, made of the run's values it names and its options (registry.py); one that lacks what every
  estimator needs is refused in one line."""
  if args.model not in MODELS:  # a run's config.json names a model of a --plugin not given
    raise UsageError(f"--model {args.model}: no such model here ({', '.join(MODELS)}); a model of your own comes with "
                     "its --plugin")
  entry = MODELS[args.model]
  try:
    model = entry.make(vocab=args.vocab, seed=args.seed, dtype=compute_dtype(), loops=args.loops,
                       **{o: getattr(args, o, entry.default(o)) for o in entry.options})
  except AssertionError as e:  # a size the model can't take (GPT's head width must be even)
    raise UsageError(f"--model {args.model}: {e}") from None
  if what := lacks(model):
    raise UsageError(f"--model {args.model}: its {type(model).__name__} has no {what} (docs/model.md)")
  args.seq = args.seq or model.cfg.seq_len
  return model

def text_tokenizer(args, flag:str|None=None) -> Bytes|BPE:
  """--tokenizer for --data: bytes, or a BPE: under `flag` (--resume, --sample) the run's own, OUT/tokenizer.json, else
  one trained on the text. A BPE of size N sets --vocab to N."""
  from data import bpe_size, tokenizer
  saved = os.path.join(args.out, "tokenizer.json")
  if flag and bpe_size(args.tokenizer) and not os.path.exists(saved):
    raise UsageError(f"{flag}: {args.out} has no tokenizer.json: it is not a run of --tokenizer {args.tokenizer}")
  tok = tokenizer(args.tokenizer, args.data, saved if flag else None)
  if isinstance(tok, BPE):
    if args.vocab not in (None, tok.vocab):
      raise UsageError(f"--vocab {args.vocab}: --tokenizer {tok.spec} sets the vocab to {tok.vocab}")
    args.vocab = tok.vocab
  return tok

# a flag's argparse name as the user types it (less its dashes)
def typed(dest:str) -> str: return dest.replace("_", "-")

def plan(args, model) -> Run:
  """The run as its estimator's defaults and checks see it."""
  steps = args.steps or max(1, args.tokens // (args.batch * args.seq))
  entry = ESTIMATORS[args.method]
  return Run(model, args.pop, args.optim, steps * args.batch * args.seq, steps, args.devices,
             {o: getattr(args, o) for o in entry.options})

def values(entry:Entry, run:Run) -> dict[str, Any]:
  """What the loop passes to the estimator at every step: its options, and the run's values that it names
  (registry.py)."""
  given = {"steps": run.steps, "tokens": run.tokens, "optimizer": run.optimizer, "devices": run.devices}
  return run.options | {k: v for k, v in given.items() if k in entry.takes}

def at_step(entry:Entry, step:int) -> dict[str, Tensor]:
  """The step, for an estimator that names it: a float32 scalar in a buffer of its own, so that a schedule computed from
  it is data of the kernels, not a constant compiled into them."""
  return {"step": engine.tensor(np.array(step, np.float32))} if "step" in entry.takes else {}

def run_config(path:str) -> dict:  # a run from before --tokenizer: bytes
  return {"tokenizer": "bytes"} | json.load(open(path))

def same_run(flag:str, args, keys:tuple[str, ...]):
  """Check that the run in --out was made with these flags' values: another one is refused, each named as it is
  typed."""
  path = os.path.join(args.out, "config.json")
  if not os.path.exists(path): raise UsageError(f"{flag}: no run in {args.out}")
  old, entry = run_config(path), ESTIMATORS[args.method]
  # an option from before it: its default
  def was(k:str) -> Any: return old.get(k, entry.default(k) if k in entry.options else None)
  if diff := [k for k in keys if was(k) != getattr(args, k)]:
    flags = [typed(k) for k in diff]
    raise UsageError(f"{flag}: {args.out} was trained with other {', '.join(flags)} "
                     f"({', '.join(f'{f}={was(k)}' for f, k in zip(flags, diff))})")

def check_memory(args, model):
  """A step whose memory plainly exceeds the machine's, refused before any work or any file. A lower bound of a step's
  memory: one forward's tokens hold at once an MLP's input and hidden layer (1 + 4 widths) or the head's input and
  logits (a width and the vocab), each a matmul's output, in the compute dtype. The peak is higher (the estimators batch
  several draws a forward): --batch 100000 at the tiny preset held 9 GB in its first step on the CPU. The sizes an
  estimator's kernels can't index are its own check's."""
  B, T, d = args.batch, args.seq, getattr(model.cfg, "n_embd", 0)  # a model of one's own may have no width: its logits
  need, have = B * T * max(5 * d, d + model.cfg.vocab) * compute_dtype().itemsize, device_memory()
  if have and need > have:
    raise UsageError(f"--batch {B} --seq {T}: a step needs at least {need / 2**30:,.1f} GiB, this machine has "
                     f"{have / 2**30:,.1f} GiB: --batch {max(1, B * have // need):,} may fit")

def device_memory() -> int|None:  # the CPU's is the machine's RAM; tinygrad doesn't tell a GPU's
  return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") if Device.DEFAULT.split(":")[0] == "CPU" else None

# the run folders this process holds: their lock files' descriptors, open for the process's life
_locks:dict[str, int] = {}

def lock(out:str):
  """One writer per run folder: an exclusive flock on OUT/lock, taken before anything in the folder changes and held
  until the process ends, when the OS releases it (kill -9 included), so a crashed run never blocks the next. The file
  names its holder's pid and host, for the refusal of a second run."""
  if not out: raise UsageError("--out is empty: name a folder for the run")
  # this process holds it already (zo.main called again in one process)
  if (key := os.path.realpath(out)) in _locks: return
  with files("--out"):
    os.makedirs(out, exist_ok=True)
    fd = os.open(os.path.join(out, "lock"), os.O_RDWR | os.O_CREAT, 0o666)
  try: fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
  except BlockingIOError:
    pid, host = (os.read(fd, 256).decode(errors="replace").split() + ["?", "?"])[:2]
    raise UsageError(f"{out} is in use by a live run, pid {pid} on {host}: wait for it, stop it, "
                     "or pick another --out") from None
  os.ftruncate(fd, 0)
  os.write(fd, f"{os.getpid()} {socket.gethostname()}\n".encode())
  _locks[key] = fd

@contextlib.contextmanager
def files(what:str):
  """An OSError of a run folder's file (a path under a file, too long a name, a directory where a file goes, a full
  disk) as one line naming the path and the OS's error."""
  try: yield
  except OSError as e:
    raise UsageError(f"{what}: {e.filename}: {e.strerror}" if e.filename else f"{what}: {e}") from None

def prepare(args, config:dict, model, opt:Optimizer, state:dict[str, Tensor]) -> tuple[int, float]:
  """The run folder made ready under its lock, each check before anything changes: --resume's checkpoint loaded and its
  log trimmed to it; or a fresh run's refusal of another run's folder, or --force's deletion of that run. Then
  config.json, metrics.jsonl checked writable first. Returns the step to start at, and the seconds its steps took before
  a --resume."""
  cfg_path, log_path = os.path.join(args.out, "config.json"), os.path.join(args.out, "metrics.jsonl")
  if os.path.exists(args.out) and not os.path.isdir(args.out): raise UsageError(f"--out {args.out}: not a directory")
  if args.resume:
    same_run("--resume", args, ("method", "model", "vocab", "seq", "loops", "optim", "pop", "replay", "tokenizer",
                                *ESTIMATORS[args.method].options))
  lock(args.out)
  start, trained = 0, 0.0
  with files("--out"):
    if args.resume:
      start = resume(args.out, model, opt, state)
      keep = [line for line in open(log_path) if logged_step(line) < start] if os.path.exists(log_path) else []
      with open(log_path, "w") as f: f.writelines(keep)  # steps logged after the checkpoint are run again
      trained = json.loads(keep[-1])["seconds"] if keep else 0.0
    elif not args.force and (os.path.exists(cfg_path) or os.path.exists(log_path)):
      if not os.path.exists(os.path.join(args.out, "model.safetensors")):
        raise UsageError(f"{args.out} holds a run with no checkpoint yet, nothing to resume: "
                         "pass --force to start it over")
      raise UsageError(f"{args.out} holds another run: pass --resume to continue it or --force to overwrite")
    # --force: nothing of the old run stays; --resume drops the temp file of a save cut short
    old = [p for f in ("model.safetensors.tmp",) +
           (() if args.resume else ("metrics.jsonl", "model.safetensors", "tokenizer.json"))
           if os.path.exists(p := os.path.join(args.out, f))]
    if bad := next((p for p in old if os.path.isdir(p) and not os.path.islink(p)), None):
      raise UsageError(f"cannot delete {bad}: it is a directory; nothing was deleted")
    for p in old: os.remove(p)
    open(log_path, "a").close()  # writable, before config.json is written
    json.dump(config, open(cfg_path, "w"), indent=1)
  return start, trained

def train(args):
  from data import load
  # resumed, a run keeps its tokenizer, whatever the text is now
  tok = text_tokenizer(args, "--resume" if args.resume else None)
  model = make_model(args)
  if args.seq > model.cfg.seq_len:
    raise UsageError(f"--seq {args.seq} is longer than the model's context of {model.cfg.seq_len}")
  data = load(args.data, model.cfg.vocab, args.seq, args.seed, tok)
  entry, job = ESTIMATORS[args.method], plan(args, model)
  if entry.check: entry.check(job)  # a run the estimator can't do (sizes its kernels can't index included) stops here
  steps, d = job.steps, entry.defaults_for(job)
  opt = Optimizer(model.params, learning_rates(model.params, d, args.lr), args.optim,
                  d.momentum if args.momentum is None else args.momentum, args.replay)
  warmdown = d.warmdown if args.warmdown is None else args.warmdown
  config = {k: v for k, v in vars(args).items()
            if k not in ("resume", "force", "cosine", "sample", "prompt", "temperature", "top_k")}
  # a step's cost in network forwards, as its estimator declares (registry.py): the x-axis of compute-fair comparisons
  config["forwards_per_step"] = entry.forwards(job) if entry.forwards else None
  check_memory(args, model)
  init_from(args, model)
  # what the estimator keeps from step to step (registry.py): its own at the first step, or --resume's
  state:dict[str, Tensor] = {}
  # the step to start at, and the seconds its steps took before a --resume
  start, trained = prepare(args, config, model, opt, state)
  if isinstance(tok, BPE) and not args.resume: tok.save(os.path.join(args.out, "tokenizer.json"))
  what = args.method if args.method == "backprop" else f"{args.method} pop {args.pop}"  # backprop has no population
  path = kernels.path(Device.DEFAULT)
  print(path)  # which kernels run here
  print(f"{what} on {type(model).__name__} ({size(model):,} params), {data.name}, {steps} steps of "
        f"{args.batch}x{args.seq} tokens" +
        (f"; the loss floor of this data is {data.floor:.3f}" if data.floor is not None else ""))
  # Ctrl-C (SIGINT) or a scheduler's SIGTERM: the step in flight finishes and saves; a second one quits at once
  stop:list[int] = []
  saved = [start]  # the step of the checkpoint on disk (0: none)
  def kept() -> str:
    return f"the checkpoint of step {saved[0]} in {args.out} is kept" if saved[0] else "no checkpoint is saved yet"
  # a resumed run's seconds go on from its parts' sum (its compiling counted again)
  val, t0 = None, time.perf_counter() - trained
  print("the first step and the first evaluation compile their kernels (tinygrad caches them for the next run)")
  opts = values(entry, job)
  def estimate(x:Tensor, y:Tensor, step:int, state:dict[str, Tensor]=state):
    return run(model, x, y, args.method, args.pop, step_key(args.seed, step), **opts, **at_step(entry, step),
               **carried(entry, state))
  # the work a step does, for the cache of which kernels it compiled (engine.compile_ahead)
  work = repr((args.method, args.pop, opts, model.cfg, args.batch, args.seq, path))
  with on_signals(stop, kept), open(os.path.join(args.out, "metrics.jsonl"), "a") as log, \
       tqdm(initial=start, total=steps, dynamic_ncols=True, desc="compiling") as bar:
    for step in range(start, steps):
      x, y = map(Tensor, data.batch("train", step, args.batch, args.seq))
      ts = time.perf_counter()
      # all of the step's kernels at once, then the step. The dry run's JITs are traced, not run: what they would write
      # into the state is never written, and a pending write left on a tensor runs at the next capture, so the dry run
      # gets a copy of the state
      if step == start:
        engine.compile_ahead(lambda: estimate(x, y, step, {k: t.clone() for k, t in state.items()}), work)
      g, loss = estimate(x, y, step)
      opt.scale = min(1.0, (steps - step) / (warmdown * steps)) if warmdown else 1.0
      # queued before the check's read, which waits for it: a bad step stops the run before anything saves its weights
      opt.step(g)
      loss = checked(model, loss, g, step, args.out)
      dt = time.perf_counter() - ts
      rec = {"step": step, "tokens": (step + 1) * args.batch * args.seq, "train_loss": loss,
             "seconds": round(time.perf_counter() - t0, 3)}
      if step % args.eval_every == 0 or step == steps - 1:
        bar.set_description_str("evaluating")
        rec["val_loss"] = val = val_loss(model, data, args)
      bar.set_description_str("")
      log.write(json.dumps(rec) + "\n"); log.flush()
      bar.set_postfix(loss=f"{loss:.3f}", val=f"{val:.3f}" if val is not None else "-",
                      tok_s=f"{args.batch * args.seq / dt:,.0f}", draws_s=f"{args.pop / dt:,.0f}")
      bar.update()  # counted when the step is done (iterating the bar would count it when the next one begins)
      if step == start: engine.freeze_compiled()  # what compiling left, out of the garbage collector's walks
      if (step + 1) % args.ckpt_every == 0 or step == steps - 1 or stop:
        save(args.out, model, opt, step + 1, state)
        saved[0] = step + 1
      if stop:
        bar.write(f"{signal.Signals(stop[0]).name}: interrupted after {step + 1} steps: checkpoint saved in "
                  f"{args.out}; continue with --resume",
                  file=sys.stderr)  # a line of its own, not one the bar redraws over
        sys.exit(128 + stop[0])  # the shell's code for a process ended by that signal: 130 for SIGINT, 143 for SIGTERM

@contextlib.contextmanager
def on_signals(stop:list[int], kept:Callable[[], str]):
  """SIGINT and SIGTERM: the first appends to `stop`, for the loop to stop after the step in flight, and says so at
  once; the second quits at once, with the exit code of a process ended by it. A thread sees them, on the pipe that
  Python's C-level handler writes each signal to: a Python handler runs only between the main thread's bytecodes, so it
  waits for a kernel or a compile in C code (minutes in a cold first step, past a scheduler's grace period). Quitting
  mid-save leaves the last checkpoint whole: a save is the rename of a finished temp file, which --resume drops. On
  leaving, the handlers before are back."""
  r, w = os.pipe()
  os.set_blocking(w, False)
  wakeup, handlers = (signal.set_wakeup_fd(w, warn_on_full_buffer=False),
                      {s: signal.signal(s, lambda *_: None) for s in SIGNALS})
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
  return Tensor.cat(loss.float().reshape(1), engine.squares(list(named.values()))).contiguous()

def checked(model, loss:Tensor, g:Compact|Flat|dict[str, Tensor], step:int, out:str) -> float:
  """The step's loss, once it and the estimate are seen to be finite: one JIT and one read from the device (built
  eagerly at every step, the sums' graph took longer than a small model's whole step); backprop's JIT makes the sums
  with its gradient. A Flat is summed whole (one sum a parameter was 42 kernels at the small preset), and only a
  non-finite one is searched for the parameter."""
  if isinstance(g, Flat):
    named, vals = {"the gradient": g.buf}, engine.read(g.sums)
  else:
    named = {"coefficients": g.coef} if isinstance(g, Compact) else g
    vals = engine.read(engine.jit(squares)(loss, named))
  if not math.isfinite(vals[0]):
    raise UsageError(f"step {step}: the training loss is {vals[0]}; the last good checkpoint is in {out}")
  if bad := [n for n, v in zip(named, vals[1:]) if not math.isfinite(v)]:
    if isinstance(g, Flat): bad = [n for n, t in g.dense(model.params).items() if not t.isfinite().all().item()] or bad
    raise UsageError(f"step {step}: the estimate of {bad[0]} is not finite; the last good checkpoint is in {out}")
  return float(vals[0])

# ***** --cosine: how close is each estimate to the backprop gradient, per layer type *****

LAYER_TYPES = (("mlp in", "mlp.c_fc"), ("mlp out", "mlp.c_proj"), ("attn out", "attn.c_proj"), ("q", "c_q"),
               ("k", "c_k"), ("v", "c_v"), ("gate", "ve_gate"), ("ve", "value_embeds"), ("wte", "wte"),
               ("head", "lm_head"), ("scalars", "lambdas"))
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
  """--cosine: for each --pop, the cosine of the estimate to the backprop gradient per layer type, on the first training
  batch; at initialisation, or with --resume at the weights of the checkpoint in --out, where estimators differ more
  than at initialisation and two settings of one can be compared on the same trained weights. The run's model and data
  must be the flags' (--model, --vocab, --loops, --tokenizer, --data, --seed); the estimator's flags, --batch and --seq
  are free."""
  from data import load
  flag = "--cosine --resume" if args.resume else None
  tok = text_tokenizer(args, flag)
  model = make_model(args)
  where = "initialisation"
  if flag:
    same_run(flag, args, ("model", "vocab", "loops", "tokenizer", "data", "seed"))
    lock(args.out)  # no training run writes the checkpoint while it is read
    where = f"the checkpoint of step {load_checkpoint(args.out, model, flag, keep='param.')[1]} in {args.out}"
  entry, job = ESTIMATORS[args.method], plan(args, model)
  for pop in args.pops:  # a run the estimator can't do stops before any work
    if entry.check: entry.check(replace(job, pop=pop))
  x, y = map(Tensor, load(args.data, model.cfg.vocab, args.seq, args.seed, tok).batch("train", 0, args.batch, args.seq))
  print(kernels.path(Device.DEFAULT))
  ref = estimate(model, x, y, "backprop", 1, 0)
  rows = {pop: cosines(estimate(model, x, y, args.method, pop, step_key(args.seed, 0),
                                **values(entry, replace(job, pop=pop)),
                                **at_step(entry, 0), **carried(entry, {})), ref) for pop in args.pops}
  types = list(next(iter(rows.values())))
  print(f"cosine of {args.method} to the backprop gradient, one batch of {args.batch}x{args.seq}, at {where}\n" +
        f"{'pop':>7} " + " ".join(f"{t:>8}" for t in types))
  for pop, r in rows.items(): print(f"{pop:>7} " + " ".join(f"{r[t]:>8.3f}" for t in types))

# ***** --sample: text from a checkpoint *****

def last_logits(model, window:Tensor, last:Tensor) -> Tensor: return model.logits(window)[0, last]

def next_logits(model, ids:list[int]) -> np.ndarray:
  """The logits [V] that follow ids, at one shape, [1, context], so one TinyJit serves every step: the last `context`
  ids left-aligned in the window and padded with 0s, which the causal model does not see from the positions before
  them."""
  T = model.cfg.seq_len
  ctx = ids[-T:]  # the window slides once the text is longer than the context
  window = np.zeros((1, T), np.int32)
  window[0, :len(ctx)] = ctx
  return engine.jit(last_logits, model)(Tensor(window), Tensor([len(ctx) - 1], dtype=dtypes.int32)).numpy()[0]

def next_probs(logits:np.ndarray, temperature:float, top_k:int|None) -> np.ndarray:
  """softmax(logits / temperature) over the top_k largest logits (all of them for None), 0 elsewhere; in float64."""
  z = logits.astype(np.float64) / temperature
  # a tie goes to the later index: k stay
  if top_k is not None and top_k < len(z): z[np.argsort(z, kind="stable")[:-top_k]] = -np.inf
  p = np.exp(z - z.max())
  return p / p.sum()

def generate(model, ids:list[int], n:int, temperature:float, top_k:int|None, seed:int) -> list[int]:
  """ids and n tokens after them, each drawn from next_probs by NumPy on the host: the same seed gives the same text on
  every backend."""
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
  """--sample N: N tokens after --prompt from the checkpoint in --out, printed as text; the rate goes to stderr, so
  stdout is the text."""
  if not os.path.exists(cfg_path := os.path.join(args.out, "config.json")):
    raise UsageError(f"--sample: no run in {args.out} (no config.json)")
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
  print(f"{args.sample} tokens at {args.sample / (t2 - t1):,.1f} tokens/s "
        f"({t1 - t0:.1f} s to compile the forward first)", file=sys.stderr)

# ***** the command line *****

def parse(argv:list[str]|None=None) -> argparse.Namespace:
  plugins(argv)
  p = argparse.ArgumentParser(description="Train a GPT with forward passes only (zeroth-order estimators).",
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  p.add_argument("--method", default="dust", choices=tuple(ESTIMATORS),
                 help="gradient estimator (estimators.py); backprop is the reference baseline")
  p.add_argument("--pop", type=int, nargs="+", default=[1024], help="population: the draws of a step (the method's "
                 "directions, members or recipe's population); several values only with --cosine")
  p.add_argument("--model", default=None, choices=tuple(MODELS), help="default: tiny on the CPU, small on a GPU; "
                 "a model of your own comes with its --plugin (docs/model.md)")
  p.add_argument("--vocab", type=int, default=None, help="override the preset's vocabulary size (default: the "
                 "preset's; on the CPU with --data synthetic, 32)")
  p.add_argument("--loops", type=int, default=None, help="loop count of the looped model (training depth)")
  p.add_argument("--eval-loops", type=int, default=None, help="loop count for evaluation (default: --loops)")
  p.add_argument("--data", default="synthetic", help="synthetic | synthetic:parity | synthetic:s5 | stdlib (this "
                 "Python's standard library sources, as bytes) | FILE.txt | FILE.bin | FILE.npy")
  p.add_argument("--tokenizer", default="bytes", help="for a .txt file: bytes (vocab 256), or bpe:N, a byte-level BPE "
                 "of N tokens trained on the text's training split (saved as OUT/tokenizer.json; the tokens are cached "
                 "beside the text)")
  p.add_argument("--steps", type=int, default=None, help="optimizer steps (default: from --tokens)")
  p.add_argument("--tokens", type=int, default=None, help="training budget in tokens, when --steps is not given "
                 "(default: 500,000 on a GPU, 20,000 on the CPU)")
  p.add_argument("--batch", type=int, default=8, help="sequences per batch")
  p.add_argument("--seq", type=int, default=None,
                 help="training sequence length, at most the model's context (default: the context)")
  p.add_argument("--lr", type=float, default=None, help="base learning rate (default: the method's recipe)")
  p.add_argument("--optim", default="sgd", choices=("sgd", "adamw"))
  p.add_argument("--momentum", type=float, default=None, help="SGD momentum or AdamW beta1 (default: the recipe's)")
  p.add_argument("--warmdown", type=float, default=None, help="fraction of the steps at the end over which the lr "
                 "falls linearly to 0 (default: the method's)")
  p.add_argument("--replay", type=int, default=0, help="mezo/es under SGD: 0 keeps a momentum buffer; W > 0 keeps no "
                 "buffer but the last W steps' seeds, and replays the momentum from them")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--eval-every", type=int, default=10, help="steps between validation losses")
  p.add_argument("--ckpt-every", type=int, default=50, help="steps between checkpoints")
  p.add_argument("--out", default="runs/zo", help="output directory: config.json, metrics.jsonl, model.safetensors")
  p.add_argument("--init", default=None, metavar="RUN", help="start from the weights of the run in folder RUN (its "
                 "model flags must be this run's), with a fresh optimizer at step 0, on any --data; --resume ignores "
                 "it")
  p.add_argument("--resume", action="store_true", help="continue the run in --out from its checkpoint (with --cosine: "
                 "measure at its weights)")
  p.add_argument("--force", action="store_true", help="overwrite a run already in --out")
  p.add_argument("--cosine", action="store_true", help="print the per-layer-type cosine of the estimate to backprop "
                 "for each --pop, at initialisation or (with --resume) at the checkpoint in --out, then exit")
  p.add_argument("--devices", type=int, default=1, help="devices of the default backend to split the population over")
  p.add_argument("--sample", type=int, default=None, metavar="N",
                 help="print N tokens sampled from the checkpoint in --out, then exit")
  p.add_argument("--prompt", default="\n", help="--sample: the text to continue (default: %(default)r)")
  p.add_argument("--temperature", type=float, default=1.0, help="--sample: divides the logits before the softmax")
  p.add_argument("--top-k", type=int, default=None,
                 help="--sample: draw from the k likeliest tokens only; None: from all")
  p.add_argument("--plugin", action="append", default=[], metavar="FILE.py|MODULE", help="a file or module of your "
                 "own estimators or models, imported before the flags are read, so that its methods, models and their "
                 "flags are there (docs/estimator.md, docs/model.md)")
  option_flags(p)
  args = p.parse_args(argv)
  args.pops, args.pop = args.pop, args.pop[0]
  for flag, value, ok, need in checks(args):
    # one line
    if value is not None and not ok(value): p.exit(2, f"zo: error: --{typed(flag)} {value}: must be {need}\n")
  if len(args.pops) > 1 and not args.cosine: p.error("several --pop values only make sense with --cosine")
  return chosen_options(p, args)

DECLARED = {"method": ESTIMATORS, "model": MODELS}  # what declares options, by the flag that chooses it

def option_flags(p:argparse.ArgumentParser):
  """A flag for every option of every estimator and every model, in a group per method, and per model that has options
  (--help). An option that several methods (or several models) declare is one flag, in the first one's group; a model's
  options are its own. No default here: the method's (the model's) own fills in a flag not given, and a given flag it
  doesn't take is refused (chosen_options)."""
  declared:dict[str, list[tuple[str, Declared]]] = {}
  groups = {}
  for kind, entries in DECLARED.items():
    for name, e in entries.items():
      for o in e.options: declared.setdefault(o, []).append((kind, e))
      if kind == "method" or e.options:
        doc = " ".join((e.fn.__doc__ or "").split()).split(". ")[0].rstrip(".")  # the docstring's first sentence
        takes = ", ".join(f"--{typed(o)}" for o in e.options) or "no options"
        groups[kind, name] = p.add_argument_group(f"--{kind} {name}", f"{doc}. Takes {takes}.")
  for o, es in declared.items():
    (kind, first), opt = es[0], es[0][1].options[o]
    if len({k for k, _ in es}) > 1:  # by a method and a model
      p.error(f"--{typed(o)} is declared by {' and '.join(f'--{k} {e.name}' for k, e in es)}: a model's options are "
              "its own, so name it otherwise")
    helps = [f"{e.name}: {e.options[o].help} (default: {e.default(o)})" for _, e in es]
    try:
      groups[kind, first.name].add_argument(f"--{typed(o)}", dest=o, type=type(first.default(o)), choices=opt.choices,
                                            default=argparse.SUPPRESS, help="; ".join(helps))
    except argparse.ArgumentError:
      p.error(f"--{kind} {first.name} declares the option --{typed(o)}, a flag of zo's own: name it otherwise")

def chosen_options(p:argparse.ArgumentParser, args:argparse.Namespace) -> argparse.Namespace:
  """args with the options of the method and of the model (given, or their defaults) and no other's; a flag the method
  or the model doesn't take is refused in one line, with what it takes. No --model: the device's preset, which takes
  none."""
  for kind, entries in DECLARED.items():
    name = getattr(args, kind)
    options = entries[name].options if name else {}
    declared = {o for e in entries.values() for o in e.options}
    for o in sorted(declared & vars(args).keys() - options.keys()):
      takes = ", ".join(f"--{typed(t)}" for t in options) or "no options"
      which = f"--{kind} {name}" if name else f"the default {kind}"
      p.exit(2, f"zo: error: --{typed(o)} {getattr(args, o)}: {which} does not take --{typed(o)} (it takes {takes})\n")
    for o, opt in options.items():
      if o not in args: setattr(args, o, entries[name].default(o))
      elif opt.check and not opt.check[0](getattr(args, o)):
        p.exit(2, f"zo: error: --{typed(o)} {getattr(args, o)}: must be {opt.check[1]}\n")
  return args

def plugins(argv:list[str]|None) -> None:
  """Import each --plugin before the parser is made: its @estimator and @model declarations add methods, models and
  flags."""
  pre = argparse.ArgumentParser(add_help=False)
  pre.add_argument("--plugin", action="append", default=[])
  for spec in pre.parse_known_args(argv)[0].plugin:
    if spec.endswith(".py"):
      if not os.path.isfile(spec): pre.exit(2, f"zo: error: --plugin {spec}: no such file\n")
      found = importlib.util.spec_from_file_location(os.path.splitext(os.path.basename(spec))[0], spec)
      found.loader.exec_module(importlib.util.module_from_spec(found))
    else:
      try: importlib.import_module(spec)
      except ModuleNotFoundError as e: pre.exit(2, f"zo: error: --plugin {spec}: {e}\n")

def checks(args:argparse.Namespace) -> list[tuple[str, Any, Callable[[Any], bool], str]]:
  """Every numeric flag of the run, its value (None: not given) and what it must be; the estimators' own are checked by
  their Options."""
  counts = [(f, getattr(args, f), lambda v: v >= 1, "at least 1")
            for f in ("batch", "eval_every", "ckpt_every", "steps", "tokens", "seq", "loops", "eval_loops", "devices",
                      "sample", "top_k")]
  return [("pop", min(args.pops), lambda v: v >= 1, "at least 1"), *counts,
          ("vocab", args.vocab, lambda v: v >= 2, "at least 2"),
          ("replay", args.replay, lambda v: v >= 0, "0 (a momentum buffer) or a number of steps"),
          *[(f, getattr(args, f), lambda v: math.isfinite(v) and v > 0, "positive and finite")
            for f in ("lr", "temperature")],
          ("momentum", args.momentum, lambda v: 0 <= v < 1, "in [0, 1)"),
          ("warmdown", args.warmdown, lambda v: 0 <= v <= 1, "in [0, 1]")]

def default_device() -> str:
  """The device tinygrad picks, opened: DEV names one (DEV=CUDA), or tinygrad tries each of its backends."""
  try: device = Device.DEFAULT
  except Exception: raise UsageError("tinygrad found no usable device: install clang for the CPU backend "
                                     "(apt-get install clang), or run on a GPU with DEV=CUDA / DEV=AMD / "
                                     "DEV=METAL") from None
  try: Device[device]
  except Exception as e:
    raise UsageError(f"DEV={os.environ.get('DEV', device)}: tinygrad cannot open device {device} "
                     f"({type(e).__name__}: {e}); its backends are {', '.join(engine.backends())}") from None
  return device

def check_devices(args:argparse.Namespace):
  """--devices N: N devices of the default backend (DEV, DEV:1, ...), for a method that names `devices` (its check says
  how many its population can use)."""
  n = args.devices
  if n == 1: return
  if "devices" not in ESTIMATORS[args.method].takes:
    raise UsageError(f"--devices {n}: {args.method} runs on one device")
  for d in names(Device.DEFAULT, n):
    try: Device[d]
    except Exception as e: raise UsageError(f"--devices {n}: {d} does not open ({type(e).__name__}: {e})") from None

def device_defaults(args, device:str):
  """The default run of each kind of device (README): on a GPU the small model and 500,000 tokens; on the CPU the tiny
  model on a synthetic chain of 32 states (a 256-token vocab's head is the step's largest cost there) for 20,000 tokens,
  so that the run takes minutes (docs/performance.md: "The CPU's step: sums of exps written out")."""
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
