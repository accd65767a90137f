"""The engine: how zo runs its tensor code fast on tinygrad 0.14, and every place where that needs tinygrad's internals.

The algorithm code (model.py, estimators.py, dust.py, optim.py, zo.py) is plain tinygrad: Tensor math, read top-down. What it
asks of this module is small:

  jit(fn, owner, **static)         fn as a TinyJit per input shape, kept for the process: a step's tensor code runs as replays
  stack(fn, owner, ..., items=...) fn over chunks of items (a population's pairs), one JIT replayed per chunk, results stacked
  summed(fn, owner, ..., chunks=...) the sum of fn's outputs over chunks of draws, one JIT replayed per chunk call
  compile_ahead(fn, what)          fn's kernels compiled at once before it runs: a process's first step, in seconds
  empty(*shape, device)            a buffer for a JIT to write, the caller's to keep
  tensor(array) / read(t)          a small array onto the device and a JIT's small output back, by the device's own copies

Why a step runs as replays at all: eagerly, tinygrad builds and schedules every graph again at every call, and for zo's steps
that host time was larger than the GPU's: folding a MeZO step's keys and coefficients took 6 ms on a 2-core CPU eagerly and
0.08 ms as a replay, where the small preset's forward takes 0.5 ms on the H200.

Each workaround below says which tinygrad 0.14 behaviour it works around and what that cost, as measured
(docs/performance.md has the runs):
- buffer numbers apart from a cached schedule's placeholders (the patch below),
- one memory arena shared by every JIT's plan (Scratch),
- replays that take whole buffers as they are (Jit.whole_inputs),
- captures that hide the live lazy tensors (apart),
- JITs that free what they own until their next replay (Function.release),
- the device's copy-in and copy-out for small arrays (tensor, read),
- kernels lowered again in every process (LoweredOnDisk),
- graphs scheduled again in every process (ScheduledOnDisk),
- a JIT's kernels compiled when it is captured, so that a first step waits for one batch of compiles after another (Ahead),
- CUDA kernels compiled by the driver at every process's module loads, and zo's for Hopper one at a time (nvrtc_for),
- a view's place in its buffer found by a graph rewrite at every use (contiguous_view),
- CUDA graphs destroyed after the CUDA library at exit (the atexit below),
- CPython's full collections walking every object that compiling a step left (freeze_compiled).
"""
from __future__ import annotations
import atexit, contextlib, functools, gc, hashlib, importlib.metadata, itertools, os, pathlib, pickle, re, sqlite3, weakref
from typing import Any, Callable
import numpy as np
from tinygrad import Context, Device, Tensor, Variable, dtypes
from tinygrad.device import Buffer, MultiBuffer
from tinygrad.dtype import _from_np_dtype, _to_np_dtype
from tinygrad.codegen import to_program_context, to_program_key
from tinygrad.engine.jit import CapturedJit, _TinyJit, _prepare_jit_inputs
import tinygrad.codegen, tinygrad.engine.realize
from tinygrad.engine.realize import _compile_kernel, _get_call_to_compile, capturing, graph_cache
from tinygrad.engine.worker import get_worker_pool
from tinygrad.helpers import BEAM, DEBUG, JIT, Target, diskcache_get, diskcache_put, getenv
from tinygrad.nn.state import get_parameters
from tinygrad.renderer.cstyle import CUDARenderer
from tinygrad.runtime.support.compiler_cuda import NVRTCCompiler
from tinygrad.tensor import all_tensors
from tinygrad.uop.ops import Ops, UOp, buffers
import tinygrad.schedule

# Buffer numbers. tinygrad 0.14 numbers new buffers (UOp.new_buffer) and the placeholder buffers of a cached schedule from the same
# small integers, and UOps are hash-consed: a new buffer with a placeholder's number and size *is* that placeholder, which the schedule
# cache keeps for the life of the process, and with it the buffer's memory. A lazy forward schedules about one placeholder per
# activation, so the first passes of a process leaked up to a forward's activations, more at every loop of the looped model (1.1 MB
# after two clean forwards of the tiny one at 32 loops). New buffers numbered from 2^30 never meet a placeholder.
UOp.unique_num = itertools.count(1 << 30)

def tinygrad_version() -> str|None:
  try: return importlib.metadata.version("tinygrad")
  except importlib.metadata.PackageNotFoundError: return None

@functools.cache
def tinygrad_settings() -> tuple[str|None, tuple[tuple[str, str], ...]]:
  """tinygrad's version, and each of its settings that the environment sets: the names its source reads with getenv or ContextVar.
  tinygrad's own key for a lowered kernel leaves out those that cannot change inside one process (THREADS, MV_*, ...), but they can
  between processes. Read at the first kernel a process looks up (0.1 s, which a process that lowers none, `zo.py --help`, skips)."""
  names = set()
  for f in pathlib.Path(tinygrad.__file__).parent.rglob("*.py"):
    names.update(re.findall(r"""(?:getenv|ContextVar)\(\s*["']([A-Z_0-9]+)["']""", f.read_text()))
  return tinygrad_version(), tuple((n, os.environ[n]) for n in sorted(names) if n in os.environ)

def row(key:tuple) -> str: return hashlib.sha256(repr((tinygrad_settings(), *key)).encode()).hexdigest()  # a db row, by tinygrad's settings

def kept(table:str, *key) -> Any:
  """What zo keeps in tinygrad's cache db under `key` and tinygrad's settings; None where it has nothing or can't read it."""
  try: return diskcache_get(table, row(key))
  except (OSError, sqlite3.Error, pickle.UnpicklingError, AttributeError, EOFError, RecursionError): return None

def keep(table:str, value:Any, *key) -> None:  # a db that can't be written keeps nothing
  with contextlib.suppress(OSError, sqlite3.Error, pickle.PicklingError, RecursionError): diskcache_put(table, row(key), value)

class OnDisk(dict):
  """One of tinygrad's in-memory caches that also reads and writes tinygrad's cache db (kept, keep), in the table TABLE under
  PREFIX and tinygrad's key. A value that `portable` refuses stays in memory only."""
  TABLE, PREFIX = "", ()
  def get(self, key, default=None):
    if (v := dict.get(self, key)) is None and (v := kept(self.TABLE, *self.PREFIX, key)) is not None: dict.__setitem__(self, key, v)
    return default if v is None else v
  def __contains__(self, key) -> bool: return self.get(key) is not None
  def __getitem__(self, key) -> UOp:
    if (v := self.get(key)) is None: raise KeyError(key)
    return v
  def __setitem__(self, key, v:UOp):
    dict.__setitem__(self, key, v)
    if self.portable(v): keep(self.TABLE, v, *self.PREFIX, key)
  def portable(self, v:UOp) -> bool: return True

class LoweredOnDisk(OnDisk):
  """Lowered kernels kept across processes. tinygrad 0.14 keeps on disk only each kernel's compiled binary, so every process lowers
  every kernel again (its AST rewritten, optimized and rendered to source): about 0.19 s a kernel on a 2-core CPU, for the 264
  kernels of a Dust step at the small preset, most of a second run's first step. This is tinygrad's in-memory cache of lowered
  programs, keyed as tinygrad keys it (the AST's hash, the renderer, its target and the settings that shape code) and by
  tinygrad_settings(), that also reads and writes tinygrad's cache db (docs/performance.md has what it saves). It is off where
  tinygrad is told to compile again (CACHELEVEL=0, CCACHE=0, IGNORE_BEAM_CACHE=1) or has no version (a source checkout, whose code
  may change under one version), and a db that can't be read or written leaves it in memory, as tinygrad's own."""
  # CUDA's programs are machine code, Hopper's for sm_90a (nvrtc_for): rows from before are not found
  TABLE, PREFIX = "zo_lowered", ("cubin, sm_90a",)

class ScheduledOnDisk(OnDisk):
  """Schedules kept across processes. tinygrad 0.14 keeps a graph's schedule (its kernels' ASTs in order, the graph's
  buffers as parameters, placeholders for its intermediates) for the process only, keyed by the graph's structure, so
  every process schedules every graph again: with the lowered kernels on disk, 2/3 of a second `zo.py` run's CPU
  seconds at the tiny preset (docs/performance.md). This is tinygrad's schedule cache, keyed as tinygrad keys it and by
  tinygrad_settings(), that also reads and writes tinygrad's cache db, where LoweredOnDisk does. The placeholders' small
  numbers never meet a new buffer's (see the buffer numbers above), in another process as in this one; a schedule that
  holds a buffer with memory (whose data a row would carry to another process) is kept in memory only."""
  TABLE = "zo_scheduled"
  def portable(self, linear:UOp) -> bool: return not any(u.op is Ops.BUFFER and u in buffers for u in linear.toposort())

if tinygrad_version() is not None and getenv("CCACHE", 1) and not getenv("IGNORE_BEAM_CACHE"):
  tinygrad.codegen.to_program_cache = tinygrad.engine.realize.to_program_cache = LoweredOnDisk(tinygrad.codegen.to_program_cache)
  tinygrad.schedule.schedule_cache = ScheduledOnDisk(tinygrad.schedule.schedule_cache)

def nvrtc_for(target:Target, ptx:bool) -> NVRTCCompiler:
  """The CUDA renderer's compiler, NVRTC, in two ways that tinygrad 0.14's is not:
  - machine code (a cubin) instead of PTX. tinygrad keeps PTX for its CUDA backend, and the driver compiles PTX to machine code at each
    module load: one kernel at a time, in the process, at every run that its own cache (~/.nv/ComputeCache) has not seen. A cubin is
    compiled where tinygrad compiles (its pool of workers) and kept in its cache db. PTX stays under DEBUG>=5, where tinygrad prints
    it, and on a MOCK interface, which emulates PTX.
  - for sm_90a on Hopper (sm_90): the only target with wgmma, which zo's GEMMs use. Its code runs on Hopper alone, the GPU it is
    compiled for here. One compiler then builds every kernel, zo's too, in tinygrad's pool: compiled apart, one at a time in the
    process, zo's 39 took 9.6 s of an H100's cold first Dust step."""
  arch = "sm_90a" if target.arch == "sm_90" else target.arch
  return NVRTCCompiler(arch, ptx=ptx, cache_key=target.device.lower() + ("" if ptx else "_sass"))
_cuda_renderer_init = CUDARenderer.__init__
def cuda_renderer_init(self:CUDARenderer, target:Target, use_nvcc:bool=False):
  _cuda_renderer_init(self, target, use_nvcc)
  if type(self.compiler) is NVRTCCompiler:
    self.compiler = nvrtc_for(target, ptx=self.compiler.ptx and (target.device != "CUDA" or target.interface.startswith("MOCK") or DEBUG >= 5))
def cuda_renderer_reduce(self:CUDARenderer) -> tuple:
  # tinygrad pickles a renderer as its class and target for its pool of workers, fresh processes that never import this module and
  # would build it with tinygrad's compiler again: the renderer goes with its compiler
  return type(self), (self.target,), {"compiler": self.compiler}
CUDARenderer.__init__, CUDARenderer.__reduce__ = cuda_renderer_init, cuda_renderer_reduce

# Views. tinygrad 0.14 finds where a view lies in its buffer (UOp.contiguous_view) by a graph rewrite, again each time it derives the
# view's Buffer, and Scratch has it derive every JIT's views again whenever an arena moves: at each capture of a first step, and then in
# every CUDA graph that the first replays rebuild (1.4 of the 1.8 s of the small preset's first replay of a Dust step, NULL device). A
# UOp never changes, so its answer is kept for as long as the UOp lives.
_contiguous_view, views = UOp.contiguous_view, weakref.WeakKeyDictionary()
def contiguous_view(self:UOp) -> tuple[UOp, int]|None:
  if self not in views: views[self] = _contiguous_view(self)
  return views[self]
UOp.contiguous_view = contiguous_view

# tinygrad 0.14's CUDA graphs call the CUDA library from __del__, which at the interpreter's exit runs after that library's module is
# gone: every GPU run ended with "Exception ignored in CUDAGraph.__del__ ... 'NoneType' object has no attribute 'cuGraphDestroy'" on
# stderr. The graphs are dropped while it is still there.
atexit.register(graph_cache.clear)

class Scratch:
  """One arena per device for the memory plans of every JIT. tinygrad plans a JIT's intermediates into an arena of its own: the ~45
  JITs of a Dust update held 4.5 GiB so at the small preset (pop 256, H200), and freeing each arena after its call instead made tinygrad
  rebuild the JIT's CUDA graph at its next call. JITs run one after another on a
  device's queue, so they can share one arena, as the buffers inside one plan do: each planned arena becomes a view into its device's,
  as large as the largest plan. A JIT with a copy keeps its own: a copy to another device may still be reading it when the next JIT
  writes there."""
  def __init__(self):
    self.base:dict[str, Buffer] = {}
    self.users:list[tuple[CapturedJit, list[tuple[UOp, int]]]] = []  # each JIT's arenas and their offsets in its device's arena

  @property
  def arenas(self) -> set[UOp]: return {u for _, offsets in self.users for u, _ in offsets}

  def free(self) -> None:
    """Before a capture, which runs on an arena of its own: else the largest plan would be held twice while the next one is captured."""
    for captured, _ in self.users: drop_graphs(captured)  # they hold the arenas' addresses; a replay makes them again
    for old in self.base.values(): forget(old)
    for u in self.arenas: buffers.pop(u, None)
    self.base.clear()

  def adopt(self, captured:CapturedJit|None) -> None:
    """After a capture: its arenas join the shared ones, placed one after another per device, and every JIT's are placed again."""
    outputs = {t.uop.base for t in get_parameters(captured.ret)} if captured else set()
    # the planner's arenas are its only int8 buffers; anything else a JIT writes (an output, an optimizer's weights) is not scratch
    planned = [u for u in captured._written_uops if u.dtype == dtypes.int8 and isinstance(u.device, str) and u not in outputs] if captured else []
    if planned and not any(u.op is Ops.COPY for u in captured.linear.toposort()):
      drop_graphs(captured)
      offsets, end = [], {}
      for u in planned:
        offsets.append((u, end.get(u.device, 0)))
        end[u.device] = end.get(u.device, 0) + u.nbytes()  # the planner rounds arenas to 256 bytes, so each view stays aligned
        forget(buffers.pop(u, None))
      self.users.append((captured, offsets))
    need:dict[str, int] = {}
    for _, offsets in self.users:
      for u, off in offsets: need[u.device] = max(need.get(u.device, 0), off + u.nbytes())
    self.base = {dev: Buffer(dev, n, dtypes.int8) for dev, n in need.items()}
    for _, offsets in self.users:
      for u, off in offsets: buffers[u] = Buffer(u.device, u.nbytes(), dtypes.int8, base=self.base[u.device], offset=off)

SCRATCH = Scratch()

def forget(old:Buffer|MultiBuffer|None) -> None:
  """Drop the views tinygrad derived from a buffer no longer used: the next run derives them from the buffer that replaced it."""
  for k in [k for k, b in list(buffers.items()) if old is not None and isinstance(b, Buffer) and b._base is old]: del buffers[k]

def drop_graphs(captured:CapturedJit) -> None:
  for call in captured.linear.src:
    if call.src[0].op is Ops.CUSTOM_FUNCTION and call.src[0].arg == "graph": graph_cache.pop(call.src[0], None)

class Jit(_TinyJit):
  """A TinyJit that captures at its first call, whose memory plan then lives in the shared Scratch, and whose replays take whole
  buffers as they are. tinygrad runs a TinyJit's first call eagerly, as a warm-up: eagerly there is no memory plan, so the first
  Dust update at pop 1024 peaked at 46.5 GiB on the H200 against 8.0 for the next, and every graph was scheduled twice."""
  def __init__(self, fn:Callable):
    super().__init__(lambda *a: apart(fn, *a))
    self.cnt = 1  # TinyJit's call counter: 0 runs eagerly, 1 captures

  def __call__(self, *args, **kwargs):
    if AHEAD is not None: return AHEAD.trace(self, args, kwargs)
    if self.cnt >= 2 and JIT and not kwargs and (bufs := self.whole_inputs(args)) is not None:
      self.cnt += 1
      return self.captured(bufs, {v.expr: val for v, val in (a.unbind() for a in args if isinstance(a, UOp))})
    capture = self.cnt == 1 and bool(JIT)
    if capture: SCRATCH.free()
    try: return super().__call__(*args, **kwargs)
    finally:
      if capture: SCRATCH.adopt(self.captured)  # after a failed capture too: the other JITs' arenas come back

  def whole_inputs(self, args:tuple) -> list[UOp]|None:
    """A replay's input buffers, when every input is a whole buffer (realized, or an array to copy in) in the shape, dtype and device
    the capture saw; None otherwise, for tinygrad's own preparation. That finds each input's view of its buffer by two graph rewrites
    (70-96 us an input on a 2-core CPU; two thirds of backprop's JIT calls' host time on the H200's machine), before the replay's first
    kernel, while the GPU waits: a step's sync leaves it idle until then."""
    ts = [a for a in args if isinstance(a, Tensor)]
    names, info = self.captured.expected_names, self.captured.expected_input_info
    if any(isinstance(a, (list, tuple, dict)) for a in args) or names != [i for i, a in enumerate(args) if isinstance(a, Tensor)]: return None
    if lazy := [t for t in ts if not t.uop.is_realized]: Tensor.realize(*lazy)
    for t, (view, vs, dtype, device) in zip(ts, info):
      u = t.uop  # a buffer, which the capture recorded as NOOP, or a reshape of one, recorded as NOOP under the same reshape, or as
      # NOOP alone where the capture saw the whole buffer (tinygrad's preparation drops a reshape of a NOOP: the same memory, as the
      # JIT's key has fixed the shape): the errors and records that Dust's chunks take reshaped
      if u.op is Ops.RESHAPE and view.op is Ops.RESHAPE and view.src[1] is u.src[1]: u, view = u.src[0], view.src[0]
      while u.op is Ops.RESHAPE and view.op is Ops.NOOP: u = u.src[0]
      if not (u.op is Ops.BUFFER and view.op is Ops.NOOP and vs == () and t.dtype == dtype and t.device == device): return None
    bufs = [t.uop.base for t in ts]
    return bufs if len(set(bufs)) == len(bufs) else None

def apart(fn:Callable, *a, **kw):
  """fn(*a, **kw) and its results realized, with the lazy tensors that exist now out of tinygrad's sight. Realizing rewrites every
  live tensor that shares the realized nodes to read their new buffers, and UOps are hash-consed: a user's lazy forward on the same
  batch and weights *is* the graph that a Dust capture realizes. Inside a JIT's capture those buffers are the JIT's own, which its
  next replay writes again and `release` frees, so that tensor would read another batch's values or freed memory (tests/test_lazy.py).
  Out of sight, it stays lazy and computes its own values when it is realized. A pending assign is done first, outside: captured, it
  would be done again at every replay. A tensor that the capture assigns to must be realized before it, as its inputs are (the
  optimizers' state is). A TinyJit calls its function only to capture it (and at every call under JIT=0), so a replay pays nothing."""
  def live() -> list[Tensor]: return [t for ref in list(all_tensors) if (t := ref()) is not None]
  if pending := [t for t in live() if t.uop.base.op is Ops.AFTER]:
    with Context(CAPTURING=0): Tensor.realize(*pending)  # run now, not recorded into the capture
  hidden = [t for t in live() if not t.uop.is_realized]
  for t in hidden: del all_tensors[weakref.ref(t)]
  try:
    ret = fn(*a, **kw)
    if outs := get_parameters(ret): Tensor.realize(*outs)  # here, not in TinyJit after this returns: that realize would rewrite them too
    return ret
  finally:
    for t in hidden: all_tensors[weakref.ref(t)] = None

class Ahead:
  """A dry run of a step, to compile all its kernels in one batch. tinygrad 0.14 lowers and compiles a JIT's new kernels when it
  captures it, in its pool of workers, and runs the capture when they are done: a process's first step is a chain of ~40 batches,
  each as long as its slowest kernel, which leaves most workers idle. A capture only traces its function (its kernels run after it),
  so a JIT's capture doesn't need the values of the JITs before it. Here each JIT is traced as its capture would trace it, neither
  compiled nor run, and its new kernels go to the pool at once, which compiles them while the next JIT is traced; then the step
  runs for real, every kernel already compiled: the default command's cold first step on an H100 went from 36.96 to 15.33 s
  (docs/performance.md). A JIT called again in the dry run (another chunk) returns its first trace's outputs,
  and one captured before it returns its last outputs, neither running. What the dry run may not do, and a step doesn't:
  - read a value to decide what to do, or use one as an index: the outputs of the JITs are never written, so the code between them
    runs on garbage (for real, and again in the real run), and the dry run's results are dropped;
  - keep a tensor made inside a JIT: realized by the trace but never written. tinygrad's random numbers are one (their seed and
    counter, made at the first draw on a device), so their state is put back after the dry run."""
  def __init__(self, pool):
    self.seen:set[tuple] = set()          # the programs' keys (tinygrad's to_program_key), cached or not
    self.traced:dict[Jit, Any] = {}       # each JIT traced, and what its trace returned
    self.pool, self.jobs = pool, []

  def trace(self, j:Jit, args:tuple, kwargs:dict) -> Any:
    if j.captured is not None: return j.captured.ret
    if j in self.traced: return self.traced[j]
    if capturing: raise RuntimeError("a JIT inside another JIT's function: tinygrad captures one at a time")
    _prepare_jit_inputs(args, kwargs)  # its inputs realized, as a capture does
    j._linears = []
    capturing.append(j)
    try:
      self.traced[j] = ret = j.fxn(*args, **kwargs)
      calls = [c for lin in j._linears for c in UOp(Ops.LINEAR, src=lin.src).toposort() if c.op is Ops.CALL]
    finally:
      capturing.clear()
      del j._linears
    kernels = {to_program_key(*k): k for c in calls if (k := _get_call_to_compile(c)) is not None}
    ctx = {v.key: v.value for v in to_program_context}
    tasks = [(key, k, ctx) for key, k in kernels.items() if key not in self.seen and key not in tinygrad.engine.realize.to_program_cache]
    self.seen.update(kernels)
    if tasks: self.jobs.append(self.pool.map_async(_compile_kernel, tasks, chunksize=1))
    return ret

  def run(self, fn:Callable[[], Any]) -> set[tuple]:
    """fn dry, then its kernels' programs into tinygrad's cache; the programs' keys."""
    # tinygrad's random state, its counters copied: a draw outside a JIT advances them for real
    seed, seeds, counters = Tensor._seed, dict(Tensor._device_seeds), {d: c.clone().realize() for d, c in Tensor._device_rng_counters.items()}
    try:
      with Context(PARALLEL=0):  # what fn compiles outside its JITs, in the process: not behind the dry run's batches in the pool
        fn()
    finally:
      Tensor._seed = seed
      for now, before in ((Tensor._device_seeds, seeds), (Tensor._device_rng_counters, counters)): now.clear(); now.update(before)
    for job in self.jobs:
      for key, prg in job.get(): tinygrad.engine.realize.to_program_cache[key] = prg
    return self.seen

AHEAD:Ahead|None = None  # the dry run in progress

def free(captured:CapturedJit|None) -> None:
  """Free what a captured JIT writes of its own (its outputs, and its arenas where they are not the Scratch's) until its next replay,
  which allocates them again and rebuilds its graphs. tinygrad 0.14's free_intermediates frees the arenas but keeps each intermediate's
  view into them with its old address, and a replay then writes through those views into whatever owns that memory by then; so the
  views are deallocated first, and a replay derives them from the re-allocated buffer."""
  if captured is None: return
  shared = SCRATCH.arenas
  own = {x for u in captured._written_uops if u not in shared and (b := buffers.get(u)) is not None
         for x in (b.bufs if isinstance(b, MultiBuffer) else (b,))}
  if not own: return
  for view in [b for b in list(buffers.values()) if isinstance(b, Buffer) and b._base in own and b.is_initialized()]: view.deallocate()
  drop_graphs(captured)
  for b in own:
    if b.is_initialized(): b.deallocate()

# ***** the public surface *****

def flatten(v:Any, leaves:list) -> Any:
  """v's structure, with each tensor or bound Variable in it replaced by its number in `leaves`, where it is appended."""
  if isinstance(v, (Tensor, UOp)):
    leaves.append(v)
    return len(leaves) - 1
  if isinstance(v, (list, tuple)): return tuple(flatten(x, leaves) for x in v)
  if isinstance(v, dict): return {k: flatten(x, leaves) for k, x in v.items()}
  raise TypeError(f"a JIT input must be a tensor, a bound Variable or a container of them, not {type(v).__name__}: pass it as a keyword")

def rebuild(structure:Any, leaves:list) -> Any:
  if isinstance(structure, int): return leaves[structure]
  if isinstance(structure, tuple): return [rebuild(x, leaves) for x in structure]
  return {k: rebuild(x, leaves) for k, x in structure.items()}

def distinct(leaves:list) -> tuple[list, tuple[int, ...]]:
  """tinygrad's JIT takes each buffer once: each tensor once, and a view into a buffer that is already an input as a copy of its own
  (a repeated input, or two views of one buffer, raise "duplicate inputs to JIT"). The inputs, and each leaf's input number."""
  ins:dict[UOp, Any] = {}
  bases:set[UOp] = set()
  for t in leaves:
    if (k := t.uop if isinstance(t, Tensor) else t) not in ins:
      ins[k] = t.contiguous() if isinstance(t, Tensor) and k.base in bases else t
      if isinstance(t, Tensor): bases.add(k.base)
  at = {k: i for i, k in enumerate(ins)}
  return list(ins.values()), tuple(at[t.uop if isinstance(t, Tensor) else t] for t in leaves)

def signature(v:Tensor|UOp) -> Any:  # what a capture depends on in an input: a tensor's shape, dtype and device; a Variable's name
  return (v.shape, v.dtype, v.device) if isinstance(v, Tensor) else v.unbind()[0].expr

def frozen(structure:Any) -> Any:  # a structure as a hashable key
  if isinstance(structure, dict): return ("dict", tuple((k, frozen(x)) for k, x in structure.items()))
  return tuple(frozen(x) for x in structure) if isinstance(structure, tuple) else structure

_jits:dict[tuple, Jit] = {}

def live(v:Any) -> bool: return isinstance(v, (Tensor, UOp))  # a tensor or a bound Variable: data of the call, not of the code

class Function:
  """fn(owner, *inputs, **static) as one Jit per input signature (see `jit`). `release()` frees the last one's own buffers."""
  def __init__(self, fn:Callable, owner:Any, static:dict[str, Any]):
    self.fn, self.owner, self.last = fn, owner, None
    self.static = {k: v for k, v in static.items() if not live(v)}
    self.given = {k: v for k, v in static.items() if live(v)}  # keywords that are tensors: inputs of the JIT, as the positional ones

  def __call__(self, *inputs):
    # the inputs' tensors, once each, as the JIT's positional inputs: the replay of whole buffers is for those alone (Jit.whole_inputs)
    structure, ins, which = flatten((*inputs, self.given), leaves := []), *distinct(leaves)
    k = (self.fn, id(self.owner), frozen(structure), which, tuple(signature(t) for t in ins), tuple(sorted(self.static.items())))
    if (j := _jits.get(k)) is None:
      fn, owner, static = self.fn, self.owner, self.static
      def call(*ins) -> Any:
        *args, given = rebuild(structure, [ins[i] for i in which])
        return fn(*args, **static, **given) if owner is NOBODY else fn(owner, *args, **static, **given)
      j = _jits[k] = Jit(call)
    self.last = j
    return j(*ins)

  def release(self) -> None:
    """Free the buffers that the last JIT writes of its own (its outputs, its arenas outside the Scratch) until its next call. Under
    JIT=0 nothing is captured, and nothing of a call is kept."""
    if self.last is not None: free(self.last.captured)

NOBODY = object()  # jit's owner when fn has none

def jit(fn:Callable, owner:Any=NOBODY, /, **static) -> Function:
  """fn(owner, *inputs, **static), or fn(*inputs, **static) without an owner, captured as a TinyJit at its first call for each input
  signature and kept for the process; later calls replay its kernels. The owner is the object (a model, an optimizer) whose tensors
  fn reads without taking them as inputs: the JIT reads them where they are, so the owner must update them in place. Python values
  (a float, a string) are frozen into a capture as constants of its kernels, so they are passed as `static` keywords, which key the
  cache, as the owner's identity does (the JIT's closure keeps the owner alive, so its id is never reused): a float that changes at
  every call compiles new kernels at every call. A keyword that is a tensor or a bound Variable is an input like the positional ones,
  so a value that changes from call to call (a schedule's) is passed as a tensor. Inputs may be tensors, bound Variables, and lists and dicts of
  them, a tensor in several places or views of one buffer among them (`distinct`). Its outputs are the JIT's own buffers, which the
  next call writes again: copy what must outlive it. The capture runs `apart` from the lazy tensors that exist then."""
  return Function(fn, owner, static)

@functools.cache
def zo_sources() -> str:
  """zo's own code, hashed: a process after an edit runs the dry run again, as its kernels may have changed. A file it can't read
  (an editor's lock file) is left out: the hash decides only whether a dry run is worth its time."""
  h, root = hashlib.sha256(), pathlib.Path(__file__).parent
  for p in sorted([*root.glob("*.py"), *root.glob("kernels/*.py")]):
    with contextlib.suppress(OSError): h.update(p.read_bytes())
  return h.hexdigest()

def compile_ahead(fn:Callable[[], Any], what:str) -> None:
  """Compile the kernels of fn's JITs all at once, in tinygrad's pool, by a dry run of fn (Ahead): fn is a process's first step,
  whose JITs would otherwise each compile their kernels when they are captured, one batch after another. `what` names the work fn
  does (its shapes and settings): the keys of its programs are kept in tinygrad's cache db under that name and zo's code, and a
  process that finds them all in the cache (the name's row is keyed by tinygrad's settings too) skips the dry run, which costs about
  a third of a first step that compiles nothing. Nothing under JIT=0, where nothing is captured; under BEAM or JITBEAM, whose
  kernels tinygrad compiles as it times them; without a pool of workers (PARALLEL=0), where the kernels would compile one at a
  time either way; or inside another dry run."""
  global AHEAD
  if not JIT or BEAM or getenv("JITBEAM") or AHEAD is not None: return
  if (known := kept("zo_ahead", zo_sources(), what)) and all(key in tinygrad.engine.realize.to_program_cache for key in known): return
  if (pool := get_worker_pool()) is None: return  # asked for only now: a process whose kernels are all cached starts no workers
  AHEAD = Ahead(pool)
  try: keys = AHEAD.run(fn)
  finally: AHEAD = None
  keep("zo_ahead", keys, zo_sources(), what)

def freeze_compiled() -> None:
  """After a process's first step: what it has built to run a step (tinygrad's graphs, kernels and JITs: 1.2 million objects for the
  small preset's Dust) out of the sight of CPython's collector, whose full collections walk every object it tracks: one took 1.1 s on a
  2-core CPU, about one in 24 steps of that Dust run (NULL device). gc.freeze moves them to a generation it never walks."""
  gc.collect()
  gc.freeze()

def buffer_of(t:Tensor) -> Tensor:
  """t realized now, so that the graphs that read it hold a buffer in its place. tinygrad 0.14's schedule cache keys a graph
  by its structure with its buffers as parameters, two uses of one buffer being one parameter: a direction's key folded
  from scalar(k) in the graph of a forward that folds every parameter's from scalar(i) made a graph of its own for each
  k, as k equals a different i (the zoo's forwards, scheduled again for every direction: 2-6 s each on 2 cores)."""
  return t.contiguous().realize()

def iterated(fn:Callable[[Tensor], Tensor], x:Tensor, n:int) -> Tensor:
  """fn applied n times to x, each result realized: every iteration is then one graph, which tinygrad 0.14's schedule
  cache schedules once, where n iterations left lazy are one graph n times as large, scheduled whole at every call that
  realizes it (ZO-Muon's Newton-Schulz: 24 iterations of 2 kernels for each shape's P and each shape's G)."""
  for _ in range(n): x = buffer_of(fn(x))
  return x

def squares(tensors:list[Tensor]) -> Tensor:
  """[n]: each tensor's sum of squares in float32, each sum a kernel of its own: tinygrad fused the small preset's 46 sums into
  one kernel slow to lower and compile (the check's), and on CUDA into the kernels that read their total (ConMeZO's |m|)."""
  return Tensor.stack(*[t.float().square().sum().contiguous() for t in tensors])

def no_gradient(loss:Tensor, params:dict[str, Tensor]) -> list[str]:
  """The names of the parameters that loss has no gradient for: no path of ops with a gradient joins them to it (a
  comparison passes none, `where` none to its condition). tinygrad 0.14's Tensor.gradient returns such a parameter's as
  a constant zero, which is how they are told from a gradient that is computed; the gradients are only built: nothing
  runs."""
  return [n for n, g in zip(params, loss.gradient(*params.values())) if g.uop.base.op is Ops.CONST]

def backends() -> list[str]: return sorted(Device._devices)  # the backends tinygrad 0.14 knows (DEV's values), which it keeps private

def empty(*shape:int, dtype=dtypes.float32, device:str|None=None) -> Tensor:
  """An empty tensor with its memory, for a JIT to assign into, the caller's to keep: a JIT that assigns into a bare Tensor.empty it
  is handed leaves the result in memory that the next allocation reuses (tinygrad 0.14: the estimates came out as garbage)."""
  t = Tensor.empty(*shape, dtype=dtype, device=device)
  t.uop.buffer.ensure_allocated()
  return t

@functools.cache
def scalar(v:int|float, dtype:type[np.generic], device:str) -> Tensor:
  """v as data: a realized scalar on the device, made once, for kernels to read. A Python number in tensor code is compiled
  into each kernel as a constant, so kernels that differ only by it (a parameter's index in its noise's key, the sign of a
  perturbation) each compile their own; reading it, they are one kernel."""
  return tensor(np.array(v, dtype), device)

def tensor(a:np.ndarray, device:str|None=None) -> Tensor:
  """A realized tensor of a small array, written by the device's copy-in: Tensor(a).realize() schedules and runs a copy program at
  every call, 0.94 ms of host time on a 2-core CPU against 0.12 ms so (MeZO and ES upload a key at every step)."""
  t = empty(*a.shape, dtype=_from_np_dtype(a.dtype), device=device)
  buf = t.uop.buffer
  buf.allocator._copyin(buf._buf, memoryview(np.ascontiguousarray(a)).cast("B"))
  return t

def read(t:Tensor) -> np.ndarray:
  """A JIT's small output on the host, by the device's copy-out (a sync and a memcpy): Tensor.numpy() builds and runs a copy program at
  every call, 0.24 ms of host time on the H200's machine (a tenth of the small preset's backprop step) against 0.02 ms so."""
  assert t.uop.op is Ops.BUFFER, "a realized buffer, not a lazy tensor or a view of one"
  buf, out = t.uop.buffer, np.empty(t.shape, _to_np_dtype(t.dtype))
  buf.allocator._copyout(memoryview(out).cast("B"), buf._buf)
  return out

# bound at each call of a chunk's JIT: kernel arguments, not constants, so that every chunk (and every group and block of Dust's draws)
# runs the same compiled kernels. As constants they made each (group, block) compile its own: 224 s of compiling for a tiny model's
# first pop-64 Dust step on 2 CPU cores.
FIRST, START = Variable("first", 0, 1), Variable("start", 0, 1 << 24)

def index(start:UOp, n:int) -> Tensor: return Tensor(start) + Tensor.arange(n)  # the items start .. start + n - 1

def stacked(owner, start:UOp, *args, fn:Callable, per_call:int, offset:int, **static) -> None:
  *inputs, out = args
  rows = fn(owner, index(start, per_call) + offset, *inputs, **static)
  out.shrink(((start, start + per_call),) + ((None,) * (out.ndim - 1))).assign(rows).realize()

def stack(fn:Callable, owner, /, *inputs, items:range, per_call:int, shape:tuple[int, ...], **static) -> Tensor:
  """[len(items), *shape]: fn(owner, index, *inputs, **static) -> [per_call, *shape] for the items' chunks (index: per_call item numbers,
  an int tensor), stacked. One JIT for every chunk, its start a bound Variable, writing its rows of a buffer of this call's own."""
  device = next(t.device for t in inputs if isinstance(t, Tensor))
  out = empty(len(items), *shape, device=device)
  f = jit(stacked, owner, fn=fn, per_call=per_call, offset=items.start, **static)
  for start in range(0, len(items), per_call): f(START.bind(start), *inputs, out)
  return out

def adding(owner, start:UOp, first:UOp, *args, fn:Callable, per_call:int, **static) -> None:
  *inputs, sums = args
  keep = Tensor(first).cast(dtypes.bool).logical_not()  # where(): the last call's sums are never multiplied, so nothing of them stays
  Tensor.realize(*[s.assign(keep.where(s, 0.0) + d) for s, d in zip(sums, fn(owner, index(start, per_call), *inputs, **static))])

_sums:dict[tuple, list[Tensor]] = {}

def summed(fn:Callable, owner, /, *inputs, chunks:range, per_call:int, shapes:list[tuple[int, ...]], **static) -> list[Tensor]:
  """Σ over the chunks of fn(owner, index, *inputs, **static), a list of sums of the given shapes over the chunks `index` (per_call
  chunk numbers, an int tensor): one JIT for every call, its first chunk and whether it is the first call bound Variables, adding
  into buffers that the next call with the same function and the same bound Variables among the inputs writes again: copy what must
  outlive it. New buffers at every call cost a step's worth of sums more memory, as each JIT's graph holds its last call's inputs
  until its next call (a peak 25% higher for Dust at pop 1024, docs/performance.md)."""
  flatten(inputs, leaves := [])
  device = next(t.device for t in leaves if isinstance(t, Tensor))
  where = tuple(v.unbind() for v in leaves if isinstance(v, UOp))
  k = (fn, id(owner), device, tuple(map(tuple, shapes)), per_call, tuple(sorted((n, v) for n, v in static.items() if not live(v))), where)
  if (sums := _sums.get(k)) is None: sums = _sums[k] = [empty(*s, device=device) for s in shapes]
  f = jit(adding, owner, fn=fn, per_call=per_call, **static)
  for i, start in enumerate(range(chunks.start, chunks.stop, per_call)): f(START.bind(start), FIRST.bind(int(i == 0)), *inputs, sums)
  return sums

def per_call(n:int, tokens:int, most:int) -> int:
  """How many of n equal pieces of `tokens` tokens one JIT call runs: the most that divide n (so every call has one shape, one JIT)
  and hold at most `most` tokens together, at least one."""
  return max(c for c in range(1, max(1, min(n, most // tokens)) + 1) if n % c == 0)  # up to the most that fit, not to n (a pop of 1e9)

def by_shape(fn:Callable[[Tensor], Tensor], tensors:dict[str, Tensor]) -> dict[str, Tensor]:
  """fn of each tensor, the tensors of one shape stacked into one batch (fn treats the first axis as one): each of fn's
  kernels launches once a shape, not once a tensor (ZO-Muon's Newton-Schulz, 24 iterations of small matmuls per matrix:
  14,182 kernels a step at the small preset and pop 4, 2,087 stacked). Three things keep the kernels shared by a shape's
  tensors, and few:
  - each tensor is made by a kernel of its own before the stack: a stack of lazy tensors was one kernel computing them
    all (ZO-Muon's G of every matrix of a shape, each a sum over the K directions: minutes to compile at pop 16);
  - the batch's result is realized (buffer_of), so the graphs that read it are the same at every call of fn;
  - each tensor's result is taken from it by its index as data (tinygrad's gather: the items masked by index == i and
    summed, exact). A slice would compile its offset into every kernel that reads it, a kernel per tensor (ZO-Muon's Ψ_k
    and perturbed weights: 16 variants of one kernel on the tiny model); a view of the realized batch (no kernel) is not
    followed by a JIT's memory plan (tinygrad 0.14: the capture's estimates came out wrong)."""
  shapes:dict[tuple, list[str]] = {}
  for n, t in tensors.items(): shapes.setdefault(t.shape, []).append(n)
  out = {}
  for names in shapes.values():
    y = buffer_of(fn(Tensor.stack(*[tensors[n].contiguous() for n in names])))
    out |= {n: y[scalar(i, np.int32, y.device)] for i, n in enumerate(names)}
  return {n: out[n] for n in tensors}
