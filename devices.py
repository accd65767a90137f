"""Several devices in one process (`--devices N`): a step's population split over N devices of one backend.

A zeroth-order step communicates almost nothing: each device evaluates its share of the draws on its own copy of the
parameters, and only the per-draw losses come back. tinygrad 0.14 names the devices of a backend DEV, DEV:1, ... ("CPU",
"CPU:1"; on the CPU any index opens), moves a tensor with `.to(device)`, and refuses an op that mixes buffers of two
devices. Device-free constants (`Tensor.arange`, a Python scalar) take the device of the buffers they meet, so a forward
only needs the model's own tensors on the device: that is what a replica is.
"""
from __future__ import annotations
import copy
from typing import Any, Callable
from tinygrad import Device, Tensor, Variable, dtypes
from kernels import batches_chunks
from kernels.noise import fold
from model import GPT
import engine

def names(device:str, n:int) -> list[str]:
  """`device` and the n - 1 devices of its backend after it: names("CPU", 3) == ["CPU", "CPU:1", "CPU:2"]."""
  base, _, first = device.partition(":")
  return [Device.canonicalize(f"{base}:{int(first or 0) + i}") for i in range(n)]

def device(model:GPT) -> str: return next(iter(model.params.values())).device

def shares(total:int, n:int) -> list[range]:
  """Draws 0..total-1 in n contiguous blocks whose sizes differ by at most one: draw j keeps its key (folded from j)
  whatever n is, so the devices draw distinct keys and together exactly those of one device."""
  cut = [total * i // n for i in range(n + 1)]
  return [range(a, b) for a, b in zip(cut, cut[1:])]

def on(dev:str, v:Any) -> Any:  # a tensor or a dict of them on dev, anything else as it is
  if isinstance(v, Tensor): return v.to(dev).contiguous().realize()
  return {k: on(dev, t) for k, t in v.items()} if isinstance(v, dict) else v

def replica(model:GPT, dev:str) -> GPT:
  r = copy.copy(model)
  r.__dict__.update({a: on(dev, v) for a, v in vars(model).items()})
  return r

_replicas:dict[tuple[int, int], list[GPT]] = {}
def replicas(model:GPT, n:int) -> list[GPT]:
  """The model on n devices: [model, a copy on DEV:1, ..., DEV:n-1]. A copy shares everything with the model but its
  tensors (parameters, RoPE tables), which live on its device. The copies are made once per (model, n) and kept, so
  their buffers, and the JITs captured on them, stay valid; every call copies the model's current parameters into them,
  so a step sees the weights that the last update wrote. That copy is the only parameter traffic, and the update itself
  stays on the model's device."""
  if n == 1: return [model]
  if (k := (id(model), n)) not in _replicas:  # the cache holds the model, so its id is never reused
    _replicas[k] = [model] + [replica(model, dev) for dev in names(device(model), n)[1:]]
  reps = _replicas[k]
  Tensor.realize(*[r.params[p].assign(t.to(device(r))) for r in reps[1:] for p, t in model.params.items()])
  return reps

def inputs(model:GPT, *ts:Tensor) -> tuple[Tensor, ...]:
  """The tensors on the model's device, realized (JIT inputs). Move every device's inputs before launching any device's
  work: a copy out of a device waits for the work already queued on it."""
  return tuple(t.to(device(model)).realize() for t in ts)

def spread(model:GPT, n:int, total:int, run:Callable[..., Tensor], *ts:Tensor) -> Tensor:
  """run(replica, draws, *ts) on each of n devices for its share of the draws 0..total-1, the results concatenated on
  the model's device. Every input is copied before any work is launched, and nothing is read before all of it is, so the
  devices work at once where the backend runs kernels asynchronously (a GPU; tinygrad's CPU runs each kernel in the
  calling thread)."""
  reps = replicas(model, n)
  ins = [inputs(m, *ts) for m in reps]
  parts = [run(m, js, *i).to(device(model)) for m, js, i in zip(reps, shares(total, n), ins)]
  return parts[0] if n == 1 else Tensor.cat(*parts)  # one part is the result itself, not a lazy copy of it

# ***** sums over many draws, in chunks, on several devices *****

# A JIT call of chunks holds at most this many tokens on a GPU: one chunk of the dust preset's (8 draws of 8 x 2048
# tokens), and 8 of the small preset's, where one a call cost more host time than its kernels. One chunk a call on the
# CPU, which has no launches.
CALL_TOKENS = 131072
# the draws' address in the key tree and fn's integer keywords, bound at each call: kernel arguments, not constants, so
# that every address and value runs the same compiled kernels (as constants, a tiny model's first step compiled for
# minutes)
PATH = tuple(Variable(f"path{i}", 0, 1 << 16) for i in range(2))
def integer(name:str) -> Any: return Variable(f"int_{name}", 0, 1 << 24)

def chunks_per_call(runs:int, tokens:int, device:str) -> int:
  """How many of a device's `runs` runs of chunks, of `tokens` tokens each, one JIT call takes (engine.per_call)."""
  return engine.per_call(runs, tokens, CALL_TOKENS if batches_chunks(device) else 0)

def last_call_start(chunks:int, tokens:int, device:str, devices:int, run:int=1) -> int:
  """The first chunk of the last call of `sum_draws` on the last device: engine.START must number it."""
  return chunks - chunks_per_call(len(shares(chunks // run, devices)[-1]), tokens, device) * run

def keyed(owner, c:Tensor, key:Tensor, path:list, ints:dict[str, Any], *inputs, draws:Callable, run:int|None,
          **static) -> list[Tensor]:
  keys = fold(key, *[Tensor(p) for p in path], c.cast(dtypes.uint32))
  return draws(owner, keys if run is None else keys.reshape(-1, run, 2), *inputs,
               **{n: Tensor(v) for n, v in ints.items()}, **static)

def sum_draws(fn:Callable[..., list[Tensor]], work:list[tuple[Any, Tensor, tuple]], /, *, path:tuple[int, ...],
              chunks:int, tokens:int, shapes:list[tuple[int, ...]], ints:dict[str, int]|None=None, run:int|None=None,
              **static) -> list[Tensor]:
  """fn(owner, keys, *inputs, **ints, **static) over chunks 0 .. chunks-1 of draws: the sum of its outputs (tensors of
  `shapes`), on the first device. Chunk c's key is fold(key, *path, c); fn gets the keys of the chunks a call runs, [G,
  2], or [G, run, 2] in runs of `run` chunks (a run is never split). `work` has one (owner, key, inputs) per device:
  each device sums its share of the runs (devices.shares), so the keys and the sum don't depend on the number of
  devices. A call takes as many runs of `tokens` tokens as fit CALL_TOKENS (one on the CPU), in JITs of one shape:
  `path`, `ints` (fn's integer keywords, which it gets as tensors) and the first chunk of a call are bound Variables, so
  every chunk, path and value replays the same kernels. Every device's work is launched before any result is read."""
  dev, parts, r = work[0][1].device, [], run or 1
  for (owner, key, inputs), share in zip(work, shares(chunks // r, len(work))):
    if not len(share): continue
    G = chunks_per_call(len(share), tokens, key.device) * r
    bound = {n: integer(n).bind(v) for n, v in (ints or {}).items()}
    parts.append(engine.summed(keyed, owner, key, [v.bind(p) for v, p in zip(PATH, path)], bound, *inputs,
                               shapes=shapes, chunks=range(share.start * r, share.stop * r), per_call=G, draws=fn,
                               run=run, **static))
  # one part is the sum itself, not a lazy copy of it; it may be the last device's, where a group has fewer runs than
  # devices
  return ([t.to(dev) for t in parts[0]] if len(parts) == 1 else
          [sum(p[i].to(dev) for p in parts) for i in range(len(shapes))])
