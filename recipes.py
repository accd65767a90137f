"""Dust's recipes as data: how many draws each layer family gets, at which sigma, and the optimizer's settings, per
population, budget and optimizer (docs/dust.md §3.11, §3.14, §4.1). dust.py reads a Recipe; nothing here runs a model.

The allocations are per 256 of population (scale = P / 256) over the 8 blocks of the Dust GPT and are spread over other
depths by `resample`. A direct draw count is split into chunks of `per_chunk` draws, so every count is a multiple of it.
"""
from __future__ import annotations
from dataclasses import dataclass
import numpy as np
from kernels.noise import NOISES
from model import GPTConfig

# the release's SGD cells; AdamW takes any multiple of 256 whose counts split into chunks
POPULATIONS = (64, 256, 1024, 4096, 16384)
# draws per chunk; a population between cells takes the one below
PER_CHUNK = {64: 2, 256: 2, 1024: 8, 4096: 8, 16384: 16}
KINDS = ("q", "v", "gate", "k", "ve")  # the attention internals, in the release's order (§3.5)
QKV = ("q", "k", "v")  # the kinds that qkv_scale multiplies: the attention's query, key and value

@dataclass(frozen=True)
class Table:
  """An 8-block allocation: direct draws per block (writers, hidden, hubs), the embedding's, the attention internals'
  per block."""
  writers:tuple[int, ...]
  hidden:tuple[int, ...]
  hubs:tuple[int, ...]
  embedding:int
  local:dict[str, int]

# the release's SGD recipe, per 256 of population (docs/dust.md §3.11)
SGD_WRITERS = (38, 32, 16, 10, 6, 4, 2, 2)
SGD = Table(SGD_WRITERS, SGD_WRITERS, (6, 6, 4, 2, 2, 2, 2, 2), 10, {"q": 2, "v": 20, "gate": 6, "k": 12, "ve": 8})
# the release's tuned override at 16k and 10M tokens, with gamma 0.99 (§3.11)
SGD_16K_WRITERS = (34, 28, 14, 8, 6, 4, 2, 2)
SGD_16K_10M = Table(SGD_16K_WRITERS, SGD_16K_WRITERS, (12, 10, 8, 4, 4, 4, 4, 4), 10, SGD.local)
# the Noise record's AdamW recipe (§3.14): flat over depth, the hidden layer and the hubs at twice the writers, the
# value embeddings 72
ADAMW = Table((4,) * 8, (8,) * 8, (8,) * 8, 32, {"q": 2, "v": 20, "gate": 6, "k": 12, "ve": 72})
# zo's P = 64, absolute counts: 64 isn't a multiple of 256 (§3.11)
POP64_WRITERS = (6, 4, 2, 2, 2, 2, 2, 2)
POP64 = Table(POP64_WRITERS, POP64_WRITERS, (2,) * 8, 4, {"q": 2, "v": 6, "gate": 2, "k": 4, "ve": 2})
# the release's SGD (lr, momentum) per budget and population (§4.1)
SGD_LR = {"1M": {256: (0.25, 0.95), 1024: (0.225, 0.95), 4096: (0.225, 0.98), 16384: (0.225, 0.98)},
          "10M": {256: (0.175, 0.95), 1024: (0.25, 0.95), 4096: (0.25, 0.95), 16384: (0.25, 0.95)}}

@dataclass(frozen=True)
class Recipe:
  population:int
  per_chunk:int                      # draws per chunk: the batch is repeated this many times in one forward
  writers:tuple[int, ...]            # per block: its attn.c_proj and mlp.c_proj, jittered together (§3.3); or
                                     # attn.c_proj alone, when mlp_writers is set
  hidden:tuple[int, ...]             # per block: the MLP's c_fc
  hubs:tuple[int, ...]               # per block: the attention outputs, the local draws' targets (§3.4)
  embedding:int
  head:int                           # the head's slab draws (§3.6)
  local:dict[str, tuple[int, ...]]   # kind -> per block draws; gate and ve are 0 off the value-embedding blocks
  gamma:float                        # credit decay of the local draws of k, v, gate, ve (§3.5)
  gamma0:float                       # block 0's direct draws: the reward-to-go's decay; 0: a token's own loss (§3.12)
  # the jitter's scale per site family: "attn.c_proj", "mlp.c_proj", "mlp.c_fc", "embedding", "hubs" (per block),
  # "head", "local" (the attention internals), "scalars"
  sigma:dict[str, float | tuple[float, ...]]
  scalar_draws:int
  lr:float                           # matrices and head
  momentum:float                     # SGD momentum, or AdamW's beta1 (its beta2 is 0.95, optim.py)
  group_lr:dict[str, float]          # parameter-name prefix -> lr, for the groups of §4.1 / §3.14
  warmdown:float                     # the fraction of the steps at the end over which the lr falls linearly to zero
  noise:str = "gaussian"             # every draw's distribution (kernels/noise.py): "gaussian", or "rademacher" (±1)
  # per block: draws of the MLP's c_proj alone, the writers' then jittering attention's c_proj alone; None: the two
  # share the writers' draws (the release's)
  mlp_writers:tuple[int, ...]|None = None

  def __post_init__(self):
    if self.mlp_writers is not None and (len(self.mlp_writers) != len(self.writers) or
                                         any(c % self.per_chunk for c in self.mlp_writers)):
      raise ValueError(f"mlp_writers {self.mlp_writers}: one count per block ({len(self.writers)}), each a whole "
                       f"number of chunks of {self.per_chunk} draws")
  def lr_for(self, name:str) -> float:
    return next((lr for pre, lr in self.group_lr.items() if name.startswith(pre)), self.lr)
  def counts(self) -> list[int]:  # every count that splits into chunks: the direct draws' and the local draws'
    return [*self.writers, *(self.mlp_writers or ()), *self.hidden, *self.hubs, self.embedding,
            *(c for v in self.local.values() for c in v)]

def resample(counts:tuple[int, ...], n:int, unit:int) -> tuple[int, ...]:
  """Spread an 8-block allocation over n blocks, keeping its total and multiples of `unit`. The counts are read as a
  density over depth and block j gets the mass of [j/n, (j+1)/n): contiguous group sums for n < 8 (exact when n divides
  8), a split of each old block for n > 8. Shares are rounded to units by largest remainder, with at least one unit per
  block where the total allows it (a block without draws would never learn)."""
  if n == len(counts): return counts
  edges = np.arange(n + 1) * len(counts) / n
  mass = np.interp(edges, np.arange(len(counts) + 1), np.concatenate([[0], np.cumsum(counts)]))
  share = np.diff(mass) / unit
  total, least = round(share.sum()), 1 if share.sum() >= n else 0
  units = np.maximum(np.floor(share + 1e-9), least)
  while units.sum() > total: units[np.argmax(np.where(units > least, units - share, -np.inf))] -= 1
  while units.sum() < total: units[np.argmax(share - units)] += 1
  return tuple(int(u) * unit for u in units)

def recipe(population:int, budget:str="1M", optimizer:str="sgd", n_layer:int=8, noise:str="gaussian",
           direct_scale:float=1.0, qkv_scale:float=1.0) -> Recipe:
  """The release's SGD recipe for its populations and budgets (§3.11, §4.1), or under Adam(W) the Noise record's (§3.14)
  at any population that is a multiple of 256: every count per 256 of population, sigmas doubled, block 0 rewarded by a
  reward-to-go, AdamW with the lr flat for 70% of the steps. The 8-block counts are spread over n_layer blocks, keeping
  their totals. `noise`: Gaussian draws, as the release's, or Rademacher (+-1: the same mean and variance, lighter
  tails). `direct_scale` multiplies the direct draws (writers, hidden, hubs, embedding) and `qkv_scale` the attention's
  q, k and v draws, each count still a whole number of chunks; neither scale is the release's."""
  if budget not in SGD_LR: raise ValueError(f"Dust recipes exist for budgets {', '.join(SGD_LR)}, not {budget!r}")
  if optimizer not in ("sgd", "adam", "adamw"): raise ValueError(f"unknown optimizer {optimizer!r}: sgd or adam")
  if noise not in NOISES: raise ValueError(f"unknown noise {noise!r}: {' or '.join(NOISES)}")
  adam = optimizer != "sgd"
  if adam and (population < 256 or population % 256):
    raise ValueError(f"Dust's AdamW recipe counts its draws per 256 of population: the population must be a multiple "
                     f"of 256, not {population}")
  if not adam and population not in POPULATIONS:
    raise ValueError(f"Dust supports populations {', '.join(map(str, POPULATIONS))}, not {population}")
  per_chunk = PER_CHUNK[max(p for p in PER_CHUNK if p <= population)]
  sgd = POP64 if population == 64 else SGD_16K_10M if (population, budget) == (16384, "10M") else SGD
  table = ADAMW if adam else sgd
  scale = 1 if table is POP64 else population / 256  # POP64's counts are absolute
  direct = scale * direct_scale
  writers, hidden, hubs = (resample(tuple(round(c * direct) for c in t), n_layer, per_chunk)
                           for t in (table.writers, table.hidden, table.hubs))
  has_ve = GPTConfig(n_layer=n_layer).has_ve
  lr, momentum = (0.0015, 0.7) if adam else SGD_LR[budget][max(population, 256)]  # P = 64 takes P = 256's settings
  s = 2 if adam else 1  # under Adam every sigma is doubled (§3.14)
  times = {kind: scale * (qkv_scale if kind in QKV else 1) for kind in table.local}  # each kind's multiple of its count
  r = Recipe(population=population, per_chunk=per_chunk, writers=writers, hidden=hidden, hubs=hubs,
             embedding=round(table.embedding * direct), head=(3 if adam else 4) * population,
             local={kind: tuple(round(c * times[kind]) if kind not in ("gate", "ve") or has_ve(l) else 0
                                for l in range(n_layer)) for kind, c in table.local.items()},
             gamma=0.99 if table is SGD_16K_10M else 0.98, gamma0=0.3 if adam else 0.0,
             # the record's embedding is 0.8: four times the release's, twice the paper's Adam recipe (§3.14)
             sigma={"attn.c_proj": 0.2 * s, "mlp.c_proj": 0.2 * s, "mlp.c_fc": 0.2 * s,
                    "embedding": 0.8 if adam else 0.2, "head": 0.05 * s, "local": 0.05 * s, "scalars": 0.03 * s,
                    # the deeper half of the hubs moves the loss too little at 0.2
                    "hubs": tuple((0.2 if 2 * l < n_layer else 0.4) * s for l in range(n_layer))},
             scalar_draws=8, lr=lr, momentum=momentum,
             group_lr={"transformer.wte": 300 * lr, "value_embeds": 300 * lr, "resid_lambdas": 30 * lr,
                       "x0_lambdas": 30 * lr} if adam else
                      {"transformer.wte": 1000.0, "value_embeds": 0.3, "resid_lambdas": 0.03, "x0_lambdas": 0.03},
             warmdown=0.3 if adam else 0.0, noise=noise)
  scales = (("direct", direct_scale), ("q, k, v", qkv_scale))
  scaled = [f"its {draws} draws scaled by {x}" for draws, x in scales if x != 1]
  what = f"population {population}" + (f" with {' and '.join(scaled)}" if scaled else "")
  if any(c % per_chunk for c in r.counts()) or r.head % (per_chunk * 16):  # §3.9, one device
    raise ValueError(f"{what}: its draw counts don't split into chunks of {per_chunk} draws "
                     "(and the head's into 16 slabs of them)")
  # a site without draws would never learn
  if direct_scale < 1 and 0 in (*r.writers, *r.hidden, *r.hubs, r.embedding):
    raise ValueError(f"{what}: a block or the embedding gets none")
  if qkv_scale < 1 and 0 in (c for kind in QKV for c in r.local[kind]):
    raise ValueError(f"{what}: a block gets no q, k or v draws")
  return r

def budget(tokens:int) -> str:
  """The release tuned its recipes for runs of 1M and 10M tokens: a run takes the nearer one on a log scale (10M above
  3.16M)."""
  return "10M" if tokens > np.sqrt(1e6 * 1e7) else "1M"

def forwards(rc:Recipe) -> float:
  """The network forwards an update's arithmetic needs: the clean capture, each direct draw's rerun from its block ((L -
  l)/L of the blocks at block l of L; all of them for the embedding), and two full forwards per scalar draw. The head's
  and the attention internals' draws rerun no network (a slab of the cached logits; one attention), so they count as
  none."""
  L = len(rc.writers)
  direct = zip(rc.writers, (0,) * L if rc.mlp_writers is None else rc.mlp_writers, rc.hidden, rc.hubs)
  reruns = sum(sum(counts) * (L - l) / L for l, counts in enumerate(direct))
  return 1 + rc.embedding + 2 * rc.scalar_draws + reruns
