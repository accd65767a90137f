"""Dust (docs/dust.md §3): a gradient estimate from forward passes only, by perturbing layer *outputs* token by token.

For a linear map y_t = W x_t the weight gradient is sum_t g_t x_t^T with g_t = dloss_t/dy_t. Dust estimates only g_t, by
jittering y_t with sigma * a_t and regressing each token's own loss change on a_t: one batched forward evaluates one draw
at every token at once. The exact outer product with the cached input x_t then gives the weight gradient (§3.1, §3.8).
All noise is a pure function of a chunk key, regenerated wherever it is needed and never kept (docs/design.md principle 1).

The looped model applies one weight-tied block at every loop. A draw jitters a block site at all loops at once, each loop with
its own noise (the model folds the site's key with the loop index), and each loop's error is regressed on that loop's noise
only: the other loops' jitters are independent of it, so they add variance but no bias. A tied weight's gradient is then the
sum over loops of the outer products with that loop's input. This needs the clean pass's activations at *every* loop (the
capture keeps them as `name@i`: 18 d values a token a loop) and an error per site and loop (10 d fp32 values a token a loop),
so Dust's memory grows linearly with the loop count, unlike MeZO/ES (docs/design.md principle 4). Recomputing instead (a clean copy
in every perturbed pass, the outer products formed chunk by chunk) would keep it flat, at more compute and much more code.
"""
from __future__ import annotations
from dataclasses import dataclass, replace
from typing import Any, Callable
import numpy as np
from tinygrad import Tensor, Variable, dtypes
from kernels import batches_chunks
from kernels.attention import moved, mixed, prepare
from kernels.loss import exp_sum, softcap
from kernels.noise import NOISES, fold, runs
from kernels.norm import qk_norm
from devices import device, inputs, replicas, shares
from model import GPTConfig
from registry import POSITIVE, Defaults, Option, Run, estimator
import engine

# ***** the recipe: draws, sigmas and optimizer settings per population (docs/dust.md §3.11, §3.14, §4.1) *****

POPULATIONS = (64, 256, 1024, 4096, 16384)  # the release's SGD cells; AdamW takes any multiple of 256 whose counts split into chunks
NREP = {64: 2, 256: 2, 1024: 8, 4096: 8, 16384: 16}  # draws per chunk; a population between cells takes the one below
KINDS = ("q", "v", "gate", "k", "ve")  # attention internals, in the release's order (§3.5)
QKV = ("q", "k", "v")  # the kinds that qkv_scale multiplies: attention's query, key and value
# 8-block allocations per 256 of population (scale = P / 256): writers, hidden, hubs, embedding; local per block per kind
SGD_W = (38, 32, 16, 10, 6, 4, 2, 2)
SGD = (SGD_W, SGD_W, (6, 6, 4, 2, 2, 2, 2, 2), 10, {"q": 2, "v": 20, "gate": 6, "k": 12, "ve": 8})
SGD_16K_W = (34, 28, 14, 8, 6, 4, 2, 2)  # the release's tuned override at 16k and 10M tokens, with gamma 0.99
SGD_16K_10M = (SGD_16K_W, SGD_16K_W, (12, 10, 8, 4, 4, 4, 4, 4), 10, SGD[4])
# the Noise record's (§3.14): flat over depth, the hidden layer and the hubs at twice the writers, the value embeddings 72
NOISE = ((4,) * 8, (8,) * 8, (8,) * 8, 32, {"q": 2, "v": 20, "gate": 6, "k": 12, "ve": 72})
# P = 64 isn't a multiple of 256, so it has absolute counts [S]
POP64 = ((6, 4, 2, 2, 2, 2, 2, 2), (6, 4, 2, 2, 2, 2, 2, 2), (2,) * 8, 4, {"q": 2, "v": 6, "gate": 2, "k": 4, "ve": 2})
SGD_LR = {"1M": {256: (0.25, 0.95), 1024: (0.225, 0.95), 4096: (0.225, 0.98), 16384: (0.225, 0.98)},  # (lr, momentum)
          "10M": {256: (0.175, 0.95), 1024: (0.25, 0.95), 4096: (0.25, 0.95), 16384: (0.25, 0.95)}}

@dataclass(frozen=True)
class Recipe:
  population:int
  nrep:int                           # draws per chunk: the batch is repeated nrep times in one forward
  writers:tuple[int, ...]            # per block (§3.3)
  hidden:tuple[int, ...]             # per block
  hubs:tuple[int, ...]
  embedding:int
  head:int                           # the head's slab draws (§3.6)
  local:dict[str, tuple[int, ...]]   # kind -> per block draws; gate and ve are 0 off the value-embedding blocks
  gamma:float                        # credit decay of k, v, gate, ve (§3.5)
  gamma0:float                       # credit decay of block 0's direct draws: 0 rewards each token's own loss only (§3.14)
  sigma:dict[str, float | tuple[float, ...]]  # per family; "hubs" per block
  scalar_draws:int
  lr:float                           # matrices and head
  momentum:float                     # SGD momentum, or AdamW's beta1 (its beta2 is 0.95, optim.py)
  group_lr:dict[str, float]          # parameter-name prefix -> lr, for the groups of §4.1 / §3.14
  warmdown:float                     # the fraction of the steps at the end over which the lr falls linearly to zero
  noise:str = "gaussian"             # every draw's distribution (kernels/noise.py NOISES): "gaussian" (§3), or "rademacher", +-1

  def lr_for(self, name:str) -> float: return next((lr for pre, lr in self.group_lr.items() if name.startswith(pre)), self.lr)

def resample(counts:tuple[int, ...], n:int, unit:int) -> tuple[int, ...]:
  """Spread an 8-block allocation over n blocks, keeping its total and multiples of `unit`. The counts are read as a density
  over depth and block j gets the mass of [j/n, (j+1)/n): contiguous group sums for n < 8 (exact when n divides 8), a split
  of each old block for n > 8. Shares are rounded to units by largest remainder, with at least one unit per block where the total
  allows it (a block without draws would never learn)."""
  if n == len(counts): return counts
  mass = np.interp(np.arange(n + 1) * len(counts) / n, np.arange(len(counts) + 1), np.concatenate([[0], np.cumsum(counts)]))
  share = np.diff(mass) / unit
  total, least = round(share.sum()), 1 if share.sum() >= n else 0
  units = np.maximum(np.floor(share + 1e-9), least)
  while units.sum() > total: units[np.argmax(np.where(units > least, units - share, -np.inf))] -= 1
  while units.sum() < total: units[np.argmax(share - units)] += 1
  return tuple(int(u) * unit for u in units)

def recipe(population:int, budget:str="1M", optimizer:str="sgd", n_layer:int=8, noise:str="gaussian",
           direct_scale:float=1.0, qkv_scale:float=1.0) -> Recipe:
  """The release's SGD recipe for its populations and budgets (§3.11, §4.1), or under Adam(W) the Noise record's (§3.14) at any
  population that is a multiple of 256: every count per 256 of population, sigmas doubled, block 0 rewarded by a reward-to-go,
  AdamW with the lr flat for 70% of the steps. The 8-block counts are spread over n_layer blocks, keeping their totals. `noise`:
  Gaussian draws, as the release's, or Rademacher (+-1: the same mean and variance, lighter tails, and cheaper to generate).
  `direct_scale` multiplies the direct draws (writers, hidden, hubs, embedding) and nothing else, each count still a whole number
  of chunks: 1.5 with the head's exact errors (`head_exact`) spends about the time that the head's draws took. `qkv_scale` multiplies
  the attention internals' q, k and v draws (§3.5), each count still a whole number of chunks. Neither scale is the release's."""
  if budget not in SGD_LR: raise ValueError(f"Dust recipes exist for budgets {', '.join(SGD_LR)}, not {budget!r}")
  if optimizer not in ("sgd", "adam", "adamw"): raise ValueError(f"unknown optimizer {optimizer!r}: sgd or adam")
  if noise not in NOISES: raise ValueError(f"unknown noise {noise!r}: {' or '.join(NOISES)}")
  adam = optimizer != "sgd"
  if adam and (population < 256 or population % 256):
    raise ValueError(f"Dust's AdamW recipe counts its draws per 256 of population: the population must be a multiple of 256, not {population}")
  if not adam and population not in POPULATIONS:
    raise ValueError(f"Dust supports populations {', '.join(map(str, POPULATIONS))}, not {population}")
  nrep = NREP[max(p for p in NREP if p <= population)]
  base = NOISE if adam else POP64 if population == 64 else SGD_16K_10M if (population, budget) == (16384, "10M") else SGD
  scale = 1 if base is POP64 else population / 256  # POP64's counts are absolute
  direct = scale * direct_scale
  writers, hidden, hubs = (resample(tuple(round(c * direct) for c in b), n_layer, nrep) for b in base[:3])
  has_ve = GPTConfig(n_layer=n_layer).has_ve
  lr, momentum = (0.0015, 0.7) if adam else SGD_LR[budget][max(population, 256)]  # P = 64 takes P = 256's settings [S]
  sigma = 2 if adam else 1  # under Adam every jitter is doubled (§3.14)
  times = {kind: scale * (qkv_scale if kind in QKV else 1) for kind in base[4]}  # each attention kind's multiple of its count
  r = Recipe(population=population, nrep=nrep, writers=writers, hidden=hidden, hubs=hubs, embedding=round(base[3] * direct),
             head=(3 if adam else 4) * population,
             local={kind: tuple(round(c * times[kind]) if kind not in ("gate", "ve") or has_ve(l) else 0 for l in range(n_layer))
                    for kind, c in base[4].items()},
             gamma=0.99 if base is SGD_16K_10M else 0.98, gamma0=0.3 if adam else 0.0,
             # the record's embedding is 0.8: four times the release's, twice the paper's Adam recipe (§3.14)
             sigma={"writers": 0.2 * sigma, "hidden": 0.2 * sigma, "embedding": 0.8 if adam else 0.2, "head": 0.05 * sigma,
                    "local": 0.05 * sigma, "scalars": 0.03 * sigma,
                    # the deeper half of the hubs moves the loss too little at 0.2
                    "hubs": tuple((0.2 if 2 * l < n_layer else 0.4) * sigma for l in range(n_layer))},
             scalar_draws=8, lr=lr, momentum=momentum,
             group_lr={"transformer.wte": 300 * lr, "value_embeds": 300 * lr, "resid_lambdas": 30 * lr, "x0_lambdas": 30 * lr} if adam else
                      {"transformer.wte": 1000.0, "value_embeds": 0.3, "resid_lambdas": 0.03, "x0_lambdas": 0.03},
             warmdown=0.3 if adam else 0.0, noise=noise)
  counts = [*r.writers, *r.hidden, *r.hubs, r.embedding, *(c for v in r.local.values() for c in v)]
  scaled = [f"its {draws} draws scaled by {x}" for draws, x in (("direct", direct_scale), ("q, k, v", qkv_scale)) if x != 1]
  what = f"population {population}" + (f" with {' and '.join(scaled)}" if scaled else "")
  if any(c % nrep for c in counts) or r.head % (nrep * 16):  # §3.9, world 1
    raise ValueError(f"{what}: its draw counts don't split into chunks of {nrep} draws (and the head's into 16 slabs of them)")
  # a site without draws would never learn
  if direct_scale < 1 and 0 in (*r.writers, *r.hidden, *r.hubs, r.embedding): raise ValueError(f"{what}: a block or the embedding gets none")
  if qkv_scale < 1 and 0 in (c for kind in QKV for c in r.local[kind]): raise ValueError(f"{what}: a block gets no q, k or v draws")
  return r

def forwards(rc:Recipe) -> float:
  """The network forwards an update's arithmetic needs: the clean capture, each direct draw's rerun from its block ((L - l)/L of the
  blocks at block l of L; all of them for the embedding), and two full forwards per scalar draw. The head's and the attention
  internals' draws rerun no network (a slab of the cached logits; one attention), so they count as none."""
  L = len(rc.writers)
  return 1 + rc.embedding + 2 * rc.scalar_draws + sum((w + h + u) * (L - l) / L for l, (w, h, u) in enumerate(zip(rc.writers, rc.hidden, rc.hubs)))

# ***** keys and the chunk loop *****

GROUPS = ("writers", "hidden", "embedding", "hubs", "head", *KINDS, "scalars")
# bound at each JIT call: kernel arguments, not constants, so that every group and block runs the same compiled kernels (engine.py)
GROUP, BLOCK = Variable("group", 0, len(GROUPS)), Variable("block", 0, 1 << 16)

@dataclass(frozen=True)
class Draws:
  """Chunks `chunks` of a group's draws at a block: chunk c's key is fold(key, group, block, c) (sites fold once more)."""
  key:Tensor  # the step's key, on the device that runs the draws
  group:int   # the index in GROUPS
  block:int
  chunks:range
  noise:str = "gaussian"  # their distribution

# A Dust JIT call batches as many chunks of draws as hold this many tokens together: the dust preset's chunk (8 draws of 8 x 2048),
# which fills an H200, so one chunk a call there and 8 at the small preset's 8 x 256, where a call of one chunk had cost more host
# time than its kernels (771 calls a pop-1024 update: 4.8 s of host time on the NULL device, 2 cores). One a call on the CPU
# (kernels/__init__.py's table).
TOKENS = 131072

def keyed(model, c:Tensor, key:Tensor, group, block, *inputs, chunk:Callable[..., list[Tensor]], unit:int|None, **static) -> list[Tensor]:
  """chunk(model, keys, *inputs, **static) for the chunks c, keys = fold(key, group, block, c): [G, 2], or [G, unit, 2] in runs."""
  keys = fold(key, Tensor(group), Tensor(block), c.cast(dtypes.uint32))
  return chunk(model, keys if unit is None else keys.reshape(-1, unit, 2), *inputs, **static)

def mean_of(chunk:Callable[..., list[Tensor]], model, shapes:list[tuple[int, ...]], draws:Draws, tokens:int, *inputs,
            unit:int|None=None, **static) -> list[Tensor]:
  """The mean per draw of chunk(model, keys, *inputs, **static) over the draws' chunks, of `tokens` tokens and `nrep` draws each (one
  without an nrep): G chunks a call (or G runs of `unit` chunks), G the most that divide the runs and hold at most TOKENS tokens on a
  GPU (one on the CPU). The weights are no input: the JIT reads them from the model, where the optimizer updates them in place."""
  n = len(draws.chunks) // (unit or 1)
  K = static.get("nrep", 1) * n  # the draws behind each estimate (the head's: each slab gets one chunk of a cycle of `unit`)
  G = engine.per_call(n, tokens, TOKENS if batches_chunks(draws.key.device) else 0)
  return engine.mean(keyed, model, draws.key, GROUP.bind(draws.group), BLOCK.bind(draws.block), *inputs, chunks=draws.chunks,
                     per_call=G * (unit or 1), count=K, shapes=shapes, chunk=chunk, unit=unit, noise=draws.noise, **static)

def tile(t:Tensor, n:int) -> Tensor: return t.repeat((n,) + (1,) * (t.ndim - 1))  # n copies along the batch: one per draw

# ***** direct draws: writers, hidden, embedding, hubs (§3.3, §3.4) *****

def recorded(model, site:str, depth:int|None) -> str:
  """The capture's name of a site's output at a depth: the site itself, or `site@i` at loop i of the looped model."""
  return site if depth is None else site + model.tag(depth)

def direct(model, x:Tensor, y:Tensor, rec:dict[str, Tensor], sites:tuple[str, ...], sigma:float, draws:Draws, nrep:int,
           rerun:str="block", depths:tuple[int|None, ...]=(None,), gamma:float=0.0) -> dict[str, Tensor]:
  """Jitter all sites of a group at once, each with its own noise, and reward every token with its own loss drop, centred across
  the chunk's draws (with `gamma` > 0, its reward-to-go: the drops of the later tokens too, discounted). Returns the per-token
  estimate ĝ_t = −1/(σK) Σ_i r̃_t^(i) a_t^(i) of +dloss_t/dy_t per site (K draws a_t^(i), §3.1), [B, T, width]: mean_of divides by
  K. `rerun="block"` starts each perturbed pass at the jittered block from the captured activations (§3.10), "full" reruns the
  whole model.
  `depths`: where the sites' block is applied, several in the looped model. Its sites are jittered at all of them in the same
  pass, with the noise model.site_key(key, depth), and the result has one estimate per depth, keyed by `recorded` names."""
  B, T = y.shape[:2]
  outs = tuple((j, d, rec[recorded(model, sites[j], d)].shape[-1]) for j in range(len(sites)) for d in depths)
  stream = model.rerun_stream(rec, sites) if rerun == "block" else {}
  E = mean_of(direct_chunk, model, [(B, T, w) for _, _, w in outs], draws, nrep * B * T, x, y, stream,
              sites=sites, sigma=sigma, nrep=nrep, outs=outs, rerun=rerun, gamma=gamma)
  return {recorded(model, sites[j], d): e for (j, d, _), e in zip(outs, E)}

def direct_chunk(model, k:Tensor, x:Tensor, y:Tensor, stream:dict[str, Tensor], sites:tuple[str, ...], sigma:float, nrep:int,
                 outs:tuple[tuple[int, int|None, int], ...], rerun:str, gamma:float, noise:str) -> list[Tensor]:
  """G chunks of `direct` in one pass (k: their keys [G, 2]), nrep draws each, one per copy of the batch; outs lists (site index,
  depth, width) of the estimates."""
  B, T, G = *y.shape[:2], k.shape[0]
  ks = [fold(k, i) for i in range(len(sites))]
  loss = model.losses(tile(x, G * nrep), tile(y, G * nrep), {s: (ki, sigma, noise) for s, ki in zip(sites, ks)},
                      stream if rerun == "block" else None).reshape(G, nrep, B, T)
  # r_i - mean_j r_j over the chunk's draws, with r = loss0 - loss: loss0 cancels; the draw in its own baseline shrinks by (n-1)/n
  reward = loss.mean(1, keepdim=True) - loss
  if gamma: reward = reward_to_go(reward, gamma)
  def drawn(j:int, d:int|None, w:int) -> Tensor:  # the noise the model added at site j, depth d
    return runs(ks[j] if d is None else model.site_key(ks[j], d), (G * nrep * B, T, w), noise).reshape(G, nrep, B, T, w)
  return [-(reward.unsqueeze(-1) * drawn(j, d, w)).sum((0, 1)) / sigma for j, d, w in outs]  # −1/σ Σ_i r̃ a, of K's sum

def reward_to_go(c:Tensor, gamma:float) -> Tensor:
  """r_t = sum_{s>=t} gamma^(s-t) c_s along the last axis (tokens): block 0's jitter pays off mostly at later tokens (§3.12)."""
  T = c.shape[-1]
  return c @ credit(T, T, gamma).T

# ***** output head: the slab trick on the cached logits (§3.6) *****

def head_error(model, rec:dict[str, Tensor], y:Tensor, sigma:float, draws:Draws, nrep:int) -> Tensor:
  """Chunk m jitters slab m mod S (256 raw-logit columns) and recomputes the loss from cached slab sums: no network rerun, and each
  reward reflects only 256 columns. A vocab that isn't a multiple of 256 is one slab of its own width."""
  z = rec["lm_head"].float()
  B, T, V = z.shape
  S = slabs(model)
  W = V // S
  assert len(draws.chunks) % S == 0, f"{len(draws.chunks)} head chunks don't cycle evenly over {S} slabs"
  c, hit = softcap(z, model.cfg.softcap), (y.unsqueeze(-1) == Tensor.arange(V)).float()
  slab_sum = exp_sum(c.reshape(B, T, S, W))  # |c| <= cap, so exp needs no max-subtraction
  c_y = (c * hit).sum(-1)
  clean = {"z": z.reshape(B, T, S, W), "slab_sum": slab_sum, "c_y": c_y, "loss0": slab_sum.sum(-1).log() - c_y}
  Tensor.realize(*clean.values())
  # a cycle over the slabs at least a call: the head's chunks are too short for one each
  (E,) = mean_of(head_chunk, model, [(B, T, S, W)], draws, S * nrep * B * T, clean, y, unit=S, sigma=sigma, nrep=nrep)
  return E.reshape(B, T, V)

def slabs(model) -> int: return model.cfg.vocab // 256 if model.cfg.vocab % 256 == 0 else 1

def head_chunk(model, ks:Tensor, clean:dict[str, Tensor], y:Tensor, sigma:float, nrep:int, noise:str) -> list[Tensor]:
  """G cycles of S chunks of `head_error` (ks [G, S, 2]), the G chunks on slab m keyed ks[:, m]; clean: the capture's raw logits z
  as [B, T, S, W] slabs, and the softcapped logits' exp-sums per slab, target logit and loss."""
  B, T, S, W = clean["z"].shape
  slab_sum = clean["slab_sum"]
  def slab(m:int) -> Tensor:
    a = NOISES[noise](ks[:, m], (nrep, B, T, W)).reshape(-1, B, T, W).contiguous()  # materialized once: three reductions read it
    c2 = softcap(clean["z"][:, :, m] + sigma * a, model.cfg.softcap).contiguous()
    col = (y - m * W).unsqueeze(-1) == Tensor.arange(W)  # the target's column, where it is in this slab
    target = (y // W == m).where(col.where(c2, 0).sum(-1), clean["c_y"])
    reward = clean["loss0"] - ((slab_sum.sum(-1) - slab_sum[:, :, m] + exp_sum(c2)).log() - target)
    if B > 1: reward = reward - reward.mean(1, keepdim=True)  # centred across the batch at each draw and position, not across draws
    return -(reward.unsqueeze(-1) * a).sum(0) / sigma
  return [Tensor.stack(*[slab(m).realize() for m in range(S)], dim=2)]  # a slab at a time: one slab's draws in memory

def head_exact(model, z:Tensor, y:Tensor) -> Tensor:
  """`head="exact"`: the head's per-token errors without draws. The head's output is the loss's own input, so its derivative needs
  no backward pass: with c = cap tanh(z / cap), dloss_t/dz_t = (softmax(c_t) − onehot(y_t)) (1 − (c_t / cap)²), from the clean
  forward's raw logits z alone. Not the release's, which estimates it from slabs (§3.6)."""
  c = softcap(z.float(), model.cfg.softcap)
  return (c.softmax(-1) - y.one_hot(z.shape[-1]).float()) * (1 - (c / model.cfg.softcap).square())

# ***** attention internals: local errors against the hub targets (§3.5) *****

def error_site(kind:str, l:int) -> str: return f"value_embeds.{l}" if kind == "ve" else f"transformer.h.{l}.attn." + \
  {"q": "c_q", "k": "c_k", "v": "c_v", "gate": "ve_gate"}[kind]

def gate(z:Tensor) -> Tensor: return 2 * z.sigmoid()

def local_kinds(model, i:int) -> list[str]:  # gate and ve only where depth i has value embeddings (the looped model never has)
  return [kind for kind in KINDS if kind in ("q", "k", "v") or model.has_ve(i)]

class CleanAttention:
  """The clean attention at a depth, heads split, tokens first: raw q, k [B, T, H, hd]; processed q^, k^, values u = v + gate e (and
  the gate's logits z, the value embedding e); and what the draws read besides (kernels/attention.prepare). A draw recomputes only
  this attention, never the network: for q and k, o' - o (kernels/attention.moved); for v, gate and ve, which move only u, p du
  (kernels/attention.mixed). Nothing in it depends on the depth but the attention's window and which records it has (gate and ve
  where the depth has value embeddings): its JITs are keyed by both, so depths alike share their captures. `t` holds the tensors,
  so that a JIT can take them as inputs."""
  def __init__(self, model, window:int, t:dict[str, Tensor]): self.model, self.window, self.t = model, window, t

  @classmethod
  def capture(cls, model, rec:dict[str, Tensor], i:int) -> CleanAttention:
    """From the clean pass's records of q, k, v (and gate, ve) at depth i (block i of the GPT, loop i of the looped model), as a JIT
    that lives across steps: eagerly, the graphs of the 8 depths cost about as much host time as the clean capture's (see Worker).
    Its tensors are the JIT's outputs, which the next depth with the same window and records writes again, and `jit.release()` frees
    when the depth is done: nothing may keep them past their depth."""
    records = {kind: rec[recorded(model, error_site(kind, model.pblock(i)), i)] for kind in local_kinds(model, i)}
    jit = engine.jit(clean_attention, model, window=model.window(i))
    att = cls(model, model.window(i), jit(records))
    att.jit = jit
    return att

  def heads(self, t:Tensor) -> Tensor: return t.float().reshape(*t.shape[:2], self.model.cfg.n_head, -1)
  def hat(self, t:Tensor) -> Tensor:  # RoPE then QK-norm, as the model does, in float32
    return qk_norm(t, self.model.cos[:t.shape[1]], self.model.sin[:t.shape[1]], dtypes.float32)

  def delta(self, kind:str, a:Tensor, sigma:float, n:int) -> Tensor:
    """The change of the attention output when every token's `kind` moves by sigma a (a: [n B, T, H(, hd)]), all outputs at once."""
    t = self.t
    if kind in ("q", "k"): return moved(t, t["qh"], t["kh"], t["u"], self.hat(tile(t[kind], n) + sigma * a), kind, self.window)
    z, e = (tile(t[name], n) if name in t else None for name in ("z", "e"))
    du = {"v": lambda: sigma * a, "ve": lambda: sigma * a * gate(z).unsqueeze(-1),  # exact by linearity in u
          "gate": lambda: (gate(z + sigma * a) - gate(z - sigma * a)).unsqueeze(-1) * e}[kind]()
    return mixed(t, du, self.window)

def clean_attention(model, records:dict[str, Tensor], window:int) -> dict[str, Tensor]:
  """CleanAttention's tensors at a depth, from the clean pass's records of q, k, v (and gate, ve). Run as a JIT, from copies of the
  records: its outputs must own their buffers, as a view of an input would show the input of the call that the JIT captured."""
  att, r = CleanAttention(model, window, {}), {kind: t.float().clone() for kind, t in records.items()}
  t = {kind: att.heads(r[kind]) for kind in ("q", "k")}
  u = att.heads(r["v"])
  if "ve" in r: t["z"], t["e"] = r["gate"], att.heads(r["ve"])
  t["u"] = u + gate(t["z"]).unsqueeze(-1) * t["e"] if "ve" in r else u
  t["qh"], t["kh"] = att.hat(t["q"]), att.hat(t["k"])
  return t | prepare(t["qh"], t["kh"], t["u"], att.window, model.dtype)

def credit(T:int, window:int, gamma:float) -> Tensor:
  """C[t, s] = gamma^(s-t) for 0 <= s-t <= window: the reward-to-go of a perturbation at t over the outputs s it reaches."""
  lag = Tensor.arange(T).reshape(1, T) - Tensor.arange(T).reshape(T, 1)
  return ((lag >= 0) & (lag <= window)).where(gamma ** lag.float(), 0.0).contiguous()  # not recomputed inside the matmul that reads it

def local_error(att:CleanAttention, kind:str, target:Tensor, sigma:float, gamma:float, draws:Draws, nrep:int) -> Tensor:
  """Score each draw by <target_s, delta o_s> per head, a first-order stand-in for the loss increase (so no minus sign and no
  centring); q keeps its own token's score, the others a discounted sum over later outputs. Returns [B, T, H*hd] or [B, T, H]."""
  B, T, H, hd = att.t["q"].shape
  return mean_of(local_chunk, att.model, [(B, T, H if kind == "gate" else H * hd)], draws, nrep * B * T, att.t, target.realize(),
                 kind=kind, window=att.window, sigma=sigma, gamma=gamma, nrep=nrep)[0]

def local_chunk(model, k:Tensor, clean:dict[str, Tensor], target:Tensor, kind:str, window:int, sigma:float, gamma:float, nrep:int,
                noise:str) -> list[Tensor]:
  """G chunks of `local_error` (k: their keys [G, 2]), n = G nrep draws in all, one per copy of the batch."""
  att, n = CleanAttention(model, window, clean), k.shape[0] * nrep
  B, T, H, hd = clean["q"].shape
  shape, divisor = ((nrep * B, T, H), 2 * sigma) if kind == "gate" else ((nrep * B, T, H, hd), sigma)  # the gate is two-sided
  a = NOISES[noise](fold(k, 0), shape).reshape(n * B, *shape[1:])
  score = (att.delta(kind, a, sigma, n) * tile(target.reshape(B, T, H, hd), n)).sum(-1)  # [n B, T, H]
  # R realized: for the gate (no head dim), tinygrad fused the credit matmul into the sum over draws below, a kernel that took 9.7 and
  # 8.4 s to lower and compile at the two windows, against 1.8 and 0.8 s for the two kernels now (the H200's kernels on 2 CPU cores)
  R = score if kind == "q" else (credit(T, att.window, gamma) @ score).contiguous()
  return [(R.unsqueeze(-1) * a if kind != "gate" else R * a).reshape(n, B, T, -1).sum(0) / divisor]

# ***** residual-mix scalars: two-sided weight-space ES (§3.7) *****

def scalar_es(model, x:Tensor, y:Tensor, sigma:float, draws:Draws) -> dict[str, Tensor]:
  """Per draw, the summed token loss at lambda +- sigma a; returns the estimate of dsum(loss)/dlambda (§3.8 divides by N)."""
  L = model.params[SCALARS[0]].shape[0]
  E = mean_of(scalar_chunk, model, [(L,), (L,)], draws, 2 * x.numel(), x, y, sigma=sigma)
  return dict(zip(SCALARS, E))

SCALARS = ("resid_lambdas", "x0_lambdas")
def scalar_chunk(model, k:Tensor, x:Tensor, y:Tensor, sigma:float, noise:str) -> list[Tensor]:
  """G draws (k: their keys [G, 2]) as G members of one forward per sign, each member with its own scalars [G, L]."""
  params, G = model.params, k.shape[0]
  L = params[SCALARS[0]].shape[0]
  a = NOISES[noise](fold(k, 0), (2 * L,))
  def loss(sign:int) -> Tensor:
    moved = {n: (params[n] + sign * sigma * a[:, i * L:(i + 1) * L]).contiguous() for i, n in enumerate(SCALARS)}  # not re-hashed per use
    return model.losses(tile(x, G), tile(y, G), params=params | moved).reshape(G, -1).sum(1)
  slope = ((loss(1) - loss(-1)) / (2 * sigma)).unsqueeze(1)
  return [(slope * a[:, :L]).sum(0), (slope * a[:, L:]).sum(0)]

# ***** reassembly and the estimator (§3.2, §3.8) *****

def weight_grad(err:Tensor, inp:Tensor, shape:tuple[int, ...]) -> Tensor:
  """Per-token output errors to the weight gradient of the mean loss: the outer product with the module's cached input summed over
  tokens, or for an embedding a scatter-add of the errors into the rows of the token ids (a one-hot matmul); / token count."""
  n, err = err.shape[0] * err.shape[1], err.reshape(-1, err.shape[-1])
  if dtypes.is_int(inp.dtype): return (inp.reshape(-1, 1) == Tensor.arange(shape[0])).float().T @ err / n
  return err.T @ inp.float().reshape(-1, shape[1]) / n

def clean_capture(model, x:Tensor, y:Tensor) -> tuple[Tensor, dict[str, Tensor]]:
  """model.capture without the embeddings' inputs, which are the batch x itself: a JIT returns the tensors of the call it captured,
  so at every replay those entries would hold that call's batch."""
  loss, rec = model.capture(x, y)
  return loss, {n: t for n, t in rec.items() if t is not x}

def embeddings(model) -> list[str]:  # the sites whose input is the batch of token ids
  return ["transformer.wte", *[f"value_embeds.{i}" for i in range(model.n_blocks) if model.has_ve(i)]]

class Worker:
  """One device's part of a step: the model (or its replica on that device), the batch, and the clean capture that every estimate
  of the step reads. Each device captures its own: a clean forward costs less than copying the activations."""
  def __init__(self, model, x:Tensor, y:Tensor, key:Tensor):
    self.model, self.x, self.y, self.key = model, x, y, key
    self.capture = engine.jit(clean_capture, model)  # a JIT: eagerly, its graph cost more host time than its kernels take
    self.loss, rec = self.capture(x, y)
    self.rec = rec | {f"{site}:in": x for site in embeddings(model)}
    self.attn:CleanAttention|None = None  # the depth that the local draws are at
    self.targets:dict[int, Tensor] = {}   # the hub errors, the local draws' targets, on this device

def across(work:list[Worker], draws:Draws, run:Callable[[Worker, Draws], Any], unit:int=1) -> Any:
  """run(worker, its share of the draws' chunks) on every device that gets a share; each result is a mean over its share, so their
  mean weighted by share size, on the first device, is the estimate of all the chunks. Shares are whole multiples of `unit` chunks
  (the head's slab cycle). Every device's work is launched before any result is read, so GPUs work at the same time."""
  dev, parts, n = work[0].x.device, [], len(draws.chunks)
  for w, r in zip(work, shares(n // unit, len(work))):
    mine = replace(draws, key=w.key, chunks=draws.chunks[r.start * unit:r.stop * unit])
    if len(r): parts.append((len(r) * unit / n, run(w, mine)))
  def mean(ps:list[tuple[float, Any]]) -> Any:
    if isinstance(ps[0][1], dict): return {k: mean([(f, p[k]) for f, p in ps]) for k in ps[0][1]}
    return ps[0][1].to(dev) if len(ps) == 1 else sum(f * p.to(dev) for f, p in ps)
  return mean(parts)

class Update:
  """What one update's steps share: the model, a Worker per device (the batch and its clean capture, §3.2: the first step), the
  recipe, and how direct draws rerun the network."""
  def __init__(self, model, x:Tensor, y:Tensor, key:Tensor, rc:Recipe, rerun:str, devices:int):
    self.model, self.rc, self.rerun, self.y = model, rc, rerun, y
    self.work = [Worker(m, *inputs(m, x, y, key)) for m in replicas(model, devices)]

  def draws(self, group:str, block:int, n:int) -> Draws:
    return Draws(self.work[0].key, GROUPS.index(group), block, range(n // self.rc.nrep), self.rc.noise)
  def depths(self, l:int) -> tuple[int, ...]:  # where parameter block l is applied: (l,) in the GPT, every loop in the looped model
    return tuple(i for i in range(self.model.n_blocks) if self.model.pblock(i) == l)

  def group(self, name:str, l:int|None, sites:tuple[str, ...], sigma:float, n:int) -> dict[tuple[str, int|None], Tensor]:
    """n direct draws of a group's sites: their per-token errors, keyed by (site, depth); l is the parameter block, None outside."""
    if not n: return {}
    ds, model, nrep, gamma = (None,) if l is None else self.depths(l), self.model, self.rc.nrep, self.rc.gamma0 if l == 0 else 0.0
    e = across(self.work, self.draws(name, 0 if l is None else l, n),
               lambda w, d: direct(w.model, w.x, w.y, w.rec, sites, sigma, d, nrep, self.rerun, ds, gamma))
    return {(site, d): e[recorded(model, site, d)] for site in sites for d in ds}

def direct_draws(u:Update) -> dict[tuple[str, int|None], Tensor]:
  """§3.3: writers then hidden, block by block; then the embedding."""
  rc, err = u.rc, {}
  for l in range(u.model.n_pblocks):
    pre = f"transformer.h.{l}"
    err |= u.group("writers", l, (f"{pre}.attn.c_proj", f"{pre}.mlp.c_proj"), rc.sigma["writers"], rc.writers[l])
    err |= u.group("hidden", l, (f"{pre}.mlp.c_fc",), rc.sigma["hidden"], rc.hidden[l])
  return err | u.group("embedding", None, ("transformer.wte",), rc.sigma["embedding"], rc.embedding)

def attention_draws(u:Update) -> dict[tuple[str, int|None], Tensor]:
  """§3.4-3.5: the attention outputs' errors (hubs, o@ per depth: targets only, no weight of their own), then the attention internals
  scored against them, depth by depth (each loop of the looped model against its own target), so that one depth's attention is
  held at a time."""
  rc, model, err = u.rc, u.model, {}
  targets = {d: t for l in range(model.n_pblocks) for (_, d), t in u.group("hubs", l, (f"o@{l}",), rc.sigma["hubs"][l], rc.hubs[l]).items()}
  # copied to every device before any local work is queued: a copy out of a device waits for all the work queued on it
  for w in u.work: w.targets = {i: t.to(w.x.device).realize() for i, t in targets.items()}
  for i in targets:
    for w in u.work: w.attn = CleanAttention.capture(w.model, w.rec, i)
    for kind in local_kinds(model, i):  # the recipe for n_layer=1 allots gate and ve draws, which the looped model can't use
      if n := rc.local[kind][model.pblock(i)]:
        err[error_site(kind, model.pblock(i)), i] = across(u.work, u.draws(kind, i, n), lambda w, d, kind=kind, i=i:
                                                           local_error(w.attn, kind, w.targets[i], rc.sigma["local"], rc.gamma, d, rc.nrep))
    for w in u.work: w.attn.jit.release()
  return err

def head_draws(u:Update, head:str) -> Tensor:
  """§3.6: the head's per-token errors, from slabs of the cached logits; or exact (`head_exact`), with no draws."""
  if head == "exact": return engine.jit(head_exact, u.model)(u.work[0].rec["lm_head"], u.work[0].y)
  return across(u.work, u.draws("head", 0, u.rc.head), lambda w, d: head_error(w.model, w.rec, w.y, u.rc.sigma["head"], d, u.rc.nrep),
                unit=slabs(u.model))

def scalar_draws(u:Update) -> dict[str, Tensor]:
  """§3.7: the residual-mix scalars' gradient, by two-sided weight-space ES: a chunk a draw, on 16 weights."""
  one_each = Draws(u.work[0].key, GROUPS.index("scalars"), 0, range(u.rc.scalar_draws), u.rc.noise)
  return {n: g / u.y.numel() for n, g in across(u.work, one_each, lambda w, d: scalar_es(w.model, w.x, w.y, u.rc.sigma["scalars"], d)).items()}

def reassemble(u:Update, err:dict[tuple[str, int|None], Tensor], scalars:dict[str, Tensor]) -> tuple[dict[str, Tensor], Tensor]:
  """§3.8: each weight's gradient from its sites' per-token errors and cached inputs, and the clean mean loss, as one JIT: eagerly,
  scheduling its ~50 outer products took 1.1 s of a small-preset update's 2.6 s of host time (NULL device, 2 cores). It writes into
  buffers allocated here, so the estimate is the caller's to keep: a JIT's own outputs would be overwritten by the next step."""
  model, rec = u.model, u.work[0].rec
  out, mean = {n: engine.empty(*p.shape, device=p.device) for n, p in model.params.items()}, engine.empty(device=u.y.device)
  inputs = [rec[recorded(model, s + ":in", d)] for s, d in err]
  engine.jit(gradients, model, sites=tuple(err))(list(err.values()), inputs, scalars, u.work[0].loss, out, mean)
  for w in u.work: w.capture.release()
  return out, mean

def gradients(model, errs:list[Tensor], inputs:list[Tensor], scalars:dict[str, Tensor], loss:Tensor, out:dict[str, Tensor], mean:Tensor,
              sites:tuple[tuple[str, int|None], ...]):
  """The outer products of §3.8 into `out`: a weight used at several depths (tied across loops) sums them; a block without draws
  gets zeros (no update)."""
  grads = dict(scalars)
  for (s, _), e, inp in zip(sites, errs, inputs):
    n, g = f"{s}.weight", weight_grad(e, inp, model.params[f"{s}.weight"].shape)
    grads[n] = grads[n] + g if n in grads else g
  Tensor.realize(*[o.assign(grads[n] if n in grads else o.zeros_like()) for n, o in out.items()], mean.assign(loss.mean()))

def budget(tokens:int) -> str:
  """The release tuned its recipes for runs of 1M and 10M tokens: a run takes the nearer one on a log scale (10M above 3.16M)."""
  return "10M" if tokens > np.sqrt(1e6 * 1e7) else "1M"

def run_recipe(run:Run) -> Recipe:
  """The run's recipe; a --direct-scale or --qkv-scale whose counts don't split into chunks is named in the error, a fault of the
  population or the optimizer itself reported as such."""
  o = run.options
  def make(direct:float, qkv:float) -> Recipe:
    return recipe(run.pop, budget(run.tokens), run.optimizer, run.model.n_pblocks, o["noise"], direct_scale=direct, qkv_scale=qkv)
  try: return make(o["direct_scale"], o["qkv_scale"])
  except ValueError as e:
    make(1.0, 1.0)
    raise ValueError(" ".join(f"--{n.replace('_', '-')} {o[n]}" for n in ("direct_scale", "qkv_scale") if o[n] != 1) + f": {e}") from None

def check(run:Run):
  """The run's recipe exists, and the kernels can number every group's chunks: a call's first chunk is bound to engine.START, and
  the last call of a device's share, of G chunks (or runs of the head's slabs), starts G before its end."""
  rc, tokens = run_recipe(run), run.tokens // run.steps  # a step's tokens
  cap, S = TOKENS if batches_chunks(device(run.model)) else 0, slabs(run.model)
  counts = [*rc.writers, *rc.hidden, *rc.hubs, rc.embedding, *(c for v in rc.local.values() for c in v)]
  groups = [(c // rc.nrep, rc.nrep * tokens, 1) for c in counts] + [(rc.head // rc.nrep, S * rc.nrep * tokens, S)] * (run.options["head"] == "slabs")
  if (n := max(n - engine.per_call(len(shares(n // u, run.devices)[-1]), t, cap) * u for n, t, u in groups)) > engine.START.vmax:
    raise ValueError(f"--pop {run.pop}: Dust's kernels number a group's chunks of draws up to {engine.START.vmax + 1:,}, and one starts a "
                     f"call at {n:,}")

def defaults(run:Run) -> Defaults:  # the recipe's optimizer settings (docs/dust.md §4): its groups' lrs as multiples of its base lr
  rc = run_recipe(run)
  return Defaults(lr=rc.lr, momentum=rc.momentum, groups={p: lr / rc.lr for p, lr in rc.group_lr.items()}, warmdown=rc.warmdown)

@estimator("dust", defaults=defaults, check=check,
           noise=Option("the distribution of every draw (Rademacher: +-1, the same mean and variance)", choices=tuple(NOISES)),
           head=Option("the head's per-token errors estimated from draws on slabs of the logits (the release's), or exact: "
                       "softmax - one-hot from the clean forward, no draws (docs/dust.md §3.6)", choices=("slabs", "exact")),
           direct_scale=Option("the recipe's direct draws (writers, hidden, hubs, embedding) times this, each count still a whole "
                               "number of chunks (1.5 or 2 at pop 1024); 1.5 with --head exact takes about the time of the recipe's "
                               "step (docs/dust.md §3.6)", check=POSITIVE),
           qkv_scale=Option("the recipe's draws of the attention's q, k and v times this, each count still a whole number of chunks; "
                            "4 with --head exact --direct-scale 1.5 is the race's best (docs/dust.md §3.5)", check=POSITIVE))
def step(model, x:Tensor, y:Tensor, pop:int, key:Tensor, optimizer:str="sgd", tokens:int=10**6, noise:str="gaussian", head:str="slabs",
         direct_scale:float=1.0, qkv_scale:float=1.0, rc:Recipe|None=None, rerun:str="block", devices:int=1) -> tuple[dict[str, Tensor], Tensor]:
  """Per-token node perturbation of the layers' outputs, each weight's gradient the outer product of its outputs' estimated errors
  with its cached inputs. Returns (the estimate, the clean mean loss of the capture pass): docs/dust.md §3's steps in order, with the
  recipe for this population,
  the run's budget of tokens, optimizer, noise, direct_scale and qkv_scale (or `rc`). rerun: "block" starts each perturbed pass at the
  jittered block from the captured activations (§3.10), "full" reruns the whole model. head: "slabs" estimates the head's errors from
  draws (§3.6), "exact" computes them (`head_exact`). devices: split every group's chunks over this many devices. Draws are allocated
  per parameter block (one for the looped model: recipe(..., n_layer=1)); the local attention draws run at every depth, so a looped
  model gets them at every loop. Memory: the capture of every depth's activations."""
  rc = rc or recipe(pop, budget(tokens), optimizer, model.n_pblocks, noise, direct_scale=direct_scale, qkv_scale=qkv_scale)
  u = Update(model, x, y, key, rc, rerun, devices)  # the clean capture
  err = direct_draws(u)
  err |= attention_draws(u)
  err["lm_head", None] = head_draws(u, head)
  return reassemble(u, err, scalar_draws(u))
