"""Tests of engine.py, the one module that uses tinygrad's internals: that no other file does, and that its workarounds hold. JITs
share one arena, replays take whole buffers, `jit` takes containers and repeated inputs, and `stack` and `summed` give what one call
would, whatever the chunks a call."""
import ast, json, os, pathlib, subprocess, sys
import numpy as np
import pytest
from tinygrad import Tensor, Variable, dtypes
from tinygrad.engine.jit import JitError
from tinygrad.uop.ops import Ops, UOp
import engine

ROOT = pathlib.Path(__file__).resolve().parent.parent

# ***** the layers *****

# the algorithm layer: tinygrad's public API only (its top-level names and tinygrad.nn)
ALGORITHM = ("model.py", "registry.py", "estimators.py", "dust.py", "recipes.py", "optim.py", "zo.py", "rundir.py", "flags.py", "sampling.py",
             "cosine.py", "devices.py", "data.py", "plot.py")
PUBLIC = {"Tensor", "TinyJit", "nn", "dtypes", "Device", "Context", "getenv", "Variable", "GlobalCounters"}
# tinygrad's internals that engine.py works around: no file but engine.py may name them
INTERNALS = {"all_tensors", "buffers", "graph_cache", "CapturedJit", "unique_num", "allocator", "captured", "Buffer", "MultiBuffer",
             "ensure_allocated", "schedule_linear", "to_program_cache", "do_to_program", "diskcache_get", "diskcache_put", "capturing",
             "to_program_key", "to_program_context", "get_worker_pool", "schedule_cache", "get_kernel_graph", "contiguous_view"}

def private_uses(path:pathlib.Path, algorithm:bool) -> list[str]:
  """Each use of a private tinygrad name in a file: an import of a name that starts with _ or is an internal, an attribute that starts
  with _ (outside its own class's self) or is an internal; in the algorithm layer also any import but the public names, and .uop."""
  bad = []
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tinygrad"):
      for a in node.names:
        if a.name.startswith("_") or a.name in INTERNALS: bad.append(f"imports {a.name}")
        elif algorithm and not (node.module == "tinygrad" and a.name in PUBLIC or node.module.startswith("tinygrad.nn")):
          bad.append(f"imports {node.module}.{a.name}")
    if isinstance(node, ast.Import) and algorithm:
      bad += [f"imports {a.name}" for a in node.names if a.name.startswith("tinygrad") and not a.name.startswith("tinygrad.nn")]
    if isinstance(node, ast.Attribute):
      own = isinstance(node.value, ast.Name) and node.value.id in ("self", "cls", "os")  # os._exit is the standard library's
      if (node.attr.startswith("_") and not node.attr.startswith("__") and not own) or node.attr in INTERNALS or \
         (algorithm and node.attr == "uop"):
        bad.append(f"line {node.lineno}: .{node.attr}")
  return bad

def test_only_engine_touches_tinygrad_internals():
  # a private tinygrad name anywhere but engine.py, or a non-public one in the algorithm layer, is listed here (tests may use them)
  files = [p for p in ROOT.glob("*.py") if p.name != "engine.py"] + sorted(ROOT.glob("kernels/*.py"))
  assert {p.name for p in files} >= set(ALGORITHM)
  found = {str(p.relative_to(ROOT)): bad for p in files if (bad := private_uses(p, p.name in ALGORITHM))}
  assert not found, found

def test_the_check_sees_private_names(tmp_path):
  # the check itself must flag what it is for: a copy of model.py with one private name added
  src = (ROOT / "model.py").read_text()
  for added in ("from tinygrad.tensor import all_tensors\n", "from tinygrad.uop.ops import UOp\n", "x = Tensor.empty(1).uop\n",
                "y = Tensor.empty(1)._buf\n"):
    (p := tmp_path / "model.py").write_text(added + src)
    assert private_uses(p, True), added
  assert private_uses(ROOT / "engine.py", False)  # engine.py does use them

# ***** kernels lowered and graphs scheduled once across processes (engine.LoweredOnDisk, engine.ScheduledOnDisk) *****

LOWER = """import json, engine, tinygrad.codegen as codegen, tinygrad.engine.realize as realize, tinygrad.schedule as schedule
from tinygrad import Device, Tensor
Device[Device.DEFAULT]  # a device lowers its own programs as it opens, in every process: not counted
lowered, sent, scheduled, do, send, graph = [], [], [], codegen.do_to_program, realize._compile_kernel, schedule.get_kernel_graph
codegen.do_to_program = lambda ast, renderer: lowered.append(ast) or do(ast, renderer)
realize._compile_kernel = lambda task: sent.append(task) or send(task)  # what lower_and_compile finds missing (else: the worker pool)
schedule.get_kernel_graph = lambda sink: scheduled.append(sink) or graph(sink)  # a graph that the schedule cache doesn't hold
values = ((Tensor.arange(64).reshape(8, 8).float() / 9).exp() @ Tensor.ones(8, 8)).sum(1).tolist()
print(json.dumps({"lowered": len(lowered), "sent": len(sent), "scheduled": len(scheduled), "values": values}))"""

@pytest.mark.skipif(engine.tinygrad_version() is None, reason="a tinygrad without a version keeps no lowered kernels on disk")
def test_lowered_kernels_kept_across_processes(tmp_path):
  # a second process with the same cache db finds every kernel that the first lowered (it neither lowers it nor sends it to be
  # lowered) and every graph that it scheduled, and computes the same numbers; without LoweredOnDisk it lowers them all again
  # (PARALLEL=0: every kernel is lowered in the process, where it is counted), without ScheduledOnDisk it schedules them again. A
  # process with another tinygrad setting (THREADS: not in tinygrad's own keys) lowers and schedules again.
  env = {k: v for k, v in os.environ.items() if k not in ("CACHELEVEL", "CCACHE", "THREADS")}
  env.update(CACHEDB=str(tmp_path / "cache.db"), PARALLEL="0")
  runs = [subprocess.run([sys.executable, "-c", LOWER], cwd=ROOT, env=e, capture_output=True, text=True, timeout=300)
          for e in (env, env, {**env, "THREADS": "1"})]
  assert all(r.returncode == 0 for r in runs), runs[-1].stderr[-2000:]
  first, second, other = [json.loads(r.stdout.splitlines()[-1]) for r in runs]
  assert first["lowered"] == first["sent"] > 0 and second["lowered"] == second["sent"] == 0, (first, second)
  assert first["scheduled"] > 0 and second["scheduled"] == 0, (first, second)
  assert other["lowered"] == first["lowered"] and other["scheduled"] == first["scheduled"], other
  assert second["values"] == first["values"] == other["values"]

@pytest.mark.skipif(engine.tinygrad_version() is None, reason="a tinygrad without a version keeps no schedules on disk")
def test_schedule_holding_a_buffer_stays_in_memory():
  # a schedule of parameters and placeholders goes to the cache db; one that holds a buffer of this process (its data would reach
  # another process that meets the same key) is kept in memory only
  cache, keys = engine.ScheduledOnDisk(), [os.urandom(32) for _ in range(2)]
  own = Tensor([1.0, 2.0]).realize().uop.base
  free = UOp.param(0, dtypes.float, (2,), device=own.device)
  assert own.op is Ops.BUFFER and free.op is Ops.PARAM, (own.op, free.op)
  cache[keys[0]], cache[keys[1]] = own.sink(), free.sink()
  assert cache.get(keys[0]) is own.sink() and engine.kept("zo_scheduled", keys[0]) is None
  assert engine.kept("zo_scheduled", keys[1]) is free.sink()

# ***** a first step's kernels compiled ahead (engine.compile_ahead) *****

AHEAD = """import json, numpy as np, engine, tinygrad.engine.realize as realize
from tinygrad import Device, Tensor
Device[Device.DEFAULT]
cache, added = realize.to_program_cache, []
put = type(cache).__setitem__  # each program compiled and put in tinygrad's cache, by the process or from its pool of workers
type(cache).__setitem__ = lambda self, key, prg: added.append(key) or put(self, key, prg)
Tensor.manual_seed(1)
Tensor.rand(2).realize()  # drawn before the dry run
x, state = Tensor(np.arange(64, dtype=np.float32).reshape(8, 8)).realize(), {"count": Tensor(np.zeros(1, np.float32)).realize()}
f = engine.jit(lambda x: ((x / 9).exp() @ (x.T + 1)).contiguous())
g = engine.jit(lambda a: (a.sum(1) * 2 + 1).contiguous())
bump = engine.jit(lambda s, x: s["count"].assign(s["count"] + x[0, 1]).realize(), state)  # a JIT that changes state, as an update does
noisy = engine.jit(lambda x: (x[0] + Tensor.rand(8)).contiguous())  # tinygrad's random numbers, first drawn in a JIT
def step():
  bump(x)
  bump(x)  # called again, as a chunk's JIT is
  return g(f(x)), noisy(x), Tensor.rand(3).realize()  # and drawn outside a JIT
dry = []
engine.compile_ahead(lambda: dry.append(1) or step(), "two JITs, an update and random numbers")
ahead, captured = len(added), f.last is not None and f.last.captured is not None
values, noise, drawn = (t.tolist() for t in step())
print(json.dumps({"dry": len(dry), "ahead": ahead, "after": len(added) - ahead, "captured": captured, "values": values,
                  "count": state["count"].tolist(), "noise": noise + drawn}))"""

@pytest.mark.skipif(engine.tinygrad_version() is None, reason="a tinygrad without a version keeps no lowered kernels on disk")
def test_compile_ahead(tmp_path):
  # a fresh cache: the dry run has the pool compile the JITs' kernels and captures, runs and changes nothing; the step then compiles
  # none and computes what it would have without it. A second process on that cache skips the dry run (its programs are all there)
  # and draws the same random numbers as the first: before the dry run, in a JIT and outside one.
  env = {k: v for k, v in os.environ.items() if k not in ("CACHELEVEL", "CCACHE", "BEAM", "JITBEAM", "JIT")}
  env.update(CACHEDB=str(tmp_path / "cache.db"), PARALLEL="2")
  runs = [subprocess.run([sys.executable, "-c", AHEAD], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300) for _ in range(2)]
  assert all(r.returncode == 0 for r in runs), runs[-1].stderr[-2000:]
  first, second = [json.loads(r.stdout.splitlines()[-1]) for r in runs]
  assert first["dry"] == 1 and first["ahead"] > 0 and first["after"] == 0 and not first["captured"], first
  assert second["dry"] == second["ahead"] == second["after"] == 0, second
  x = np.arange(64, dtype=np.float32).reshape(8, 8)
  want = ((np.exp(x / 9) @ (x.T + 1)).sum(1) * 2 + 1).tolist()
  for run in (first, second):
    np.testing.assert_allclose(run["values"], want, rtol=1e-5)
    assert run["count"] == [2.0], run  # the update ran twice, in the step: not in the dry run
  assert first["noise"] == second["noise"], (first, second)

# ***** JITs sharing one arena (engine.Scratch) *****

def _doubled(x:Tensor) -> Tensor: return ((x + 1).contiguous() * 2).contiguous().sum(1)
def _mixed(x:Tensor) -> Tensor: return ((x * 3).contiguous().exp().contiguous() + (x - 1).contiguous()).max(0)

def test_jits_share_one_arena():
  """Two JITs with intermediates of different sizes, called in turn on new inputs: each result stays right (an output or an input
  in the shared arena would be overwritten by the other JIT's scratch), and their plans are views of one arena per device, as large
  as the larger plan, not the sum."""
  rng = np.random.default_rng(0)
  f, g = engine.jit(_doubled), engine.jit(_mixed)
  for _ in range(4):
    a, b = rng.standard_normal((64, 256)).astype(np.float32), rng.standard_normal((128, 512)).astype(np.float32)
    fa = f(Tensor(a))
    gb = g(Tensor(b)).numpy()  # g's scratch is written after f's output
    np.testing.assert_allclose(fa.numpy(), ((a + 1) * 2).sum(1), rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(gb, (np.exp(3 * b) + b - 1).max(0), rtol=1e-5)
  mine = [offs for j in (f, g) for c, offs in engine.SCRATCH.users if c is j.last.captured]
  assert len(mine) == 2 and all(len(o) == 1 for o in mine)
  (fu, _), (gu, _) = mine[0][0], mine[1][0]
  base = engine.SCRATCH.base[fu.device]
  assert fu.buffer.base is base and gu.buffer.base is base
  assert mine[0][0][1] == mine[1][0][1] == 0 and base.nbytes >= max(fu.nbytes(), gu.nbytes())  # one memory, not one after the other

def test_views_kept(monkeypatch):
  """A view's place in its buffer is tinygrad's answer, found by one graph rewrite for each view (engine.contiguous_view: tinygrad
  rewrites again at every use, and Scratch has every JIT's views derived again whenever an arena moves), and kept no longer than the
  view's UOp."""
  import gc
  import tinygrad.uop.ops as ops
  t = Tensor.empty(64, 16).realize()
  v = t[8:16].uop
  assert v.contiguous_view() == engine._contiguous_view(v) == (t.uop.base, 128)
  rewrites, rewrite = [], ops.graph_rewrite
  monkeypatch.setattr(ops, "graph_rewrite", lambda *a, **kw: rewrites.append(1) or rewrite(*a, **kw))
  assert v.contiguous_view()[1] == 128 and not rewrites
  assert t[16:24].uop.contiguous_view()[1] == 256 and rewrites  # a new view is rewritten
  n = len(engine.views)
  del v
  gc.collect()
  assert len(engine.views) < n

def _shifted(x:Tensor, y:Tensor, s:Tensor, at) -> Tensor: return ((x - y) * s + Tensor(at).float()).contiguous()

def test_jit_replays_whole_inputs(monkeypatch):
  """A replay whose inputs are whole buffers (realized, arrays not yet copied in, or reshapes of a realized buffer, as Dust's chunks
  take their records) skips tinygrad's preparation of them, and still reads each input from its own buffer, with the bound variable's
  value; a view, a new shape or a repeated input goes through tinygrad's, which refuses them."""
  from tinygrad.engine import jit as tinyjit
  prepared, prepare = [], tinyjit._prepare_jit_inputs
  monkeypatch.setattr(tinyjit, "_prepare_jit_inputs", lambda *a: prepared.append(1) or prepare(*a))
  AT, rng = Variable("at", 0, 9), np.random.default_rng(0)
  f = engine.Jit(_shifted)
  def flat(a:np.ndarray) -> Tensor: return Tensor(a.reshape(-1)).realize().reshape(2, -1).reshape(a.shape)  # a reshape of a reshape
  for i in range(6):
    a, b, s = (rng.standard_normal(shape).astype(np.float32) for shape in ((4, 8), (4, 8), (8,)))
    xs = [(Tensor(a), Tensor(b), Tensor(s)), (Tensor(a).realize(), Tensor(b).realize(), Tensor(s).realize()), (flat(a), flat(b), Tensor(s))][i % 3]
    np.testing.assert_allclose(f(*xs, AT.bind(i)).numpy(), (a - b) * s + i, rtol=1e-6)
  assert len(prepared) == 1  # the capture's
  x, big = Tensor(a).realize(), Tensor(np.concatenate([b, b])).realize()
  for bad in ((x, big[4:]), (x, Tensor(np.zeros((8, 4), np.float32))), (x, x)):  # a view of a buffer, another shape, one input twice
    with pytest.raises(JitError): f(*bad, Tensor(s), AT.bind(1))
  assert len(prepared) == 4

def _combined(xs:dict[str, Tensor], ys:list[Tensor], w:float) -> Tensor: return (xs["a"] * w + xs["b"] - ys[0] * ys[1]).contiguous()

def test_jit_takes_containers_repeats_and_views():
  """engine.jit flattens dicts and lists into the JIT's inputs, takes a tensor given twice and two views of one buffer (tinygrad's JIT
  refuses both), and captures again for a new shape or static value; every call reads the inputs it is given."""
  rng = np.random.default_rng(1)
  for n in (4, 4, 6, 6):
    for w in (1.0, 2.0):
      a, b = rng.standard_normal((2, n)).astype(np.float32)
      ta, both = Tensor(a).realize(), Tensor(np.stack([a, b])).realize()
      out = engine.jit(_combined, w=w)({"a": ta, "b": both[1]}, [ta, both[0]]).numpy()  # a twice; b and a as views of one buffer
      np.testing.assert_allclose(out, a * w + b - a * a, rtol=1e-6)

# ***** stack and summed: one JIT over chunks *****

def _rows(owner, k:Tensor, x:Tensor) -> Tensor: return Tensor.stack(x.sum() * k.float(), k.float() ** 2, dim=1)
def _sums(owner, c:Tensor, x:Tensor, scale:float) -> list[Tensor]:
  return [(x.unsqueeze(0) * c.float().unsqueeze(1)).sum(0) * scale, (c.float() ** 2).sum().reshape(1)]

@pytest.mark.parametrize("per_call", [1, 2, 6])
def test_stack_and_summed_whatever_the_chunks(per_call:int):
  # a chunk's rows written in another chunk's place, a chunk lost or counted twice, or a sum not reset by the first call changes these
  x = Tensor(np.arange(3, dtype=np.float32)).realize()
  rows = engine.stack(_rows, None, x, items=range(2, 8), per_call=per_call, shape=(2,)).numpy()
  np.testing.assert_array_equal(rows, np.stack([3.0 * np.arange(2, 8), np.arange(2, 8) ** 2], axis=1))
  for _ in range(2):  # the second call's sums start from zero again
    m, sq = engine.summed(_sums, None, x, chunks=range(1, 7), per_call=per_call, shapes=[(3,), (1,)], scale=2.0)
    np.testing.assert_allclose(m.numpy(), 2.0 * np.arange(3) * np.arange(1, 7).sum(), rtol=1e-6)
    np.testing.assert_allclose(sq.numpy(), [(np.arange(1, 7) ** 2).sum()], rtol=1e-6)

def test_by_shape():
  # fn over same-shape tensors stacked is fn of each: a per-matrix normalisation (it must not mix the stacked matrices), the tensors
  # back under their own names in their order, each from one call of fn per shape
  rng = np.random.default_rng(0)
  ts = {n: rng.standard_normal(s).astype(np.float32) for n, s in (("a", (3, 4)), ("b", (5,)), ("c", (3, 4)), ("d", (3, 4)))}
  calls = []
  def fn(X:Tensor) -> Tensor:
    calls.append(X.shape)
    return X / X.square().sum(-1, keepdim=True).sqrt()
  out = engine.by_shape(fn, {n: Tensor(t) for n, t in ts.items()})
  assert list(out) == list(ts) and sorted(calls) == [(1, 5), (3, 3, 4)], calls
  for n, t in ts.items(): np.testing.assert_allclose(out[n].numpy(), t / np.sqrt((t ** 2).sum(-1, keepdims=True)), rtol=1e-5, err_msg=n)
