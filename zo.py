#!/usr/bin/env python3
"""zo: train a network with forward passes only. Estimators of the gradient g of the mean token loss L (README has the math):

  mezo      two-point SPSA along K Gaussian directions z_k:   g = sum_k (L(θ + εz_k) - L(θ - εz_k)) / (2εK) z_k
  es        antithetic evolution strategies with fitness shaping, full-rank or EGGROLL rank-r, the population in one forward
  dust      per-token node perturbation (dust.py)
  backprop  tinygrad autograd: only the reference baseline
"""
from __future__ import annotations
import argparse, itertools, json, math, os, signal, sys, time
from dataclasses import dataclass
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file
from tqdm import tqdm
from tinygrad import Context, Tensor, Variable, dtypes, nn
from tinygrad.dtype import _to_np_dtype
from tinygrad.uop.ops import Ops, UOp
from kernels.noise import NOISES, fold, key as root_key
from kernels.perturb import Population, combine
from kernels import sgd
from model import allocated, jitted, per_call
from data import BPE, Bytes
from devices import names, spread
import dust

METHODS = ("mezo", "es", "dust", "backprop")

@dataclass
class Compact:
  """A weight-space estimate in compact form: g = sum_j coef_j E_j, where E_j (Gaussian, or rank-r for EGGROLL) is regenerated
  from keys[j] folded with the parameter's index. N keys and N floats stand for a full gradient."""
  keys:Tensor  # (N, 2) uint32
  coef:Tensor  # (N,) float32
  rank:int = 0

  def dense(self, params:dict[str, Tensor]) -> dict[str, Tensor]:
    return {n: combine(fold(self.keys, i), self.coef, p.shape, self.rank) for i, (n, p) in enumerate(params.items())}

@dataclass
class Flat:
  """A dense estimate as one float32 buffer, the parameters' gradients one after another in model.params' order. A JIT takes it as one
  input, where the gradients would be one each, and a JIT's inputs cost host time each: 50 of them took longer than the small
  preset's backprop step (NULL device, 2 CPU cores)."""
  buf:Tensor  # (D,) float32
  sums:Tensor|None = None  # (the loss, the buffer's sum of squares): `checked` reads them, made by the JIT that wrote the buffer

  def offsets(self, params:dict[str, Tensor]) -> dict[str, int]:  # where each parameter's gradient starts
    return {n: e - p.numel() for (n, p), e in zip(params.items(), itertools.accumulate(p.numel() for p in params.values()))}

  def dense(self, params:dict[str, Tensor]) -> dict[str, Tensor]:  # views into the buffer
    return {n: self.buf[a:a + p.numel()].reshape(p.shape) for (n, p), a in zip(params.items(), self.offsets(params).values())}

# ***** the estimators: (model, x, y, pop, key) -> (estimate, mean clean-ish loss) *****

# A population forward holds at most this many tokens: the dust preset's batch (8 x 2048), which an H200 runs at its full rate. So one
# member a forward there, where more would only add memory, and 8 at the small preset's 8 x 256, where one alone underfills the GPU.
TOKENS = 16384

# bound at each call of a population forward's JIT: its first pair (whose direction is fold(key, start)) and the chunk's place in the
# losses. Kernel arguments, not uploads: uploading a chunk's start and copying out its losses cost ~2 ms of host time a chunk, more
# than MeZO pop 1's two forwards at the small preset (NULL device).
START, CHUNK = Variable("start", 0, 1 << 24), Variable("pair_chunk", 0, 1 << 24)

def pair_losses(model, x:Tensor, y:Tensor, key:Tensor, start:UOp, at:UOp, losses:Tensor, c:int, scale:float, rank:int):
  """losses[at] <- [c, 2]: the mean loss at θ + scale E_j and at θ - scale E_j for the c antithetic pairs j = start .. start + c - 1,
  whose directions come from fold(key, j). The pairs are members on the batch axis, one forward per sign, each realized apart: the
  memory planner gives the second forward the first one's buffers, so a chunk holds one sign's activations. θ itself is never
  touched, so nothing drifts."""
  keys = fold(key, Tensor(start).cast(dtypes.uint32) + Tensor.arange(c, dtype=dtypes.uint32))
  def loss(sign:int) -> Tensor:
    params = {n: Population(p, fold(keys, i), sign * scale, rank) for i, (n, p) in enumerate(model.params.items())}
    return model.losses(x.repeat(c, 1), y.repeat(c, 1), params=params).reshape(c, -1).mean(1)
  plus = loss(1).realize()
  here = (Tensor.arange(losses.shape[0] // c) == Tensor(at)).reshape(-1, 1, 1)
  losses.assign(here.where(Tensor.stack(plus, loss(-1), dim=1).unsqueeze(0), losses.reshape(-1, c, 2)).reshape(-1, 2)).realize()

def chunk(pairs:int, tokens:int) -> int:
  """Pairs per forward: at most TOKENS tokens together."""
  return per_call(pairs, tokens, TOKENS)

def population(model, x:Tensor, y:Tensor, key:Tensor, pairs:int, scale:float, rank:int, devices:int) -> Tensor:
  """[pairs, 2]: pair_losses for the pairs 0 .. pairs-1, chunk by chunk, spread over devices, in a buffer of this call's own. Pair j's
  direction depends on j alone, so the losses, and the estimate, are the same whatever the chunks and devices."""
  def run(m, js:range, x:Tensor, y:Tensor, k:Tensor) -> Tensor:  # the losses of pairs js, on the device itself
    c = chunk(len(js), x.numel())
    losses = allocated(len(js), 2, device=k.device)
    jit = jitted(pair_losses, m, x.shape, losses.shape, c=c, scale=scale, rank=rank)
    for i, j in enumerate(range(js.start, js.stop, c)): jit(x, y, k, START.bind(j), CHUNK.bind(i), losses)
    return losses
  return spread(model, devices, pairs, run, x, y, key)

def shape_fitness(f:Tensor, shaping:str) -> Tensor:
  """rank: centered ranks in [-0.5, 0.5] (invariant to the loss's scale, robust to outliers); zscore; none: raw fitness."""
  if shaping == "none": return f
  if shaping == "zscore": return (f - f.mean()) / (f.var(correction=0) + 1e-5).sqrt()
  if shaping == "rank": return (f.unsqueeze(0) < f.unsqueeze(1)).sum(1).float() / (f.shape[0] - 1) - 0.5
  raise ValueError(f"unknown shaping {shaping!r}: use rank, zscore or none")

def coefficients(model, key:Tensor, l:Tensor, keys:Tensor, coef:Tensor, mean:Tensor, shaping:str, scale:float):
  """keys_j = fold(key, j) and coef_j = -(f̃_j+ - f̃_j-) / (2 pairs scale), the shaped fitness f = -L of the pairs' losses l [pairs, 2],
  and the mean loss, into the caller's buffers. Unshaped, coef_j = (L_j+ - L_j-) / (2 pairs scale): SPSA's."""
  f = shape_fitness(-l.reshape(-1), shaping).reshape(-1, 2)
  Tensor.realize(keys.assign(fold(key, Tensor.arange(l.shape[0]))), coef.assign(-(f[:, 0] - f[:, 1]) / (2 * l.shape[0] * scale)),
                 mean.assign(l.mean()))

def compact(model, key:Tensor, l:Tensor, shaping:str, scale:float, rank:int) -> tuple[Compact, Tensor]:
  """The estimate of these losses as (Compact, mean loss), made by one JIT into buffers of its own, so it is the caller's to keep:
  eagerly, folding the keys and the coefficients had cost ~5 ms of host time (NULL device), more than a small model's forwards."""
  dev, pairs = key.device, l.shape[0]
  keys, coef, mean = allocated(pairs, 2, dtype=dtypes.uint32, device=dev), allocated(pairs, device=dev), allocated(device=dev)
  jitted(coefficients, model, l.shape, shaping=shaping, scale=scale)(key, l, keys, coef, mean)
  return Compact(keys, coef, rank), mean

def mezo(model, x:Tensor, y:Tensor, pop:int, key:Tensor, eps:float=1e-3, devices:int=1) -> tuple[Compact, Tensor]:
  """SPSA along pop directions z_k: the pairs θ ± εz_k of the population forward, g = sum_k (L+ - L-) / (2ε pop) z_k."""
  return compact(model, key, population(model, x, y, key, pop, eps, 0, devices), "none", eps, 0)

def es(model, x:Tensor, y:Tensor, pop:int, key:Tensor, sigma:float=1e-2, shaping:str="rank", rank:int=0,
       devices:int=1) -> tuple[Compact, Tensor]:
  """g = -1/(pop σ) sum_m f̃_m s_m E_m with fitness f = -L: pair j (members 2j, 2j+1 at θ ± σE_j) contributes (f̃_2j - f̃_2j+1) E_j.
  Unshaped, this is the antithetic estimate sum_j (L+ - L-)/(2σ pairs) E_j of the gradient of the Gaussian-smoothed loss. The
  population is evaluated in chunks (`population`); the fitness is shaped over all of it, on the model's device."""
  if pop % 2: raise ValueError(f"es needs an even population (antithetic pairs), got --pop {pop}")
  return compact(model, key, population(model, x, y, key, pop // 2, sigma, rank, devices), shaping, sigma, rank)

def gradient(model, x:Tensor, y:Tensor) -> tuple[Tensor, list[Tensor]]:
  """The mean loss and its gradient by autograd, one tensor per model.params entry: the sum's gradient over the token count. The sum's
  per-token gradients are O(1), where half precision holds them; the mean's fall under half's smallest normal (6e-5) at the dust
  preset's 16,384 tokens."""
  losses = model.losses(x, y)
  return losses.mean(), [g / losses.numel() for g in losses.sum().gradient(*model.params.values())]

def backprop_pass(model, x:Tensor, y:Tensor) -> tuple[Tensor, Tensor, Tensor]:
  loss, grads = gradient(model, x, y)
  buf = Tensor.empty(model.num_params(), device=x.device)
  Tensor.realize(*[part.assign(t) for part, t in zip(Flat(buf).dense(model.params).values(), grads)])  # each written into its part
  return buf, loss, flat_squares(model, loss, buf)  # the finite check's sums here: a JIT of their own cost its host time every step

def backprop(model, x:Tensor, y:Tensor) -> tuple[Flat, Tensor]:
  """The gradient as a Flat, and the mean loss, by one TinyJit per batch shape as for the ZO passes (eagerly, every step would build and
  schedule the backward graph anew). Its output is the JIT's own buffer, which the next call writes again (buffers new at every call
  made tinygrad rebuild the JIT's CUDA graphs, 4 ms of host time a step at the small preset, NULL device): the training loop uses it
  before then, and `estimate` copies it. The weights are no input either: the JIT reads them from the model, where the optimizer
  updates them in place."""
  buf, loss, sums = jitted(backprop_pass, model, x.shape)(x, y)
  return Flat(buf, sums), loss

def run_estimator(model, x:Tensor, y:Tensor, method:str, pop:int, key:int, **opts) -> tuple[Compact|Flat|dict[str, Tensor], Tensor]:
  if method == "mezo": return mezo(model, x, y, pop, root_key(key), **opts)
  if method == "es": return es(model, x, y, pop, root_key(key), **opts)
  if method == "dust": return dust.step(model, x, y, pop, key, **opts)
  if method == "backprop": return backprop(model, x, y)
  raise ValueError(f"unknown method {method!r}: use one of {', '.join(METHODS)}")

def estimate(model, x:Tensor, y:Tensor, method:str, pop:int, key:int, **opts) -> dict[str, Tensor]:
  """The gradient estimate of the mean token loss, one tensor per model.params entry. Same key, same estimate."""
  g, _ = run_estimator(model, x, y, method, pop, key, **opts)
  if isinstance(g, Flat): g = Flat(g.buf.clone().realize())  # the caller's to keep (backprop)
  return g.dense(model.params) if isinstance(g, (Compact, Flat)) else g

# ***** the optimizer: SGD with momentum or AdamW over parameter groups, with momentum replayed from seeds *****

def group_lrs(model, method:str, optim:str, lr:float|None, pop:int) -> tuple[dict[str, float], float]:
  """lr per parameter and the momentum (SGD) or beta1 (AdamW). dust: its recipe (DUST.md §4). backprop: the release's baseline,
  wte at 1000 under SGD (it feeds an RMSNorm, so its gradient is tiny). mezo/es: one group, since weight-space noise is as large
  on wte as anywhere and a 1000x lr would amplify it. Under AdamW the embeddings get 300x and the scalars 100x the base lr."""
  if method == "dust":
    rc = dust.recipe(pop, "1M", optim, model.n_pblocks)
    base = lr or rc.lr
    return {n: rc.lr_for(n) * base / rc.lr for n in model.params}, rc.momentum
  base = lr or {("backprop", "sgd"): 0.175, ("mezo", "sgd"): 2e-3, ("es", "sgd"): 1e-4}.get((method, optim), 2e-3)
  def special(n:str) -> float:
    if optim == "sgd": return 1000.0 if method == "backprop" and n == "transformer.wte.weight" else base
    return base * (300 if n.endswith("wte.weight") or n.startswith("value_embeds") else 100 if n.endswith("lambdas") else 1)
  return {n: special(n) for n in model.params}, {"sgd": 0.98 if method == "backprop" else 0.9, "adamw": 0.8}[optim]

class Optimizer:
  """tinygrad's SGD (m <- μm + g; θ <- θ - lr m) or AdamW, one per distinct lr, the whole update one TinyJit: eagerly, each step
  built and scheduled its graph again (a MeZO step on the small preset spent 2.6 s of host time so, on the NULL device). A Compact
  estimate (mezo, es) is made dense inside it, from its keys: N·D noise values a step for N directions and D parameters.
  With `replay` W > 0 and SGD, a Compact estimate's momentum is no buffer but rebuilt, m_t = sum_{a<W} μ^a g_{t-a}, from the last W
  steps' keys and coefficients: equal to the buffer while W covers every step so far, within μ^W after that, and W·N·D noise values
  a step (README: why the buffer is the default). The history has a fixed shape [W, N] (unused slots have coefficient 0)."""
  def __init__(self, params:dict[str, Tensor], lrs:dict[str, float], kind:str, momentum:float, replay:int):
    self.params, self.lrs, self.kind, self.momentum, self.W = params, lrs, kind, momentum, replay
    self.keys:Tensor|None = None  # [W, N, 2] newest first
    self.coef:Tensor|None = None  # [W, N]
    self.scale = 1.0  # the lr schedule's factor
    self._scale:tuple[float, Tensor|None] = (math.nan, None)  # the last factor uploaded
    def make(ps:list[Tensor], lr:float):
      if kind == "sgd": return nn.optim.SGD(ps, lr=lr, momentum=momentum)
      return nn.optim.AdamW(ps, lr=lr, b1=momentum, b2=0.95, eps=1e-8, weight_decay=0.0)
    self.opts = [(make([p for n, p in params.items() if lrs[n] == lr], lr), lr) for lr in sorted(set(lrs.values()))]
    Tensor.realize(*[t for o, _ in self.opts for t in nn.state.get_parameters(o)])  # the state the update's JIT assigns: real before it

  def step(self, g:Compact|Flat|dict[str, Tensor]):
    if self._scale[0] != self.scale:  # a tensor, not a Python float: a new lr is new data, not a new kernel; uploaded when it changes
      self._scale = (self.scale, Tensor([self.scale]).realize())
    scale = self._scale[1]
    if isinstance(g, Flat): return jitted(flat_update, self)(g.buf, scale)
    if not isinstance(g, Compact): return jitted(update, self)(g, scale)
    if not (self.W and self.kind == "sgd"): return jitted(dense_update, self, g.keys.shape, rank=g.rank)(g.keys, g.coef, scale)
    if self.keys is None:
      self.keys = Tensor.zeros(self.W, *g.keys.shape, dtype=dtypes.uint32).contiguous().realize()
      self.coef = Tensor.zeros(self.W, *g.coef.shape).contiguous().realize()
    jitted(replay_update, self, g.keys.shape, rank=g.rank)(g.keys, g.coef, scale)

  def state(self) -> dict[str, Tensor]:
    st = {f"optim.{j}.{k}": t for j, (o, _) in enumerate(self.opts) for k, t in nn.state.get_state_dict(o).items() if not k.startswith("params.")}
    return st | ({"replay.keys": self.keys, "replay.coef": self.coef} if self.keys is not None else {})

  def load(self, st:dict[str, Tensor]):
    for j, (o, _) in enumerate(self.opts):
      for k, t in nn.state.get_state_dict(o).items():
        if f"optim.{j}.{k}" in st: t.assign(st[f"optim.{j}.{k}"].to(t.device)).realize()
    if "replay.keys" in st: self.keys, self.coef = (st[f"replay.{k}"].to(None).contiguous().realize() for k in ("keys", "coef"))

def update(opt:Optimizer, grads:dict[str, Tensor], scale:Tensor):
  """One step of the optimizers on these gradients, each optimizer's lr times the schedule's scale."""
  for o, lr in opt.opts: o.lr.assign(scale * lr)
  for n, p in opt.params.items(): p.grad = grads[n].cast(p.dtype)
  with Context(TRAINING=1): Tensor.realize(*[t for o, _ in opt.opts for t in o.schedule_step()])
  for p in opt.params.values(): p.grad = None  # the capture's graph, which nothing reads again

def dense_update(opt:Optimizer, keys:Tensor, coef:Tensor, scale:Tensor, rank:int): update(opt, Compact(keys, coef, rank).dense(opt.params), scale)
def flat_update(opt:Optimizer, buf:Tensor, scale:Tensor):
  """update() on a Flat; SGD with momentum on NVIDIA as kernels/sgd.py's one kernel, which writes every theta and b in place."""
  if not (opt.kind == "sgd" and opt.momentum and all(sgd.fits(p, buf) for p in opt.params.values())):
    return update(opt, Flat(buf).dense(opt.params), scale)
  at = {id(p): a for p, a in zip(opt.params.values(), Flat(buf).offsets(opt.params).values())}
  for o, lr in opt.opts: o.lr.assign(scale * lr)
  ps, bs, lrs = zip(*[(p, b, o.lr) for o, _ in opt.opts for p, b in zip(o.params, o.b)])
  for t, new in zip(ps + bs, sgd.step(ps, bs, buf, [at[id(p)] for p in ps], lrs, opt.momentum)):
    t.replace(new)  # the kernel's outputs are p's and b's own buffers (an assign of them would be a cycle)
  Tensor.realize(*ps, *bs)

def replay_update(opt:Optimizer, keys:Tensor, coef:Tensor, scale:Tensor, rank:int):
  """Push this step's (keys, coef) into the history, then θ <- θ - lr scale sum_{a<W} μ^a g_{t-a}, every g regenerated from its seeds."""
  hist = [new.unsqueeze(0).cat(old[:-1]).contiguous().realize() for new, old in ((keys, opt.keys), (coef, opt.coef))]  # then in place
  Tensor.realize(opt.keys.assign(hist[0]), opt.coef.assign(hist[1]))
  decay = (opt.momentum ** Tensor.arange(opt.W).float()).unsqueeze(1)
  ks, cs = opt.keys.reshape(-1, 2), (opt.coef * decay).reshape(-1)
  lr = {n: opt.lrs[n] * scale.reshape(()) for n in opt.params}
  Tensor.realize(*[p.assign(p - lr[n] * combine(fold(ks, i), cs, p.shape, rank)) for i, (n, p) in enumerate(opt.params.items())])

# ***** training: checkpoints, evaluation, the loop *****

class UsageError(Exception): pass  # a mistake the user can fix: one line, exit code 2, no traceback

def step_key(seed:int, step:int) -> int: return (seed << 32) | step  # the key words are (step, seed)

def save(out:str, model, opt:Optimizer, step:int):
  """Atomic: write a temp file, fsync it, rename it over the old checkpoint, so a crash mid-save leaves the previous one intact.
  Written from host copies by the safetensors package: tinygrad's safe_save goes through its CPU device, which compiles helper
  programs with clang even under DEV=CUDA, so a GPU machine without clang lost the whole run at its first checkpoint."""
  path, tmp = os.path.join(out, "model.safetensors"), os.path.join(out, "model.safetensors.tmp")
  save_file({k: t.numpy() for k, t in {**{f"param.{n}": p for n, p in model.params.items()}, **opt.state()}.items()}, tmp,
            metadata={"step": str(step)})
  mask = os.umask(0)
  os.umask(mask)
  os.chmod(tmp, 0o666 & ~mask)  # safetensors creates its file private (0600); a checkpoint gets the mode of any file the user writes
  with open(tmp, "rb+") as f: os.fsync(f.fileno())
  os.replace(tmp, path)

def load_checkpoint(out:str, model, flag:str, keep:str="") -> tuple[dict[str, Tensor], int]:
  """The model's parameters set from the checkpoint in out; returns the checkpoint's tensors whose names start with `keep`, and its step."""
  path = os.path.join(out, "model.safetensors")
  if not os.path.exists(path): raise UsageError(f"{flag}: no checkpoint at {path}")
  with safe_open(path, "np") as f: st, step = {k: Tensor(f.get_tensor(k)) for k in f.keys() if k.startswith(keep)}, int(f.metadata()["step"])
  for n, p in model.params.items():
    if f"param.{n}" not in st or st[f"param.{n}"].shape != p.shape: raise UsageError(f"{flag}: {path} holds another model ({n} differs)")
    p.assign(st[f"param.{n}"].to(p.device)).realize()
  return st, step

def resume(out:str, model, opt:Optimizer) -> int:
  st, step = load_checkpoint(out, model, "--resume")
  opt.load(st)
  return step

def mean_loss(model, x:Tensor, y:Tensor, **kw) -> Tensor: return model.losses(x, y, **kw).mean().realize()

def val_loss(model, data, args, batches:int=4) -> float:
  """The mean loss over the first validation batches, as a JIT, whose memory plan lives in the arena every JIT shares (model.Scratch):
  an eager forward keeps every materialized activation until its schedule ends (the dust preset at 8x2048 tokens: 5.3 GiB eagerly,
  0.4 GiB in a JIT)."""
  kw = {"loops": args.eval_loops} if args.model == "looped" and args.eval_loops else {}
  jit = jitted(mean_loss, model, (args.batch, args.seq), **kw)  # every batch is [batch, seq]
  return float(np.mean([jit(*map(Tensor, data.batch("val", i, args.batch, args.seq))).item() for i in range(batches)]))

def compute_dtype():  # half precision (float32 accumulation, float32 master weights) on accelerators; float32 on the CPU
  from tinygrad import Device
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

def method_opts(args) -> dict:
  return {"mezo": {"eps": args.eps, "devices": args.devices}, "es": {"sigma": args.sigma, "shaping": args.shaping, "rank": args.rank,
          "devices": args.devices},
          "dust": {"optimizer": args.optim, "noise": args.noise, "devices": args.devices}, "backprop": {}}[args.method]

def run_config(path:str) -> dict:  # a run from before --tokenizer read bytes, and one from before --noise drew Gaussians
  return {"tokenizer": "bytes", "noise": "gaussian"} | json.load(open(path))

def train(args):
  from data import load
  tok = text_tokenizer(args, "--resume" if args.resume else None)  # resumed, a run keeps its tokenizer, whatever the text is now
  model = make_model(args)
  if args.seq > model.cfg.seq_len: raise UsageError(f"--seq {args.seq} is longer than the model's context of {model.cfg.seq_len}")
  data = load(args.data, model.cfg.vocab, args.seq, args.seed, tok)
  steps = args.steps or max(1, args.tokens // (args.batch * args.seq))
  lrs, momentum = group_lrs(model, args.method, args.optim, args.lr, args.pop)
  opt = Optimizer(model.params, lrs, args.optim, args.momentum or momentum, args.replay)
  recipe_warmdown = dust.recipe(args.pop, "1M", args.optim, model.n_pblocks).warmdown if args.method == "dust" else 0.0
  warmdown = recipe_warmdown if args.warmdown is None else args.warmdown
  cfg_path, log_path = os.path.join(args.out, "config.json"), os.path.join(args.out, "metrics.jsonl")
  config = {k: v for k, v in vars(args).items() if k not in ("resume", "force", "cosine", "sample", "prompt", "temperature", "top_k")}
  start = 0
  if os.path.exists(args.out) and not os.path.isdir(args.out): raise UsageError(f"--out {args.out}: not a directory")
  if args.resume:
    if not os.path.exists(cfg_path): raise UsageError(f"--resume: no run in {args.out} to resume")
    old = run_config(cfg_path)
    kept = ("method", "model", "vocab", "seq", "loops", "optim", "pop", "rank", "replay", "tokenizer", "noise")
    diff = [k for k in kept if old.get(k) != config[k]]
    if diff:
      raise UsageError(f"--resume: {args.out} was trained with other {', '.join(diff)} ({', '.join(f'{k}={old.get(k)}' for k in diff)})")
    start = resume(args.out, model, opt)
    keep = [line for line in open(log_path) if logged_step(line) < start] if os.path.exists(log_path) else []
    with open(log_path, "w") as f: f.writelines(keep)  # steps logged after the checkpoint are run again
  elif os.path.exists(log_path) and not args.force:
    raise UsageError(f"{args.out} holds another run: pass --resume to continue it or --force to overwrite")
  os.makedirs(args.out, exist_ok=True)
  json.dump(config, open(cfg_path, "w"), indent=1)
  # --force: nothing of the old run stays
  for f in () if args.resume else ("metrics.jsonl", "model.safetensors", "model.safetensors.tmp", "tokenizer.json"):
    if os.path.exists(p := os.path.join(args.out, f)): os.remove(p)
  if isinstance(tok, BPE) and not args.resume: tok.save(os.path.join(args.out, "tokenizer.json"))
  what = args.method if args.method == "backprop" else f"{args.method} pop {args.pop}"  # backprop has no population
  print(f"{what} on {type(model).__name__} ({model.num_params():,} params), {data.name}, {steps} steps of "
        f"{args.batch}x{args.seq} tokens" + (f"; the loss floor of this data is {data.floor:.3f}" if data.floor is not None else ""))
  stop = []
  signal.signal(signal.SIGINT, lambda *_: stop.append(True))
  val, t0 = None, time.perf_counter()
  print("the first step and the first evaluation compile their kernels (tinygrad caches them for the next run)")
  with open(log_path, "a") as log, tqdm(initial=start, total=steps, dynamic_ncols=True, desc="compiling") as bar:
    for step in range(start, steps):
      x, y = map(Tensor, data.batch("train", step, args.batch, args.seq))
      ts = time.perf_counter()
      g, loss = run_estimator(model, x, y, args.method, args.pop, step_key(args.seed, step), **method_opts(args))
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
      if (step + 1) % args.ckpt_every == 0 or step == steps - 1 or stop: save(args.out, model, opt, step + 1)
      if stop:
        print(f"interrupted after {step + 1} steps: checkpoint saved in {args.out}; continue with --resume", file=sys.stderr)
        sys.exit(130)

def logged_step(line:str) -> float:  # a line torn by a crash mid-write counts as not logged
  try: return json.loads(line)["step"]
  except (ValueError, KeyError, TypeError): return math.inf

def squares(model, loss:Tensor, named:dict[str, Tensor]) -> Tensor:
  return Tensor.stack(loss.float().reshape(()), *[t.float().square().sum() for t in named.values()])

def flat_squares(model, loss:Tensor, buf:Tensor) -> Tensor:
  """The loss and the gradient's sum of squares. Summed as rows of 256 (zeros pad it to whole rows), then the rows: tinygrad splits a
  sum by the small factors of its length, and 37,749,776 = 16 x a prime, so the plain sum ran in 16 threads (132 ms at the dust preset)."""
  rows = buf.pad((0, -buf.numel() % 65536)).reshape(-1, 256).square().sum(1)
  return Tensor.stack(loss.float().reshape(()), rows.contiguous().sum())

def host(t:Tensor) -> np.ndarray:
  """A JIT's small output on the host: the device's copy-out (a sync and a memcpy) into a NumPy array. Tensor.numpy() builds and runs a
  copy program at every call: 0.24 ms of host time on the H200's machine (the check of each step, a tenth of the small preset's backprop
  step) and 0.31 ms on a 2-core CPU, where this read takes 0.02 ms on both."""
  assert t.uop.op is Ops.BUFFER, "a realized buffer, not a lazy tensor or a view of one"
  buf, out = t.uop.buffer, np.empty(t.shape, _to_np_dtype(t.dtype))
  buf.allocator._copyout(memoryview(out).cast("B"), buf._buf)
  return out

def checked(model, loss:Tensor, g:Compact|Flat|dict[str, Tensor], step:int, out:str) -> float:
  """The step's loss, once it and the estimate are seen to be finite: one JIT and one read from the device (built eagerly at every
  step, the sums' graph took longer than a small model's whole step); backprop's JIT makes the sums with its gradient. A Flat is
  summed whole (one sum a parameter was 42 kernels at the small preset), and only a non-finite one is searched for the parameter."""
  if isinstance(g, Flat):
    named, vals = {"the gradient": g.buf}, host(g.sums)
  else:
    named = {"coefficients": g.coef} if isinstance(g, Compact) else g
    vals = host(jitted(squares, model, tuple(t.shape for t in named.values()))(loss, named))
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
  from data import load
  tok = text_tokenizer(args)
  model = make_model(args)
  x, y = map(Tensor, load(args.data, model.cfg.vocab, args.seq, args.seed, tok).batch("train", 0, args.batch, args.seq))
  ref = estimate(model, x, y, "backprop", 1, 0)
  rows = {pop: cosines(estimate(model, x, y, args.method, pop, step_key(args.seed, 0), **method_opts(args)), ref) for pop in args.pops}
  types = list(next(iter(rows.values())))
  print(f"cosine of {args.method} to the backprop gradient, one batch of {args.batch}x{args.seq}\n" + f"{'pop':>7} " +
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
  return jitted(last_logits, model, (1, T))(Tensor(window), Tensor([len(ctx) - 1], dtype=dtypes.int32)).numpy()[0]

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
  p.add_argument("--method", default="dust", choices=METHODS, help="gradient estimator; backprop is the reference baseline")
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
                 "a GPU, 50,000 on the CPU: either takes Dust pop 1024 to about 0.1 nats above the synthetic data's floor)")
  p.add_argument("--batch", type=int, default=8, help="sequences per batch")
  p.add_argument("--seq", type=int, default=None, help="training sequence length, at most the model's context (default: the context)")
  p.add_argument("--lr", type=float, default=None, help="base learning rate (default: the method's recipe)")
  p.add_argument("--optim", default="sgd", choices=("sgd", "adamw"))
  p.add_argument("--momentum", type=float, default=None, help="SGD momentum or AdamW beta1 (default: the recipe's)")
  p.add_argument("--warmdown", type=float, default=None, help="fraction of the steps at the end over which the lr falls linearly to 0 "
                 "(default: 0.3 for Dust under AdamW, the Noise record's schedule; else 0)")
  p.add_argument("--noise", default="gaussian", choices=tuple(NOISES), help="dust: the distribution of every draw "
                 "(Rademacher: +-1, the same mean and variance)")
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
  p.add_argument("--resume", action="store_true", help="continue the run in --out from its checkpoint")
  p.add_argument("--force", action="store_true", help="overwrite a run already in --out")
  p.add_argument("--cosine", action="store_true", help="print the per-layer-type cosine of the estimate to backprop for each --pop, then exit")
  p.add_argument("--devices", type=int, default=1, help="devices of the default backend to split the population over")
  p.add_argument("--sample", type=int, default=None, metavar="N", help="print N tokens sampled from the checkpoint in --out, then exit")
  p.add_argument("--prompt", default="\n", help="--sample: the text to continue (default: %(default)r)")
  p.add_argument("--temperature", type=float, default=1.0, help="--sample: divides the logits before the softmax")
  p.add_argument("--top-k", type=int, default=None, help="--sample: draw from the k likeliest tokens only; None: from all")
  args = p.parse_args(argv)
  args.pops, args.pop = args.pop, args.pop[0]
  for flag in ("pop", "batch", "eval_every", "ckpt_every"):
    if min(args.pops if flag == "pop" else [getattr(args, flag)]) < 1: p.error(f"--{flag.replace('_', '-')} must be at least 1")
  if args.replay < 0: p.error("--replay must be 0 (a momentum buffer) or a number of steps")
  for flag in ("sample", "top_k"):
    if getattr(args, flag) is not None and getattr(args, flag) < 1: p.error(f"--{flag.replace('_', '-')} must be at least 1")
  if args.temperature <= 0: p.error("--temperature must be positive")
  if len(args.pops) > 1 and not args.cosine: p.error("several --pop values only make sense with --cosine")
  if args.noise != "gaussian" and args.method != "dust": p.error(f"--noise {args.noise} is Dust's: {args.method} draws Gaussian noise")
  return args

def default_device() -> str:
  from tinygrad import Device
  try: return Device.DEFAULT
  except Exception: raise UsageError("tinygrad found no usable device: install clang for the CPU backend (apt-get install clang), "
                                     "or run on a GPU with DEV=CUDA / DEV=AMD / DEV=METAL") from None

def check_devices(args:argparse.Namespace):
  """--devices N: N devices of the default backend (DEV, DEV:1, ...), each with at least one direction (mezo) or pair (es); Dust
  splits each group's chunks, and a device whose share of a small group is empty sits that group out."""
  from tinygrad import Device
  n = args.devices
  if n == 1: return
  if n < 1: raise UsageError(f"--devices must be at least 1, got {n}")
  if args.method == "backprop": raise UsageError(f"--devices {n}: backprop runs on one device")
  if args.method != "dust" and n > (draws := min(args.pops) // (2 if args.method == "es" else 1)):
    unit = "antithetic pair" if args.method == "es" else "direction"
    raise UsageError(f"--devices {n}: every device needs at least one {unit}, and --pop {min(args.pops)} has {draws}")
  for d in names(Device.DEFAULT, n):
    try: Device[d]
    except Exception as e: raise UsageError(f"--devices {n}: {d} does not open ({type(e).__name__}: {e})") from None

def device_defaults(args, device:str):
  """The default run of each kind of device (README): on a GPU the small model and 500,000 tokens; on the CPU, where a Dust pop-1024
  step of the tiny model took 52-58 s on 2 cores, mostly in the head, the tiny model, 50,000 tokens and a synthetic chain of 32
  states, whose head is 1/8 of a 256-token vocab's and which Dust learns in ~100 steps (docs/performance.md: the CPU's default run)."""
  cpu = device == "CPU"
  args.model = args.model or ("tiny" if cpu else "small")
  if args.tokens is None: args.tokens = 50_000 if cpu else 500_000
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
