"""The Dust GPT (docs/dust.md §1) and the looped RNN, as functions of one parameter dict, with noise sites at every
layer output.

A *site* is a layer output that Dust jitters: `losses(idx, targets, jitter={site: (key, sigma)})` adds sigma * N(0, I)
from `key` there (with `(key, sigma, "rademacher")`, sigma * +-1). `capture` runs the clean pass and keeps each site's
input and output plus the block inputs, so a jittered pass can start at the first jittered block instead of the
embedding (`losses(..., cache=...)`, docs/dust.md §3.10).
"""
from __future__ import annotations
import math
from typing import Iterable
from dataclasses import dataclass, replace
import numpy as np
from tinygrad import Tensor, dtypes
from kernels.attention import attention
from kernels.embed import embedding
from kernels.loss import cross_entropy, softcap
from kernels.matmul import activate, linear
from kernels.mix import scale
from kernels.jitter import jitter
from kernels.noise import fold
from kernels.perturb import per_member
from kernels.norm import norm, qk_norm, rms
import registry

@dataclass(frozen=True)
class GPTConfig:
  vocab:int = 4096
  seq_len:int = 2048
  n_layer:int = 8
  n_head:int = 8
  n_embd:int = 512
  window_pattern:str = "SSSL"
  softcap:float = 15.0

  @staticmethod
  def preset(name:str, **overrides) -> GPTConfig:
    presets = {"dust": GPTConfig(), "small": GPTConfig(vocab=256, seq_len=256, n_layer=6, n_head=4, n_embd=256),
               "tiny": GPTConfig(vocab=256, seq_len=64, n_layer=2, n_head=2, n_embd=32)}
    if name not in presets: raise ValueError(f"unknown GPT preset {name!r}; choose one of {', '.join(presets)}")
    return replace(presets[name], **overrides)

  def window(self, l:int) -> int:  # S = half the context, L = all of it; the last block is always L
    long = l == self.n_layer - 1 or self.window_pattern[l % len(self.window_pattern)] == "L"
    return self.seq_len if long else self.seq_len // 2

  # value embeddings on alternate blocks, ending at the last
  def has_ve(self, l:int) -> bool: return l % 2 == (self.n_layer - 1) % 2

@dataclass(frozen=True)
class LoopedConfig:
  vocab:int = 256
  seq_len:int = 64
  n_head:int = 2
  n_embd:int = 32
  loops:int = 4
  softcap:float = 15.0

  @staticmethod
  def preset(name:str, **overrides) -> LoopedConfig:
    presets = {"tiny": LoopedConfig(), "small": LoopedConfig(seq_len=256, n_head=4, n_embd=256, loops=16)}
    if name not in presets: raise ValueError(f"unknown Looped preset {name!r}; choose one of {', '.join(presets)}")
    return replace(presets[name], **overrides)

def init_params(shapes:dict[str, tuple[tuple[int, ...], str, float]], seed:int) -> dict[str, Tensor]:
  """shapes: name -> (shape, kind, scale). Drawn with NumPy so the same seed gives the same weights on every backend."""
  rng, ps = np.random.default_rng(seed), {}
  for name, (shape, kind, s) in shapes.items():
    w = {"normal": lambda: rng.normal(0, s, shape), "uniform": lambda: rng.uniform(-s, s, shape),
         "const": lambda: np.full(shape, s)}[kind]()
    ps[name] = Tensor(w.astype(np.float32)).realize()
  return ps

def block_shapes(pre:str, d:int, n_head:int, ve:bool) -> dict[str, tuple[tuple[int, ...], str, float]]:
  s = math.sqrt(3 / d)  # uniform with std 1/sqrt(fan_in); the two projections that write to the residual get 1.5x
  return {f"{pre}.attn.c_q.weight": ((d, d), "uniform", s), f"{pre}.attn.c_k.weight": ((d, d), "uniform", s),
          f"{pre}.attn.c_v.weight": ((d, d), "uniform", s),
          **({f"{pre}.attn.ve_gate.weight": ((n_head, min(32, d)), "const", 0.0)} if ve else {}),
          f"{pre}.attn.c_proj.weight": ((d, d), "uniform", 1.5 * s),
          f"{pre}.mlp.c_fc.weight": ((4 * d, d), "uniform", s),
          f"{pre}.mlp.c_proj.weight": ((d, 4 * d), "uniform", 1.5 * math.sqrt(3 / (4 * d)))}

def block_of(name:str) -> int|None:
  """The block of a site or parameter name (transformer.h.3.mlp.c_fc, value_embeds.3, o@3), None outside the blocks."""
  if name.startswith("o@"): return int(name.split("@")[1])
  if name.startswith(("transformer.h.", "value_embeds.")):
    return int(name.split(".")[1 if name.startswith("value_embeds") else 2])
  return None

class Pass:
  """One forward pass: reads weights in the compute dtype, adds the jitter at sites, records sites when capturing. A
  weight may be a Tensor, or a per-member perturbed weight (kernels/perturb.py) whose members sit on the batch axis."""
  def __init__(self, model:GPT, jitter:dict|None, rec:dict|None, params:dict|None=None):
    self.model, self.jitter, self.rec, self.depth = model, jitter or {}, rec, None
    self.params, self.dtype = model.params if params is None else params, model.dtype

  def embed(self, name:str, idx:Tensor) -> Tensor:
    w = self.params[name + ".weight"]
    return self.site(name, idx, embedding(w, idx, self.dtype) if isinstance(w, Tensor) else w.embed(idx, self.dtype))

  # a residual-mix scalar times the stream; [M, L] scalars: one set per member
  def scale(self, name:str, i:int, x:Tensor) -> Tensor:
    w = self.params[name]
    if not isinstance(w, Tensor): return w.scale(i, x)
    return scale(w, i, x) if w.ndim == 1 else per_member(w[:, i], x)

  # a jittered site's (key, sigma, *kind): k [2], or [G, 2]: G chunks of the batch, each with its own key; Gaussian
  # unless kind names another
  def noise(self, name:str) -> tuple|None:
    if name not in self.jitter: return None
    k, sigma, *kind = self.jitter[name]
    return self.model.site_key(k, self.depth), sigma, *kind

  def site(self, name:str, inp:Tensor|None, out:Tensor, jittered:bool=False) -> Tensor:
    if self.rec is not None:
      self.rec[name + self.model.tag(self.depth)], self.rec[name + ":in" + self.model.tag(self.depth)] = out, inp
    return out if jittered or (noise := self.noise(name)) is None else jitter(out, *noise)

  # act(x) is the layer's input (kernels/matmul.py's ACTS)
  def linear(self, name:str, x:Tensor, act:str|None=None) -> Tensor:
    w, xc = self.params[name + ".weight"], x.cast(self.dtype)
    if not isinstance(w, Tensor): return self.site(name, activate(x, act), w.linear(xc, self.dtype, act))
    # the noise in the matmul's epilogue
    return self.site(name, activate(x, act), linear(xc, w, act, self.noise(name)), jittered=True)

class GPT:
  # losses() evaluates a population of perturbed weights in one forward (registry.py): a weight may be a Population
  population = True

  def __init__(self, cfg:GPTConfig, seed:int=0, dtype=dtypes.float32):
    self.cfg, self.dtype = cfg, dtype
    d, V, L = cfg.n_embd, cfg.vocab, self.n_pblocks
    assert d % cfg.n_head == 0 and (d // cfg.n_head) % 2 == 0, "n_embd / n_head must be an even head dim"
    shapes = {"transformer.wte.weight": ((V, d), "normal", 1.0)}
    for l in range(L): shapes.update(block_shapes(f"transformer.h.{l}", d, cfg.n_head, self.has_ve(l)))
    for l in range(L):
      if self.has_ve(l): shapes[f"value_embeds.{l}.weight"] = ((V, d), "uniform", math.sqrt(3 / d))
    shapes |= {"lm_head.weight": ((V, d), "normal", 0.001), "resid_lambdas": ((L,), "const", 1.0),
               "x0_lambdas": ((L,), "const", 0.1)}
    self.params = init_params(shapes, seed)
    hd = d // cfg.n_head  # RoPE tables in float32: angle pos * 10000^(-2j/hd)
    ang = np.arange(cfg.seq_len)[:, None] * 10000.0 ** (-np.arange(0, hd, 2) / hd)[None, :]
    self.cos, self.sin = [Tensor(f(ang).astype(np.float32)).reshape(cfg.seq_len, 1, hd // 2).realize()
                          for f in (np.cos, np.sin)]

  # the stack of blocks: depth i uses parameter block `pblock(i)`; the looped model overrides these
  @property
  def n_blocks(self) -> int: return self.cfg.n_layer
  @property
  def n_pblocks(self) -> int: return self.cfg.n_layer
  def pblock(self, i:int) -> int: return i
  def has_ve(self, i:int) -> bool: return self.cfg.has_ve(i)
  def window(self, i:int) -> int: return self.cfg.window(i)
  # suffix of recorded names at depth i (the looped model records every loop)
  def tag(self, i:int|None) -> str: return ""
  def site_key(self, key:Tensor, i:int|None) -> Tensor: return key

  def num_params(self) -> int: return sum(p.numel() for p in self.params.values())

  def losses(self, idx:Tensor, targets:Tensor, jitter:dict|None=None, cache:dict|None=None,
             params:dict|None=None) -> Tensor:
    """Per-token cross-entropy [B, T] (float32). With `cache` from capture() on the same batch (possibly repeated along
    B), the pass starts at the first block that the jitter touches, from the cached clean activations. `params` replaces
    model.params for this pass (perturbed weights)."""
    return self._forward(idx, targets, Pass(self, jitter, None, params), cache)

  def logits(self, idx:Tensor) -> Tensor:
    """The softcapped logits [B, T, V] (float32) of a clean pass: the forward of losses(), whose last stream it records,
    then the head's projection without the loss (which stays lazy, and so is never computed)."""
    p = Pass(self, None, rec := {})
    self._forward(idx, idx, p, None)
    return softcap(p.linear("lm_head", norm(rec[f"x.{self.n_blocks}"], self.dtype)).float(), self.cfg.softcap)

  def capture(self, idx:Tensor, targets:Tensor, params:dict|None=None) -> tuple[Tensor, dict[str, Tensor]]:
    """The clean losses and a cache: every site's output (`name`) and input (`name:in`), `x0`, each block's input
    `x.{i}` and post-mix stream `h.{i}`. All realized, so reruns read them instead of recomputing. `params` as in
    losses()."""
    rec:dict[str, Tensor] = {}
    loss = self._forward(idx, targets, Pass(self, None, rec, params), None)
    Tensor.realize(loss, *[t for t in rec.values() if t is not None])
    return loss, rec

  def rerun_stream(self, rec:dict[str, Tensor], sites:Iterable[str]) -> dict[str, Tensor]:
    """The capture's entries at the first block that a pass jittering `sites` reruns, which `get` below reads: a JIT
    prepares every tensor it is given at every call, so a Dust chunk at the last block takes 4 of the 25 entries, not
    all of them. The weights are no input at all: the chunk JITs read them from the model, where the optimizer updates
    them in place."""
    start, _ = self.entry(sites)
    return {} if start == -1 else {n: rec[n] for n in ("x0", f"x.{start}", f"h.{start}", f"o@{start}")
                                   if n in rec and n != "x.0"}  # x.0 is x0

  def _forward(self, idx:Tensor, targets:Tensor, p:Pass, cache:dict|None) -> Tensor:
    start, skip_attn = self.entry(p.jitter) if cache is not None else (0, False)
    if cache is None or start == -1:
      x0 = rms(p.embed("transformer.wte", idx).float())
      x, start = x0, 0
    else:
      reps = idx.shape[0] // cache["x0"].shape[0]
      def get(k:str) -> Tensor: return cache[k].repeat((reps,) + (1,) * (cache[k].ndim - 1))
      x0 = get("x0")
      x = x0 if start == 0 else get(f"x.{start}")
    if p.rec is not None: p.rec["x0"] = x0
    for i in range(start, self.n_blocks):
      p.depth = i
      resume = (get(f"h.{i}"), get(f"o@{i}")) if i == start and skip_attn else None
      x = self.block(p, i, x, x0, idx, resume)
    if p.rec is not None: p.rec[f"x.{self.n_blocks}"] = x
    return self.head(p, x, targets)

  def entry(self, jitter:Iterable[str]) -> tuple[int, bool]:
    """Where a jittered pass must start: (-1, _) for the embedding, else (first block, whether its attention can be
    reused)."""
    first, attn = self.n_blocks, False
    for name in jitter:
      if name == "transformer.wte": return -1, False
      if name == "lm_head": continue
      i = block_of(name)
      post = name.startswith("o@") or name.endswith(("attn.c_proj", "mlp.c_fc", "mlp.c_proj"))
      if i < first: first, attn = i, not post
      elif i == first: attn = attn or not post
    return first, not attn

  def block(self, p:Pass, i:int, x:Tensor, x0:Tensor, idx:Tensor, resume:tuple[Tensor, Tensor]|None=None) -> Tensor:
    pre, lam = f"transformer.h.{self.pblock(i)}", self.pblock(i)
    if p.rec is not None: p.rec[f"x.{i}"] = x
    if resume is None:
      h = p.scale("resid_lambdas", lam, x) + p.scale("x0_lambdas", lam, x0)
      if p.rec is not None: p.rec[f"h.{i}"] = h
      y = self.attn(p, i, pre, norm(h, self.dtype), idx)
    else: h, y = resume
    proj = p.linear(f"{pre}.attn.c_proj", p.site(f"o@{self.pblock(i)}", None, y))
    # the MLP reads rms(h + proj), the sum read once on NVIDIA GPUs (kernels/norm.py). The block's output is left lazy:
    # the next block's residual mix reads it once, and computes it in its own kernel instead of reading it back from
    # memory
    return h + proj.float() + self.mlp(p, pre, norm(h, self.dtype, proj)).float()

  def mlp(self, p:Pass, pre:str, x:Tensor) -> Tensor:
    """The MLP of block `pre` on its normed input: c_proj(relu(c_fc(x))²), the square read by c_proj's matmul as it
    loads its input (kernels/matmul.py). A subclass's own MLP keeps Dust's sites where it calls p.linear on the same
    names."""
    return p.linear(f"{pre}.mlp.c_proj", p.linear(f"{pre}.mlp.c_fc", x), "relu2")

  def attn(self, p:Pass, i:int, pre:str, n:Tensor, idx:Tensor) -> Tensor:
    B, T, d = n.shape
    H = self.cfg.n_head
    q, k, v = [p.linear(f"{pre}.attn.{c}", n).reshape(B, T, H, d // H) for c in ("c_q", "c_k", "c_v")]
    # v += 2 sigmoid(gate) * value embedding; the gate reads the first 32 channels of the normed input
    if self.has_ve(i):
      e = p.embed(f"value_embeds.{i}", idx).reshape(B, T, H, d // H)
      z = p.linear(f"{pre}.attn.ve_gate", n[..., :min(32, d)])
      v = v + (2 * z.float().sigmoid()).cast(self.dtype).unsqueeze(-1) * e
    q, k = [qk_norm(t, self.cos[:T], self.sin[:T], self.dtype) for t in (q, k)]  # RoPE, then QK-norm
    return attention(q, k, v, self.window(i)).reshape(B, T, d)

  def head(self, p:Pass, x:Tensor, targets:Tensor) -> Tensor:
    p.depth = None
    return cross_entropy(p.linear("lm_head", norm(x, self.dtype)), targets, self.cfg.softcap)

class Looped(GPT):
  """One weight-tied block applied `loops` times: recurrence in depth. The embedding x0 re-enters at every loop through
  the block's residual mix (h = resid_lambda x + x0_lambda x0). A site inside the block is jittered independently at
  each loop (its key folded with the loop index), and its records are kept per loop as `name@i`."""
  def __init__(self, cfg:LoopedConfig, seed:int=0, dtype=dtypes.float32):
    self.loops = cfg.loops
    super().__init__(cfg, seed, dtype)  # type: ignore[arg-type]

  @property
  def n_blocks(self) -> int: return self.loops
  @property
  def n_pblocks(self) -> int: return 1
  def pblock(self, i:int) -> int: return 0
  def has_ve(self, i:int) -> bool: return False
  def window(self, i:int) -> int: return self.cfg.seq_len
  def tag(self, i:int|None) -> str: return "" if i is None else f"@{i}"
  def site_key(self, key:Tensor, i:int|None) -> Tensor: return key if i is None else fold(key, i)
  # every loop is jittered: rerun from the embedding
  def entry(self, jitter:Iterable[str]) -> tuple[int, bool]: return -1, False

  def block(self, p:Pass, i:int, x:Tensor, x0:Tensor, idx:Tensor, resume:tuple[Tensor, Tensor]|None=None) -> Tensor:
    """A pass that nothing differentiates (perturbed weights or jittered sites: the ZO estimators) is realized loop by
    loop. Run eagerly (JIT=0), one tinygrad schedule keeps every `.contiguous()` buffer it writes until it ends, so a
    lazy pass would hold every loop's activations; per loop, each loop's are freed before the next. Autograd needs the
    whole graph."""
    x = super().block(p, i, x, x0, idx, resume)
    return x.realize() if p.jitter or p.params is not self.params else x

  def losses(self, idx:Tensor, targets:Tensor, jitter:dict|None=None, cache:dict|None=None, params:dict|None=None,
             loops:int|None=None) -> Tensor:
    """As GPT.losses, with the loop count settable per call (train at one depth, evaluate at another)."""
    saved, self.loops = self.loops, loops or self.loops
    try: return super().losses(idx, targets, jitter, cache, params)
    finally: self.loops = saved

# ***** the presets, each a --model (registry.py) *****

def vocab_of(vocab:int|None) -> dict[str, int]: return {"vocab": vocab} if vocab else {}  # --vocab, where given

def preset(name:str):
  def make(vocab:int|None, seed:int, dtype) -> GPT:
    return GPT(GPTConfig.preset(name, **vocab_of(vocab)), seed, dtype)
  make.__doc__ = f"The GPT's {name} preset."
  registry.model(name)(make)

for _name in ("tiny", "small", "dust"): preset(_name)

@registry.model("looped")
def looped(vocab:int|None, seed:int, dtype, loops:int|None=None) -> Looped:
  """The looped RNN's tiny preset, its loop count --loops."""
  return Looped(LoopedConfig.preset("tiny", **vocab_of(vocab), **({"loops": loops} if loops else {})), seed, dtype)
