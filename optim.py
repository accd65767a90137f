"""The optimizer: tinygrad's SGD with momentum or AdamW over groups of parameters by learning rate, and momentum
replayed from seeds.

An update is one engine.jit function per kind of estimate: a dict of dense tensors (Dust's), a Flat buffer (backprop),
or a Compact estimate (MeZO's, ES's), made dense inside the update from its key and coefficients: K·D noise values a
step for K directions and D parameters, and never kept.
"""
from __future__ import annotations
import math
from tinygrad import Context, Tensor, dtypes, nn
from kernels import sgd
from kernels.noise import fold
from kernels.perturb import combine
from estimators import Compact, Flat
from registry import Defaults
import engine

def learning_rates(params:dict[str, Tensor], d:Defaults, lr:float|None) -> dict[str, float]:
  """Each parameter's lr: its group's multiple of the base lr, --lr or the estimator's default."""
  return {n: d.lr_of(n, lr or d.lr) for n in params}

class Optimizer:
  """SGD (m ← μm + g; θ ← θ − lr·m) or AdamW, one per distinct lr, the whole update one JIT. With `replay` W > 0 and
  SGD, a Compact estimate's momentum is no buffer but rebuilt, m_t = Σ_{a<W} μ^a g_{t−a}, from the last W steps' keys
  and coefficients: equal to the buffer while W covers every step so far, within μ^W after that, and W·K·D noise values
  a step (README: why the buffer is the default). The history has a fixed shape (unused slots have coefficient 0)."""
  def __init__(self, params:dict[str, Tensor], lrs:dict[str, float], kind:str, momentum:float, replay:int):
    self.params, self.lrs, self.kind, self.momentum, self.W = params, lrs, kind, momentum, replay
    self.keys:Tensor|None = None  # [W, 2] the steps' root keys, newest first
    self.coef:Tensor|None = None  # [W, K]
    self.scale = 1.0  # the lr schedule's factor
    self.uploaded:tuple[float, Tensor|None] = (math.nan, None)  # the last factor, on the device
    # a replayed momentum is rebuilt from seeds: SGD keeps no buffer of its own then
    def make(ps:list[Tensor], lr:float):
      if kind == "sgd": return nn.optim.SGD(ps, lr=lr, momentum=0.0 if replay else momentum)
      return nn.optim.AdamW(ps, lr=lr, b1=momentum, b2=0.95, eps=1e-8, weight_decay=0.0)
    self.opts = [(make([p for n, p in params.items() if lrs[n] == lr], lr), lr) for lr in sorted(set(lrs.values()))]
    # the state the update's JIT assigns: real before it
    Tensor.realize(*[t for o, _ in self.opts for t in nn.state.get_parameters(o)])

  def step(self, g:Compact|Flat|dict[str, Tensor]):
    # a tensor, not a Python float: a new lr is new data, not a new kernel; uploaded when it changes
    if self.uploaded[0] != self.scale:
      self.uploaded = (self.scale, Tensor([self.scale]).realize())
    scale = self.uploaded[1]
    replayed = self.W and self.kind == "sgd"  # the momentum rebuilt from the last W steps' seeds
    if replayed and not isinstance(g, Compact):
      raise ValueError(f"replayed momentum rebuilds the steps from their seeds, which a {type(g).__name__} estimate "
                       "has not: use a momentum buffer (replay 0) with this method")
    if isinstance(g, Flat): return engine.jit(flat_update, self)(g.buf, scale)
    if not isinstance(g, Compact): return engine.jit(update, self)(g, scale)
    if not replayed: return engine.jit(compact_update, self, rank=g.rank)(g.key, g.coef, scale)
    if self.keys is None:
      self.keys = Tensor.zeros(self.W, 2, dtype=dtypes.uint32).contiguous().realize()
      self.coef = Tensor.zeros(self.W, *g.coef.shape).contiguous().realize()
    engine.jit(replay_update, self, rank=g.rank)(g.key, g.coef, scale)

  def state(self) -> dict[str, Tensor]:
    st = {f"optim.{j}.{k}": t for j, (o, _) in enumerate(self.opts) for k, t in nn.state.get_state_dict(o).items()
          if not k.startswith("params.")}
    return st | ({"replay.keys": self.keys, "replay.coef": self.coef} if self.keys is not None else {})

  def load(self, st:dict[str, Tensor]):
    for j, (o, _) in enumerate(self.opts):
      for k, t in nn.state.get_state_dict(o).items():
        if f"optim.{j}.{k}" in st: t.assign(st[f"optim.{j}.{k}"].to(t.device)).realize()
    if "replay.keys" in st:
      # a checkpoint from before the history kept root keys held a key per direction
      if st["replay.keys"].shape != (self.W, 2):
        raise ValueError(f"the checkpoint's replay history has keys of shape {st['replay.keys'].shape}, "
                         f"not ({self.W}, 2): it was written by an older zo, which kept a key per direction; resume it "
                         "with that zo, or start over with --force")
      self.keys, self.coef = (st[f"replay.{k}"].to(None).contiguous().realize() for k in ("keys", "coef"))

def update(opt:Optimizer, grads:dict[str, Tensor], scale:Tensor):
  """One step of the optimizers on these gradients, each optimizer's lr times the schedule's scale."""
  for o, lr in opt.opts: o.lr.assign(scale * lr)
  for n, p in opt.params.items(): p.grad = grads[n].cast(p.dtype)
  with Context(TRAINING=1): Tensor.realize(*[t for o, _ in opt.opts for t in o.schedule_step()])
  for p in opt.params.values(): p.grad = None  # the capture's graph, which nothing reads again

def compact_update(opt:Optimizer, key:Tensor, coef:Tensor, scale:Tensor, rank:int):
  update(opt, Compact(key, coef, rank).dense(opt.params), scale)

def flat_update(opt:Optimizer, buf:Tensor, scale:Tensor):
  """update() on a Flat; SGD with momentum on NVIDIA as kernels/sgd.py's one kernel, which writes every θ and b in
  place."""
  if not (opt.kind == "sgd" and opt.momentum and all(sgd.fits(p, buf) for p in opt.params.values())):
    return update(opt, Flat(buf).dense(opt.params), scale)
  at = {id(p): a for p, a in zip(opt.params.values(), Flat(buf).offsets(opt.params).values())}
  for o, lr in opt.opts: o.lr.assign(scale * lr)
  ps, bs, lrs = zip(*[(p, b, o.lr) for o, _ in opt.opts for p, b in zip(o.params, o.b)])
  for t, new in zip(ps + bs, sgd.step(ps, bs, buf, [at[id(p)] for p in ps], lrs, opt.momentum)):
    t.replace(new)  # the kernel's outputs are p's and b's own buffers (an assign of them would be a cycle)
  Tensor.realize(*ps, *bs)

def replay_update(opt:Optimizer, key:Tensor, coef:Tensor, scale:Tensor, rank:int):
  """Push this step's (key, coef) into the history, then θ ← θ − lr·scale Σ_{a<W} μ^a g_{t−a}, every g regenerated from
  its key."""
  # then in place
  hist = [new.unsqueeze(0).cat(old[:-1]).contiguous().realize() for new, old in ((key, opt.keys), (coef, opt.coef))]
  Tensor.realize(opt.keys.assign(hist[0]), opt.coef.assign(hist[1]))
  K = opt.coef.shape[1]
  # direction k of step t−a: fold(key_{t−a}, k)
  keys = fold(opt.keys, Tensor.arange(K)).transpose(0, 1).reshape(-1, 2).contiguous()
  decay = (opt.momentum ** Tensor.arange(opt.W).float()).unsqueeze(1)
  cs = (opt.coef * decay).reshape(-1)
  lr = {n: opt.lrs[n] * scale.reshape(()) for n in opt.params}
  Tensor.realize(*[p.assign(p - lr[n] * combine(fold(keys, i), cs, p.shape, rank))
                   for i, (n, p) in enumerate(opt.params.items())])
