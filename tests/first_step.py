#!/usr/bin/env python3
r"""Where a run's first seconds go: zo.py's training loop with each phase of its first two steps timed between device syncs.

  DEV=CUDA CACHEDB=/tmp/cold.db CUDA_CACHE_PATH=/tmp/nv python tests/first_step.py --method dust --pop 1024 --steps 1 --force \
    2>&1 | tr '\r' '\n' | grep 's\] '

takes zo.py's flags and prints, on stderr, each phase (the model, the data, the first step's dry run that compiles its kernels ahead,
the step, the update, the check, the evaluation, the save) with its seconds and what it did inside them: JIT captures and their
seconds (in the dry run, the JIT calls traced), `lower_and_compile` calls and their seconds (tinygrad's lowering and compiling of a
capture's new kernels, in its pool of workers) with the programs new to the process (lowered, or read from the db) and the slowest
calls, compiles in this process (a batch of one kernel) and cache hits, and on CUDA the module loads. Fresh CACHEDB and
CUDA_CACHE_PATH (the driver's cache) make a cold run, as on a new machine.
"""
import collections, os, sys, time
from typing import Callable
T0 = time.perf_counter()
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tinygrad import Device
from tinygrad.device import Compiler
from tinygrad.helpers import diskcache_get
import tinygrad.engine.realize
import data, engine, optim, zo

seconds, counts = collections.Counter(), collections.Counter()
batches:list[tuple[float, int]] = []  # each lower_and_compile call's seconds and the programs new to the process: lowered, or read from the db

def counted(cls, name:str, what:Callable[..., str|None]):
  """cls.name with its seconds and calls added to seconds[k] and counts[k], k = what(*args), the counter a call belongs to (None: none)."""
  fn = getattr(cls, name)
  def wrapped(*a, **kw):
    if (k := what(*a)) is None: return fn(*a, **kw)
    t = time.perf_counter()
    try: return fn(*a, **kw)
    finally: seconds[k] += time.perf_counter() - t; counts[k] += 1
  setattr(cls, name, wrapped)

def phase(name:str, module, attr:str):
  """module.attr timed between device syncs; its first two calls printed with what happened inside them."""
  fn = getattr(module, attr)
  def timed(*a, **kw):
    if engine.AHEAD is not None: return fn(*a, **kw)  # the step's dry run is timed as a whole, by its own phase
    Device[Device.DEFAULT].synchronize()
    s0, c0, t = seconds.copy(), counts.copy(), time.perf_counter()
    r = fn(*a, **kw)
    Device[Device.DEFAULT].synchronize()
    if (calls := counts[name]) < 2:
      inside = ", ".join(f"{k} {counts[k] - c0[k]} in {seconds[k] - s0[k]:.1f} s" for k in counts if counts[k] > c0[k] and k in seconds)
      # the calls compile one after another, each in parallel: the slowest kernel of each bounds the phase
      if mine := sorted((b for b in batches[c0["lower_and_compile"]:] if b[1]), reverse=True):
        inside += f"; new programs {sum(n for _, n in mine)}, the slowest calls (s/programs) " + " ".join(f"{s:.1f}/{n}" for s, n in mine[:8])
      print(f"[{time.perf_counter() - T0:6.1f} s] {name}{' again' if calls else ''}: {time.perf_counter() - t:.2f} s; {inside}", file=sys.stderr,
            flush=True)
    counts[name] += 1
    return r
  setattr(module, attr, timed)

def compile_kind(compiler:Compiler, src:str) -> str:  # a compile in this process, or a hit in the cache db: one lookup
  return "compile cache hits" if compiler.cachekey is not None and diskcache_get(compiler.cachekey, src) is not None else "compiles here"
counted(Compiler, "compile_cached", compile_kind)
def batch(linear):  # one lower_and_compile call, counted as `counted` counts, and kept in `batches` with the programs it added
  cache, t = tinygrad.engine.realize.to_program_cache, time.perf_counter()
  n = len(cache)
  try: return lower_and_compile(linear)
  finally:
    batches.append((time.perf_counter() - t, len(cache) - n))
    seconds["lower_and_compile"] += batches[-1][0]; counts["lower_and_compile"] += 1
lower_and_compile, tinygrad.engine.realize.lower_and_compile = tinygrad.engine.realize.lower_and_compile, batch
counted(engine.Jit, "__call__", lambda jit, *_: "captures" if jit.cnt == 1 else None)  # its capture (engine.Jit: at its first call)
if Device.DEFAULT.split(":")[0] == "CUDA":
  import tinygrad.runtime.ops_cuda
  counted(tinygrad.runtime.ops_cuda.CUDAProgram, "__init__", lambda *_: "module loads")
for name, module, attr in [("model", zo, "make_model"), ("data", data, "load"), ("compile ahead", engine, "compile_ahead"),
                           ("step", zo, "run"), ("update", optim.Optimizer, "step"),
                           ("check", zo, "checked"), ("evaluation", zo, "val_loss"), ("save", zo, "save")]:
  phase(name, module, attr)
print(f"[{time.perf_counter() - T0:6.1f} s] imports", file=sys.stderr)
try: zo.main(sys.argv[1:])
finally: print(f"[{time.perf_counter() - T0:6.1f} s] end", file=sys.stderr)
