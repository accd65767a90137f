"""The run folder: config.json and the checks of a run against it, the lock, checkpoints, --resume and --init, the run's
tokenizer, and the signals that stop a run with its checkpoint saved. Everything here that refuses a command does so
before the folder changes."""
from __future__ import annotations
import contextlib, fcntl, json, math, os, signal, socket, sys, threading
from dataclasses import dataclass
from typing import Any, Callable
import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file
from tinygrad import Device, Tensor
from data import BPE, Bytes
from optim import Optimizer
from registry import ESTIMATORS, Entry, Run, activations, size

class UsageError(Exception): pass  # a mistake the user can fix: one line, exit code 2, no traceback

@dataclass
class Best:
  """The best val loss so far, its step, and the evaluations since then that brought no better one: the run's state for
  --patience and --keep-best, saved in the checkpoint's metadata, so that both go on exactly after --resume."""
  val:float = math.inf
  step:int = -1
  since:int = 0

  def seen(self, step:int, val:float) -> bool:
    """Count an evaluation: True when it is a new best."""
    if val < self.val:
      self.val, self.step, self.since = val, step, 0
      return True
    self.since += 1
    return False

def write(path:str, tensors:dict[str, np.ndarray], metadata:dict[str, str], what:str):
  """Atomic: write a temp file, fsync it, rename it over the old one, so a crash mid-write leaves the previous one
  intact. Written from host copies by the safetensors package: tinygrad's safe_save goes through its CPU device, which
  compiles helper programs with clang even under DEV=CUDA, so a GPU machine without clang lost the whole run at its
  first checkpoint. Weights that are not all finite are never written: the run stops, the previous checkpoint kept. A
  write that fails (a full disk, a file size limit, permissions) stops the run with the path and the OS's error, the
  temp file removed and the previous file as it was."""
  tmp, ckpt, step = f"{path}.tmp", os.path.join(os.path.dirname(path), "model.safetensors"), metadata["step"]
  if bad := next((k for k, a in tensors.items() if k.startswith("param.") and not np.isfinite(a).all()), None):
    raise UsageError(f"step {step}: the weights of {bad.removeprefix('param.')} are not finite: diverged, and not "
                     f"saved; {kept(ckpt)}")
  try:
    save_file(tensors, tmp, metadata=metadata)
    mask = os.umask(0)
    os.umask(mask)
    # safetensors creates its file private (0600); a checkpoint gets the mode of any file the user writes
    os.chmod(tmp, 0o666 & ~mask)
    with open(tmp, "rb+") as f: os.fsync(f.fileno())
    os.replace(tmp, path)
  except (OSError, SafetensorError) as e:
    with contextlib.suppress(OSError): os.remove(tmp)
    raise UsageError(f"cannot write the {what} of step {step} to {tmp}: {e}; {kept(ckpt)}") from None

def params(model) -> dict[str, np.ndarray]: return {f"param.{n}": p.numpy() for n, p in model.params.items()}

def save(out:str, model, opt:Optimizer, step:int, state:dict[str, Tensor]|None=None, best:Best|None=None):
  """The checkpoint of a step: the weights, the optimizer's and the estimator's state, and the best val so far."""
  tensors = params(model) | {k: t.numpy() for k, t in {**opt.state(),
                                                       **{f"state.{k}": t for k, t in (state or {}).items()}}.items()}
  write(os.path.join(out, "model.safetensors"), tensors, {"step": str(step), "best": json.dumps(vars(best or Best()))},
        "checkpoint")

def keep_best(out:str, model, best:Best):
  """--keep-best: the weights of the best val so far, OUT/best.safetensors, with their step and val in its metadata."""
  write(os.path.join(out, BEST), params(model), {"step": str(best.step), "val_loss": repr(best.val)}, "best weights")

BEST = "best.safetensors"  # --keep-best's weights, which --sample --best and --init RUN --best read

def kept(path:str) -> str:
  """What a stopped run keeps of its checkpoints: the one at `path`, named by its step, or none."""
  try:
    with safe_open(path, "np") as f: return f"the checkpoint of step {f.metadata()['step']} in {path} is kept"
  except (OSError, SafetensorError, KeyError, TypeError): return "no checkpoint is saved"

def load_checkpoint(out:str, model, flag:str, keep:str="", name:str="model.safetensors") -> tuple[dict[str, Tensor],
                                                                                                 dict[str, Any]]:
  """The model's parameters set from the checkpoint `name` in out (or the kept best weights, BEST); returns the
  checkpoint's tensors whose names start with `keep`, and its metadata, its step an int."""
  path = os.path.join(out, name)
  hint = (f"--force starts the run in {out} over" if flag == "--resume" else
          "a run with --keep-best keeps them" if name == BEST else "train a run there first")
  # a run killed before its first save
  if not os.path.exists(path): raise UsageError(f"{flag}: no checkpoint at {path}; {hint}")
  try:
    with safe_open(path, "np") as f:
      st, meta = {k: Tensor(f.get_tensor(k)) for k in f.keys() if k.startswith(keep)}, f.metadata() or {}
    meta["step"] = int(meta["step"])
  except (OSError, SafetensorError, KeyError, ValueError) as e:
    problem = "no step in its metadata" if isinstance(e, KeyError) else str(e)
    raise UsageError(f"{flag}: cannot read the checkpoint {path} ({problem}); {hint}") from None
  for n, p in model.params.items():
    if f"param.{n}" not in st or st[f"param.{n}"].shape != p.shape:
      what = "no" if f"param.{n}" not in st else f"a {st[f'param.{n}'].shape} (the model's is {p.shape})"
      raise UsageError(f"{flag}: {path} holds another model: {what} tensor param.{n}; {hint}")
    p.assign(st[f"param.{n}"].to(p.device)).realize()
  return st, meta

def resume(out:str, model, opt:Optimizer, state:dict[str, Tensor]|None=None) -> tuple[int, Best]:
  """The run's weights, optimizer and estimator state (into `state`) from its checkpoint; the step to go on from, and
  the best val so far (a checkpoint from before --patience: none yet)."""
  st, meta = load_checkpoint(out, model, "--resume")
  opt.load(st)
  if state is not None:
    state.update({k.removeprefix("state."): t.contiguous().realize() for k, t in st.items() if k.startswith("state.")})
  return meta["step"], Best(**json.loads(meta.get("best", "{}")))

def init_from(args, model):
  """--init RUN: the model's weights from another run's checkpoint, where this run then starts with a fresh optimizer at
  step 0, on its own --data (pretrain with backprop, adapt with forward passes). The run's model flags must be this
  one's. A --resume continues from its own checkpoint (and checks that its --init is the run's)."""
  if not args.init or args.resume: return
  src = read_config(args.init, "--init")
  if diff := [k for k in ("model", "vocab", "loops") if src[k] != getattr(args, k)]:
    raise UsageError(f"--init {args.init}: that run's model is another: " +
                     ", ".join(f"--{typed(k)} {src[k]} there, {getattr(args, k)} here" for k in diff))
  load_checkpoint(args.init, model, "--init", keep="param.", name=BEST if args.best else "model.safetensors")


def text_tokenizer(args, flag:str|None=None, sha256:str|None=None) -> Bytes|BPE:
  """--tokenizer for --data: bytes, or a BPE: under `flag` (--resume, --sample) the run's own, OUT/tokenizer.json (whose
  sha256 must be `sha256`, the run's record, where it has one), else one trained on the text. A BPE of size N sets
  --vocab to N."""
  from data import bpe_size, tokenizer
  saved = os.path.join(args.out, "tokenizer.json")
  if flag and bpe_size(args.tokenizer) and not os.path.exists(saved):
    raise UsageError(f"{flag}: {args.out} has no tokenizer.json: it is not a run of --tokenizer {args.tokenizer}")
  tok = tokenizer(args.tokenizer, args.data, saved if flag else None)
  if isinstance(tok, BPE):
    if flag and sha256 not in (None, tok.sha):
      raise UsageError(f"{flag}: {saved} is not the tokenizer the run was trained with: its sha256 is {tok.sha}, the "
                       f"run's {sha256}")
    if args.vocab not in (None, tok.vocab):
      raise UsageError(f"--vocab {args.vocab}: --tokenizer {tok.spec} sets the vocab to {tok.vocab}")
    args.vocab = tok.vocab
  return tok

# a flag's argparse name as the user types it (less its dashes)
def typed(dest:str) -> str: return dest.replace("_", "-")

# ***** config.json: what a run is *****

# Each key of config.json that zo reads back, and the JSON it must hold: None where a flag left to its default is null.
# The run's method adds its options, each of its default's type.
KEYS = {"method": (str,), "model": (str,), "vocab": (int, None), "loops": (int, None), "eval_loops": (int, None),
        "data": (str,), "data_sha256": (str, None), "tokenizer": (str,), "tokenizer_sha256": (str, None),
        "init": (str, None), "seed": (int,), "batch": (int,), "seq": (int,), "pop": (int,), "optim": (str,),
        "lr": (float, None), "momentum": (float, None), "warmdown": (float, None), "replay": (int,),
        "steps": (int, None), "tokens": (int, None), "best": (bool,)}
# the keys that a run from before them lacks, and what such a run had
SINCE = {"tokenizer": "bytes", "data_sha256": None, "tokenizer_sha256": None, "init": None, "best": False}
# What decides a run's data and estimates, besides its method's options: --resume refuses another value of any. The
# data's content and the tokenizer are checked by their sha256 (same_run, text_tokenizer).
IDENTITY = ("method", "model", "vocab", "loops", "eval_loops", "data", "tokenizer", "init", "best", "seed", "batch",
            "seq", "pop", "optim", "lr", "momentum", "warmdown", "replay")
# what --resume may change: the run's length (and so its lr schedule's), the intervals, the devices, when to stop early
# and whether to keep the best weights
FREE = ("steps", "tokens", "eval_every", "ckpt_every", "devices", "patience", "keep_best")

def is_json(v:Any, types:tuple) -> bool:  # an integer is a number too; a bool is no number
  if v is None: return None in types
  if isinstance(v, bool): return bool in types
  return isinstance(v, tuple(t for t in types if t) + ((int,) if float in types else ()))

def described(types:tuple) -> str:
  names = {str: "a string", int: "an integer", float: "a number"}
  return " or ".join([names[t] for t in types if t] + (["null"] if None in types else []))

def read_config(out:str, flag:str) -> dict:
  """The config.json of the run in out, read through KEYS: a file that is missing or isn't a JSON object, a key missing
  or of another type, is refused in one line that names the file and the key."""
  path = os.path.join(out, "config.json")
  if not os.path.exists(path): raise UsageError(f"{flag}: no run in {out} (no config.json)")
  try:
    with open(path, "rb") as f: config = json.load(f)
  except (OSError, ValueError) as e:  # ValueError: not JSON, or not UTF-8
    raise UsageError(f"{flag}: cannot read {path}: {getattr(e, 'strerror', None) or e}") from None
  if not isinstance(config, dict):
    raise UsageError(f"{flag}: {path} holds a JSON {type(config).__name__}, not an object of the run's settings")
  entry = ESTIMATORS.get(config["method"]) if isinstance(config.get("method"), str) else None
  options = {o: entry.default(o) for o in entry.options} if entry else {}  # an option from before it: its default
  config = SINCE | options | config
  for k, types in (KEYS | {o: (type(v),) for o, v in options.items()}).items():
    if k not in config: raise UsageError(f"{flag}: {path} has no key {k!r}")
    if not is_json(config[k], types):
      raise UsageError(f"{flag}: {path}: {k!r} is {json.dumps(config[k])}, not {described(types)}")
  return config

def shown(k:str, v:Any) -> str: return f"the default --{typed(k)}" if v is None else f"--{typed(k)} {v}"

def same_run(flag:str, args, run:dict, keys:tuple[str, ...]):
  """Check that the run in --out (its config `run`) was made with these flags' values and, where it recorded one, the
  data's sha256 (args.data_sha256): any other is refused in one line that names each flag, the run's value and this
  command's. A command that gives neither --steps nor --tokens takes the run's."""
  if diff := [k for k in keys if run.get(k) != getattr(args, k)]:
    diff = ["method"] if "method" in diff else diff  # another method's options differ too
    raise UsageError(f"{flag}: {args.out} is a run of {' and '.join(shown(k, run.get(k)) for k in diff)}, not "
                     f"{' and '.join(shown(k, getattr(args, k)) for k in diff)}")
  if run["data_sha256"] not in (None, args.data_sha256):
    raise UsageError(f"{flag}: --data {args.data} is not the run's data: its sha256 is {args.data_sha256}, the run's "
                     f"{run['data_sha256']}")
  if args.steps is None and args.tokens is None: args.steps, args.tokens = run["steps"], run["tokens"]

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

def prepare(args, config:dict, steps:int, model, opt:Optimizer, state:dict[str, Tensor]) -> tuple[int, float, Best]:
  """The run folder made ready under its lock, each check before anything changes: --resume's checkpoint loaded (a
  run of fewer steps than it holds is refused) and its log trimmed to it; or a fresh run's refusal of another run's
  folder, or --force's deletion of that run. Then config.json, metrics.jsonl checked writable first. Returns the step
  to start at, the seconds its steps took before a --resume, and the best val so far."""
  cfg_path, log_path = os.path.join(args.out, "config.json"), os.path.join(args.out, "metrics.jsonl")
  if os.path.exists(args.out) and not os.path.isdir(args.out): raise UsageError(f"--out {args.out}: not a directory")
  lock(args.out)
  start, trained, best = 0, 0.0, Best()
  with files("--out"):
    if args.resume: start, best = resume(args.out, model, opt, state)
    if start > steps:
      given = f"--steps {steps}" if args.steps else f"--tokens {args.tokens:,} ({steps} steps)"
      raise UsageError(f"--resume {given}: {args.out} is at step {start} already: --steps {start} or more goes on")
    if args.resume:
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
           (() if args.resume else ("metrics.jsonl", "model.safetensors", "tokenizer.json", BEST))
           if os.path.exists(p := os.path.join(args.out, f))]
    if bad := next((p for p in old if os.path.isdir(p) and not os.path.islink(p)), None):
      raise UsageError(f"cannot delete {bad}: it is a directory; nothing was deleted")
    for p in old: os.remove(p)
    open(log_path, "a").close()  # writable, before config.json is written
    json.dump(config, open(cfg_path, "w"), indent=1)
  return start, trained, best

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

def append(log, rec:dict, kept:str):
  """One line of metrics.jsonl, written whole or not at all: a write that fails (a full disk, a file size limit) is cut
  back to the lines before it, and stops the run in one line saying what is `kept`. `log` is unbuffered, so that each
  write is the file's."""
  line, end = memoryview((json.dumps(rec) + "\n").encode()), os.fstat(log.fileno()).st_size
  try:
    while line: line = line[log.write(line):]  # a short write (the disk filled up) leaves the rest for the next
  except OSError as e:
    log.truncate(end)
    raise UsageError(f"cannot write step {rec['step']} to {log.name}: {e.strerror}; {kept}") from None

def logged_step(line:str) -> float:  # a line torn by a crash mid-write counts as not logged
  try: return json.loads(line)["step"]
  except (ValueError, KeyError, TypeError): return math.inf

def memory(args, entry:Entry, job:Run) -> float|None:
  """The bytes a step holds at once: the activations and draws its estimator declares (registry.py; else one forward of
  the batch), the parameters, and their optimizer state and update (three copies more); None for a model of other
  shapes. Within 2x of tinygrad's measured peak for the tiny and small presets on the CPU (tests/test_robust.py)."""
  held = entry.memory(job) if entry.memory else activations(job.model, args.batch * args.seq)
  return None if held is None else held + 4 * size(job.model) * 4

def check_memory(args, entry:Entry, job:Run):
  """A step that can't fit the machine's memory, refused before any work or any file, with the size it needs
  (--batch 100000 at the tiny preset: 123 GiB by this; it was killed at 24 GB). The sizes an estimator's kernels can't
  index are its own check's."""
  if (need := memory(args, entry, job)) and (have := device_memory()) and need > have:
    raise UsageError(f"--batch {args.batch} --seq {args.seq}: a step of --method {args.method} needs about "
                     f"{need / 2**30:,.1f} GiB, this machine has {have / 2**30:,.1f} GiB: --batch "
                     f"{max(1, int(args.batch * have / need)):,} may fit")

def device_memory() -> int|None:  # the CPU's is the machine's RAM; tinygrad doesn't tell a GPU's
  return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") if Device.DEFAULT.split(":")[0] == "CPU" else None
