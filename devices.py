"""Several devices in one process (`--devices N`): a step's population split over N devices of one backend.

A zeroth-order step communicates almost nothing: each device evaluates its share of the draws on its own copy of the
parameters, and only the per-draw losses come back. tinygrad 0.14 names the devices of a backend DEV, DEV:1, ... ("CPU",
"CPU:1"; on the CPU any index opens), moves a tensor with `.to(device)`, and refuses an op that mixes buffers of two devices.
Device-free constants (`Tensor.arange`, a Python scalar) take the device of the buffers they meet, so a forward only needs the
model's own tensors on the device: that is what a replica is.
"""
from __future__ import annotations
import copy
from typing import Any, Callable
from tinygrad import Device, Tensor
from model import GPT

def names(device:str, n:int) -> list[str]:
  """`device` and the n - 1 devices of its backend after it: names("CPU", 3) == ["CPU", "CPU:1", "CPU:2"]."""
  base, _, first = device.partition(":")
  return [Device.canonicalize(f"{base}:{int(first or 0) + i}") for i in range(n)]

def device(model:GPT) -> str: return next(iter(model.params.values())).device

def shares(total:int, n:int) -> list[range]:
  """Draws 0..total-1 in n contiguous blocks whose sizes differ by at most one: draw j keeps its key (folded from j) whatever n
  is, so the devices draw distinct keys and together exactly those of one device."""
  cut = [total * i // n for i in range(n + 1)]
  return [range(a, b) for a, b in zip(cut, cut[1:])]

def moved(v:Any, dev:str) -> Any:  # a tensor or a dict of them on dev, anything else as it is
  if isinstance(v, Tensor): return v.to(dev).contiguous().realize()
  return {k: moved(t, dev) for k, t in v.items()} if isinstance(v, dict) else v

def replica(model:GPT, dev:str) -> GPT:
  r = copy.copy(model)
  r.__dict__.update({a: moved(v, dev) for a, v in vars(model).items()})
  return r

_replicas:dict[tuple[int, int], list[GPT]] = {}
def replicas(model:GPT, n:int) -> list[GPT]:
  """The model on n devices: [model, a copy on DEV:1, ..., DEV:n-1]. A copy shares everything with the model but its tensors
  (parameters, RoPE tables), which live on its device. The copies are made once per (model, n) and kept, so their buffers, and the
  JITs captured on them, stay valid; every call copies the model's current parameters into them, so a step sees the weights that
  the last update wrote. That copy is the only parameter traffic, and the update itself stays on the model's device."""
  if n == 1: return [model]
  if (k := (id(model), n)) not in _replicas:  # the cache holds the model, so its id is never reused
    _replicas[k] = [model] + [replica(model, dev) for dev in names(device(model), n)[1:]]
  reps = _replicas[k]
  Tensor.realize(*[r.params[p].assign(t.to(device(r))) for r in reps[1:] for p, t in model.params.items()])
  return reps

def inputs(model:GPT, *ts:Tensor) -> tuple[Tensor, ...]:
  """The tensors on the model's device, realized (JIT inputs). Move every device's inputs before launching any device's work: a
  copy out of a device waits for the work already queued on it."""
  return tuple(t.to(device(model)).realize() for t in ts)

def spread(model:GPT, n:int, total:int, run:Callable[..., Tensor], *ts:Tensor) -> Tensor:
  """run(replica, draws, *ts) on each of n devices for its share of the draws 0..total-1, the results concatenated on the model's
  device. Every input is copied before any work is launched, and nothing is read before all of it is, so the devices work at once
  where the backend runs kernels asynchronously (a GPU; tinygrad's CPU runs each kernel in the calling thread)."""
  reps = replicas(model, n)
  ins = [inputs(m, *ts) for m in reps]
  parts = [run(m, js, *i).to(device(model)) for m, js, i in zip(reps, shares(total, n), ins)]
  return parts[0] if n == 1 else Tensor.cat(*parts)  # one part is the result itself, not a lazy copy of it
