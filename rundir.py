"""The run folder: config.json and the checks of a run against it, the lock, checkpoints, --resume and --init, the run's
tokenizer, and the signals that stop a run with its checkpoint saved. Everything here that refuses a command does so
before the folder changes."""
from __future__ import annotations
import contextlib, fcntl, json, math, os, signal, socket, sys, threading
from typing import Any, Callable
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file
from tinygrad import Device, Tensor
from data import BPE, Bytes
from optim import Optimizer
from registry import ESTIMATORS

class UsageError(Exception): pass  # a mistake the user can fix: one line, exit code 2, no traceback

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

def check_memory(args, model):
  """A step whose memory plainly exceeds the machine's, refused before any work or any file. A lower bound of a step's
  memory: one forward's tokens hold at once an MLP's input and hidden layer (1 + 4 widths) or the head's input and
  logits (a width and the vocab), each a matmul's output, in the compute dtype. The peak is higher (the estimators batch
  several draws a forward): --batch 100000 at the tiny preset held 9 GB in its first step on the CPU. The sizes an
  estimator's kernels can't index are its own check's."""
  B, T = args.batch, args.seq
  need, have = (B * T * max(5 * model.cfg.n_embd, model.cfg.n_embd + model.cfg.vocab) * model.dtype.itemsize,
                device_memory())
  if have and need > have:
    raise UsageError(f"--batch {B} --seq {T}: a step needs at least {need / 2**30:,.1f} GiB, this machine has "
                     f"{have / 2**30:,.1f} GiB: --batch {max(1, B * have // need):,} may fit")

def device_memory() -> int|None:  # the CPU's is the machine's RAM; tinygrad doesn't tell a GPU's
  return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") if Device.DEFAULT.split(":")[0] == "CPU" else None
