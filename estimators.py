"""The estimators of the gradient g of the mean token loss L(θ). README's "The estimators" has the math.

Every estimator is a function (model, x, y, pop, key, **options) -> (estimate, mean loss), registered by name with
@estimator (registry.py: the contract), so that `python zo.py --method NAME` trains with it: its declared options become
its flags. `key` is the step's root key (kernels/noise.py): direction k's noise is a pure function of fold(key, k), so
an estimate is a key and a coefficient per direction (Compact), which the optimizer turns into dense noise where it
updates the weights, and nothing of the noise is ever kept.

  mezo      SPSA along K Gaussian directions z_k:   g = Σ_k (L(θ + εz_k) − L(θ − εz_k)) / (2εK) · z_k
  es        antithetic evolution strategies:        g = −1/(2σK) Σ_k (f̃_k⁺ − f̃_k⁻) E_k,  f = −L shaped to f̃
            (ranks, z-scores or none), E_k a full-rank Gaussian or EGGROLL's rank-r product A_k B_kᵀ/√r
  dust      per-token node perturbation (dust.py, docs/dust.md §3)
  backprop  tinygrad's autograd: the reference baseline, never used by the others

The tensor math of a step runs as engine.jit functions, captured once and replayed (engine.py says why): written as
plain functions of tensors, they read as the math.
"""
from __future__ import annotations
import itertools
from dataclasses import dataclass
from typing import Any
import numpy as np
from tinygrad import Tensor, dtypes
from kernels.noise import fold, key as root_key
from kernels.perturb import Population, combine
from devices import shares, spread
from registry import (ESTIMATORS, NONNEGATIVE, POSITIVE, STANDARD, Defaults, Entry, Option, Run, activations, estimator,
                      itemsize, size)
import dust, engine  # noqa: F401  dust.py registers Dust

@dataclass
class Compact:
  """g = Σ_k coef_k E_k, E_k regenerated from fold(key, k) (folded once more with each parameter's index): K floats and
  one key stand for a full gradient. rank 0: E_k Gaussian; r > 0: EGGROLL's rank-r product on matrices."""
  key:Tensor   # [2] uint32, the step's root key
  coef:Tensor  # [K] float32
  rank:int = 0

  def dense(self, params:dict[str, Tensor]) -> dict[str, Tensor]:
    # made once, not again in every noise value's loop
    keys = fold(self.key, Tensor.arange(self.coef.shape[0])).contiguous()
    return {n: combine(fold(keys, i), self.coef, p.shape, self.rank) for i, (n, p) in enumerate(params.items())}

@dataclass
class Flat:
  """A dense estimate as one float32 buffer, the parameters' gradients one after another in model.params' order. A JIT
  takes it as one input, where the gradients would be one each, and a JIT's inputs cost host time each: 50 of them took
  longer than the small preset's backprop step (NULL device, 2 CPU cores)."""
  buf:Tensor  # (D,) float32
  # (the loss, the buffer's sum of squares): the training loop's check reads them, made with the buffer
  sums:Tensor|None = None

  def offsets(self, params:dict[str, Tensor]) -> dict[str, int]:  # where each parameter's gradient starts
    return {n: e - p.numel()
            for (n, p), e in zip(params.items(), itertools.accumulate(p.numel() for p in params.values()))}

  def dense(self, params:dict[str, Tensor]) -> dict[str, Tensor]:  # views into the buffer
    return {n: self.buf[a:a + p.numel()].reshape(p.shape)
            for (n, p), a in zip(params.items(), self.offsets(params).values())}

# ***** the population forward: the losses at θ ± scale·E_k *****

# A population forward holds at most this many tokens: the dust preset's batch (8 x 2048), which fills a GPU by itself.
# So one direction a forward there, where more would only add memory, and 8 at the small preset's 8 x 256, where one
# alone underfills it (docs/performance.md).
TOKENS = 16384

def population_losses(model, x:Tensor, y:Tensor, key:Tensor, n:int, scale:float, rank:int=0,
                      signs:tuple[int, ...]=(1, -1), devices:int=1) -> Tensor:
  """[n, len(signs)]: the mean loss L(θ + s·scale·E_k) for directions k = 0..n−1 (E_k from fold(key, k)) and each sign
  s. Direction k depends on k alone, so the losses are the same however the directions are split into forwards and over
  devices."""
  # directions ks on one device, as many a forward as fit TOKENS; one, where the model takes no population (registry.py)
  def on_device(m, ks:range, x:Tensor, y:Tensor, key:Tensor) -> Tensor:
    c = engine.per_call(len(ks), x.numel(), TOKENS) if getattr(m, "population", False) else 1
    return engine.stack(perturbed_losses, m, x, y, key, items=ks, per_call=c, shape=(len(signs),), scale=scale,
                        rank=rank, signs=signs)
  return spread(model, devices, n, on_device, x, y, key)

def perturbed_losses(model, k:Tensor, x:Tensor, y:Tensor, key:Tensor, scale:float, rank:int,
                     signs:tuple[int, ...]) -> Tensor:
  """[c, len(signs)] for the c directions k: their members on the batch axis, one forward per sign, each realized apart
  (so the memory planner gives the next sign's forward this one's buffers). θ itself is never touched, so nothing
  drifts. A model that takes no population gets one direction (c = 1) as plain tensors, θ + s·scale·E_k."""
  keys, c = fold(key, k), k.shape[0]
  def loss(sign:int) -> Tensor:
    # the sign as data: the two signs' forwards share their compiled kernels
    signed = scale * engine.scalar(sign, np.float32, x.device)
    params = {n: Population(p, fold(keys, i), signed, rank) for i, (n, p) in enumerate(model.params.items())}
    if not getattr(model, "population", False):
      weights = {n: w.dense(dtypes.float32)[0] for n, w in params.items()}  # θ + s·scale·E_k
      return model.losses(x, y, params=weights).mean().reshape(1).realize()
    return model.losses(x.repeat(c, 1), y.repeat(c, 1), params=params).reshape(c, -1).mean(1).realize()
  return Tensor.stack(*[loss(s) for s in signs], dim=1)

# ***** MeZO and ES *****

def spread_draws(run:Run, draws:int, unit:str):
  """A check: every device gets at least one of the draws, and the kernels can number a device's share of them (the
  first draw of a call is bound to engine.START, and the last call, of c draws, starts c before the share's end)."""
  if run.devices > draws: raise ValueError(f"--devices {run.devices}: every device needs at least one {unit}, and "
                                           f"--pop {run.pop} has {draws}")
  most = engine.START.vmax
  if max(len(r) - engine.per_call(len(r), run.tokens // run.steps, TOKENS) for r in shares(draws, run.devices)) > most:
    raise ValueError(f"--pop {run.pop}: the kernels number the {unit}s of a device up to {most + 1:,}: "
                     f"--pop {(most + 1) * run.devices * run.pop // draws:,} fits")

def spsa(losses:Tensor, eps:float|Tensor) -> tuple[Tensor, Tensor]:
  """coef_k = (L(θ + εz_k) − L(θ − εz_k)) / (2εK), and the mean loss."""
  return (losses[:, 0] - losses[:, 1]) / (2 * eps * losses.shape[0]), losses.mean()

def per_call(run:Run, draws:int) -> int:  # the draws of a population forward's call, each the batch at both signs
  return engine.per_call(draws, run.tokens // run.steps, TOKENS)

def population_memory(run:Run, draws:int, full_rank:bool) -> float|None:
  """A population call's activations, and under full-rank noise a copy of the weights for each of its draws."""
  c, m = per_call(run, draws), run.model
  if (held := activations(m, 2 * c * run.tokens // run.steps)) is None: return None
  return held + full_rank * c * size(m) * itemsize(m)

@estimator("mezo", check=lambda run: spread_draws(run, run.pop, "direction"), forwards=lambda run: 2 * run.pop,
           memory=lambda run: population_memory(run, run.pop, full_rank=True),
           eps=Option("the perturbation scale ε", check=POSITIVE))
def mezo(model, x:Tensor, y:Tensor, pop:int, key:Tensor, eps:float=1e-3, devices:int=1) -> tuple[Compact, Tensor]:
  """SPSA: g = Σ_k (L(θ + εz_k) − L(θ − εz_k)) / (2εK) · z_k over K = pop Gaussian directions z_k."""
  losses = population_losses(model, x, y, key, pop, eps, devices=devices)  # [K, 2]
  coef, loss = engine.jit(spsa, eps=eps)(losses)
  return Compact(key, coef), loss

def shape_fitness(f:Tensor, shaping:str) -> Tensor:
  """rank: centered ranks in [−0.5, 0.5] (invariant to the loss's scale, robust to outliers); zscore; none: the raw
  fitness."""
  if shaping == "none": return f
  if shaping == "zscore": return (f - f.mean()) / (f.var(correction=0) + 1e-5).sqrt()
  if shaping == "rank": return (f.unsqueeze(0) < f.unsqueeze(1)).sum(1).float() / (f.shape[0] - 1) - 0.5
  raise ValueError(f"unknown shaping {shaping!r}: use rank, zscore or none")

def es_coefficients(losses:Tensor, sigma:float, shaping:str) -> tuple[Tensor, Tensor]:
  """coef_k = −(f̃_k⁺ − f̃_k⁻) / (2σK), the fitness f = −L shaped over the whole population, and the mean loss.
  Unshaped, this is SPSA's (L⁺ − L⁻)/(2σK): the gradient of the Gaussian-smoothed loss."""
  f = shape_fitness(-losses.reshape(-1), shaping).reshape(-1, 2)
  return -(f[:, 0] - f[:, 1]) / (2 * sigma * losses.shape[0]), losses.mean()

def pairs(run:Run):
  if run.pop % 2: raise ValueError(f"es needs an even population (antithetic pairs), got --pop {run.pop}")
  spread_draws(run, run.pop // 2, "antithetic pair")

@estimator("es", defaults=STANDARD | {"sgd": Defaults(lr=1e-4, momentum=0.9)}, check=pairs,
           forwards=lambda run: run.pop,
           memory=lambda run: population_memory(run, run.pop // 2, full_rank=run.options["rank"] == 0),
           sigma=Option("the perturbation scale σ", check=POSITIVE),
           shaping=Option("fitness shaping: centred ranks, z-scores or the raw fitness",
                          choices=("rank", "zscore", "none")),
           rank=Option("0 for full-rank Gaussian noise, r > 0 for EGGROLL's rank-r noise", check=NONNEGATIVE))
def es(model, x:Tensor, y:Tensor, pop:int, key:Tensor, sigma:float=1e-2, shaping:str="rank", rank:int=0,
       devices:int=1) -> tuple[Compact, Tensor]:
  """Antithetic ES over pop members, K = pop/2 pairs θ ± σE_k: g = −1/(2σK) Σ_k (f̃_k⁺ − f̃_k⁻) E_k."""
  losses = population_losses(model, x, y, key, pop // 2, sigma, rank=rank, devices=devices)  # [K, 2]
  coef, loss = engine.jit(es_coefficients, sigma=sigma, shaping=shaping)(losses)
  return Compact(key, coef, rank), loss

# ***** backprop: the baseline *****

def gradient(model, x:Tensor, y:Tensor) -> tuple[Tensor, list[Tensor]]:
  """The mean loss and its gradient by autograd, one tensor per model.params entry: the sum's gradient over the token
  count. The sum's per-token gradients are O(1), where half precision holds them; the mean's fall under half's smallest
  normal (6e-5) at the dust preset's 16,384 tokens."""
  losses = model.losses(x, y)
  return losses.mean(), [g / losses.numel() for g in losses.sum().gradient(*model.params.values())]

def flat_squares(loss:Tensor, buf:Tensor) -> Tensor:
  """The loss and the gradient's sum of squares. Summed as rows of 256, then the rows (zeros pad it to 256 whole rows,
  so that both sums split evenly): tinygrad splits a sum by the small factors of its length, and 37,749,776 = 16 x 1249
  x 1889, so the plain sum ran in 16 threads (docs/performance.md)."""
  rows = buf.pad((0, -buf.numel() % 65536)).reshape(-1, 256).square().sum(1)
  return Tensor.stack(loss.float().reshape(()), rows.contiguous().sum())

def backprop_pass(model, x:Tensor, y:Tensor) -> tuple[Tensor, Tensor, Tensor]:
  loss, grads = gradient(model, x, y)
  buf = Tensor.empty(size(model), device=x.device)
  # each written into its part
  Tensor.realize(*[part.assign(t) for part, t in zip(Flat(buf).dense(model.params).values(), grads)])
  return buf, loss, flat_squares(loss, buf)  # the check's sums here: a JIT of their own cost its host time every step

def differentiable(run:Run):
  """backprop's check: the loss has a gradient for every parameter. tinygrad's autograd gives a parameter joined to the
  loss only through ops without one (a comparison: sign, a step, argmax) a gradient of zeros, and says nothing."""
  model, x = run.model, Tensor.zeros(1, 2, dtype=dtypes.int32)  # any batch: which gradients exist is the graph's
  if none := engine.no_gradient(model.losses(x, x).sum(), model.params):
    more = f" and {len(none) - 1} more" if len(none) > 1 else ""
    raise ValueError(f"backprop can't train {type(model).__name__}: its loss has no gradient for {none[0]}{more}, "
                     "whose every path to it passes an op without one (a comparison: sign, a step, argmax); mezo and "
                     "es train it")

# the release's baseline: under SGD wte's lr is 1000 (it feeds an RMSNorm, so its gradient is tiny)
@estimator("backprop", keyed=False, check=differentiable,
           forwards=lambda run: 3,  # a forward, and a backward of twice its work
           memory=lambda run: activations(run.model, run.tokens // run.steps, kept=True),
           defaults=STANDARD | {"sgd": Defaults(lr=0.175, momentum=0.98, groups={"transformer.wte": 1000 / 0.175})})
def backprop(model, x:Tensor, y:Tensor, pop:int, key:None) -> tuple[Flat, Tensor]:
  """The gradient by tinygrad's autograd, the reference baseline. Returns it as a Flat, and the mean loss. The buffer is
  the JIT's own, which its next call writes again (a new one every call made tinygrad rebuild the JIT's CUDA graphs);
  `estimate` copies it."""
  buf, loss, sums = engine.jit(backprop_pass, model)(x, y)
  return Flat(buf, sums), loss

# ***** running one *****

def run(model, x:Tensor, y:Tensor, method:str, pop:int, seed:int,
        **values) -> tuple[Compact|Flat|dict[str, Tensor], Tensor]:
  """(estimate, mean loss) of `method` with the root key of an integer seed; `values` are its options and the run's
  values it names."""
  if method not in ESTIMATORS: raise ValueError(f"unknown method {method!r}: use one of {', '.join(ESTIMATORS)}")
  entry = ESTIMATORS[method]
  return entry.fn(model, x, y, pop, root_key(seed) if entry.keyed else None, **values)

def estimate(model, x:Tensor, y:Tensor, method:str, pop:int, seed:int, **values) -> dict[str, Tensor]:
  """The estimate of the gradient of the mean token loss, one tensor per model.params entry, the caller's to keep. Same
  seed, same estimate."""
  g, _ = run(model, x, y, method, pop, seed, **values)
  # copies of the JITs' own buffers, which their next call writes again
  if isinstance(g, Flat): return Flat(g.buf.clone().realize()).dense(model.params)
  if isinstance(g, Compact):  # made dense by a JIT, as the optimizer does: its noise graph built and scheduled once
    out = {n: engine.empty(*p.shape, device=p.device) for n, p in model.params.items()}
    engine.jit(dense_into, rank=g.rank)(g.key, g.coef, out)
    return out
  copies = {n: t.clone() for n, t in g.items()}
  Tensor.realize(*copies.values())
  return copies

def dense_into(key:Tensor, coef:Tensor, out:dict[str, Tensor], rank:int):
  """Σ_k coef_k E_k written into `out`, a buffer for each parameter in model.params' order: Compact.dense reads from its
  dict only the names and shapes, which are the parameters'."""
  Tensor.realize(*[o.assign(d) for o, d in zip(out.values(), Compact(key, coef, rank).dense(out).values())])

# ***** what the loop passes to an estimator at a step *****

def step_key(seed:int, step:int) -> int: return (seed << 32) | step  # the key words are (step, seed)

# the state, for an estimator that keeps one
def carried(entry:Entry, state:dict[str, Tensor]) -> dict[str, dict[str, Tensor]]:
  return {"state": state} if "state" in entry.takes else {}

def values(entry:Entry, job:Run) -> dict[str, Any]:
  """What the loop passes to the estimator at every step: its options, and the run's values that it names
  (registry.py)."""
  given = {"steps": job.steps, "tokens": job.tokens, "optimizer": job.optimizer, "devices": job.devices}
  return job.options | {k: v for k, v in given.items() if k in entry.takes}

def at_step(entry:Entry, step:int) -> dict[str, Tensor]:
  """The step, for an estimator that names it: a float32 scalar in a buffer of its own, so that a schedule computed from
  it is data of the kernels, not a constant compiled into them."""
  return {"step": engine.tensor(np.array(step, np.float32))} if "step" in entry.takes else {}
