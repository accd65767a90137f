"""Dust (docs/dust.md §3): a gradient estimate from forward passes only, by perturbing layer *outputs* token by token.

For a linear map y_t = W x_t the weight gradient is Σ_t g_t x_tᵀ with g_t = dloss_t/dy_t. Dust estimates only g_t, by
jittering y_t with σ a_t and regressing each token's own loss change on a_t, one draw at every token in one forward:
  ĝ_t = −1/(σK) Σ_i r̃_t^(i) a_t^(i),  r_t = ℓ⁰_t − ℓ_t (the token's loss drop), r̃ = r centred over a chunk's draws,
and the exact outer product with the cached input x_t gives the weight gradient (§3.1, §3.8). `step` runs §3's steps.

Words:
  site          a layer output that a draw jitters: y = W x for one weight W, at one depth
  draw          one noise a (Gaussian or ±1 per value, regenerated from its key, never kept) and the loss it causes
  chunk         `per_chunk` draws in one forward, the batch repeated once per draw: what keys and centring work on
  direct        draws scored by the network's own loss, rerun from the jittered block (§3.3)
  writers       the projections that write into the residual stream, attention's c_proj and the MLP's c_proj,
                jittered together, each with its own noise and σ (or, with Recipe.mlp_writers, in draws of their own)
  hidden        the MLP's c_fc, the input projection of its hidden layer
  hubs          the attention outputs, jittered for their errors alone: the local draws' targets (§3.4)
  local         draws on the attention's internals (q, k, v, the value-embedding gate and values), scored by
                <target, Δo> through one attention, not the network (§3.5)
  slabs         the head's 256-column slices of the logits, each jittered alone on the cached logits (§3.6)
  capture       the clean forward that records every site's input and output for the whole step (§3.2)
  rerun         a jittered forward that starts at the jittered block from the captured activations (§3.10)
  reward-to-go  a token's reward plus the discounted rewards of the later tokens (§3.12)

The looped model applies one weight-tied block at every loop: a draw jitters a block site at every loop, each loop
with its own noise, and each loop's error is regressed on that loop's noise only; the tied weight's gradient sums the
loops' outer products.
"""
from __future__ import annotations
from dataclasses import dataclass, field
from typing import Any
from tinygrad import Tensor, dtypes
from kernels.attention import moved, mixed, prepare
from kernels.loss import exp_sum, softcap
from kernels.matmul import mix_rows, outer_sum
from kernels.noise import NOISES, fold, runs
from kernels.norm import qk_norm
from devices import device, inputs, last_call_start, replicas, sum_draws
from recipes import KINDS, Recipe, budget, forwards, recipe
from registry import POSITIVE, Defaults, Option, Run, activations, estimator
import engine

# a group's index is its draws' address in the key tree: chunk c of a group at block l is keyed fold(key, group, l, c)
GROUPS = ("writers", "hidden", "embedding", "hubs", "head", *KINDS, "scalars", "mlp_writers")
SCALARS = ("resid_lambdas", "x0_lambdas")

@dataclass
class Worker:
  """One device's share of a step: its model (or replica), the batch, the key, and the capture every draw of the step
  reads."""
  model: Any
  x: Tensor
  y: Tensor
  key: Tensor
  rec: dict[str, Tensor]                # every site's output, and its input as "site:in"
  loss: Tensor|None = None              # the clean mean loss
  jit: engine.Function|None = None      # the capture's JIT, whose buffers are released after the step
  attn: CleanAttention|None = None      # the clean attention at the depth the local draws are at
  targets: dict[int, Tensor] = field(default_factory=dict)  # the hubs' errors per depth, on this device

# ***** the run's recipe, its checks and its optimizer settings *****

def run_recipe(run:Run) -> Recipe:
  """The run's recipe; a --direct-scale or --qkv-scale whose counts don't split into chunks is named in the error, a
  fault of the population or the optimizer itself reported as such."""
  o = run.options
  def make(direct:float, qkv:float) -> Recipe:
    return recipe(run.pop, budget(run.tokens), run.optimizer, run.model.n_pblocks, o["noise"], direct_scale=direct,
                  qkv_scale=qkv)
  try: return make(o["direct_scale"], o["qkv_scale"])
  except ValueError as e:
    make(1.0, 1.0)
    flags = " ".join(f"--{n.replace('_', '-')} {o[n]}" for n in ("direct_scale", "qkv_scale") if o[n] != 1)
    raise ValueError(f"{flags}: {e}") from None

def lacks(model) -> str|None:
  """What Dust needs of a model beyond what every estimator does (registry.py), in words; None where it has it: the
  sites of model.GPT (its capture and its losses(jitter=..., cache=...); a subclass keeps them), and every parameter the
  weight at a site, or a residual-mix scalar (a parameter at no site would get no estimate)."""
  if not all(hasattr(model, a) for a in ("capture", "rerun_stream", "n_pblocks")):
    return ("sites, the layer outputs that Dust jitters: a model of its own has none; a subclass of model.GPT keeps "
            "GPT's")
  at_sites = {*SCALARS, "transformer.wte.weight", "lm_head.weight"} | {
    f"{site}.weight" for l in range(model.n_pblocks)
    for site in (*[error_site(kind, l) for kind in local_kinds(model, l)],
                 *[f"transformer.h.{l}.{s}" for s in ("attn.c_proj", "mlp.c_fc", "mlp.c_proj")])}
  if missing := sorted(at_sites - model.params.keys()):
    return f"weight at Dust's site {missing[0].removesuffix('.weight')}"
  if extra := [n for n in model.params if n not in at_sites]: return f"site for its parameter {extra[0]}"
  return None

def check(run:Run):
  """The model has Dust's sites, the run's recipe exists, and the kernels can number every group's chunks (engine.START
  numbers a call's first chunk)."""
  if what := lacks(run.model): raise ValueError(f"dust can't train {type(run.model).__name__}: it has no {what}")
  rc, tokens, S = run_recipe(run), run.tokens // run.steps, slabs(run.model)  # a step's tokens
  groups = [(c // rc.per_chunk, rc.per_chunk * tokens, 1) for c in rc.counts()]
  if run.options["head"] == "slabs": groups.append((rc.head // rc.per_chunk, S * rc.per_chunk * tokens, S))
  if (n := max(last_call_start(c, t, device(run.model), run.devices, u) for c, t, u in groups)) > engine.START.vmax:
    raise ValueError(f"--pop {run.pop}: Dust's kernels number a group's chunks of draws up to "
                     f"{engine.START.vmax + 1:,}, and one starts a call at {n:,}")

def defaults(run:Run) -> Defaults:
  """The recipe's optimizer settings (docs/dust.md §4): its groups' lrs as multiples of its base lr."""
  rc = run_recipe(run)
  return Defaults(lr=rc.lr, momentum=rc.momentum, groups={p: lr / rc.lr for p, lr in rc.group_lr.items()},
                  warmdown=rc.warmdown)

# ***** the estimator: §3's steps in order *****

def memory(run:Run) -> float|None:
  """The capture (every site's activations, as backprop keeps them) and a chunk's forward, twice a forward's for the
  draws' noise and jittered outputs beside it."""
  if (capture := activations(run.model, tokens := run.tokens // run.steps, kept=True)) is None: return None
  return capture + 2 * activations(run.model, run_recipe(run).per_chunk * tokens)

@estimator("dust", defaults=defaults, check=check, forwards=lambda run: forwards(run_recipe(run)), memory=memory,
  noise=Option("the distribution of every draw (Rademacher: +-1, the same mean and variance)", choices=tuple(NOISES)),
  head=Option("the head's per-token errors estimated from draws on slabs of the logits (the release's), or exact: "
              "softmax - one-hot from the clean forward, no draws (docs/dust.md §3.6)", choices=("slabs", "exact")),
  direct_scale=Option("the recipe's direct draws (writers, hidden, hubs, embedding) times this, each count still a "
                      "whole number of chunks (1.5 or 2 at pop 1024); 1.5 with --head exact takes about the time of "
                      "the recipe's step (docs/dust.md §3.6)", check=POSITIVE),
  qkv_scale=Option("the recipe's draws of the attention's q, k and v times this, each count still a whole number of "
                   "chunks; 4 with --head exact --direct-scale 1.5 is the race's best (docs/dust.md §3.5)",
                   check=POSITIVE))
def step(model, x:Tensor, y:Tensor, pop:int, key:Tensor, optimizer:str="sgd", tokens:int=10**6, noise:str="gaussian",
         head:str="slabs", direct_scale:float=1.0, qkv_scale:float=1.0, rc:Recipe|None=None, rerun:str="block",
         devices:int=1) -> tuple[dict[str, Tensor], Tensor]:
  """Returns (the estimate, the clean mean loss), with the recipe for this population, budget, optimizer and noise (or
  `rc`). rerun: "block" starts each jittered pass at its block (§3.10), "full" reruns the whole model. head: "slabs"
  estimates the head's errors from draws (§3.6), "exact" computes them. devices: split every group's chunks over this
  many devices."""
  rc = rc or recipe(pop, budget(tokens), optimizer, model.n_pblocks, noise, direct_scale=direct_scale,
                    qkv_scale=qkv_scale)
  # 1. the capture: every site's input and output, on every device (§3.2)
  work = [clean_pass(m, *inputs(m, x, y, key)) for m in replicas(model, devices)]
  # 2. direct draws, block by block: the writers, then the hidden layer; then the embedding (§3.3)
  err, s = {}, rc.sigma
  for l in range(model.n_pblocks):
    h = f"transformer.h.{l}"
    attn, mlp = {f"{h}.attn.c_proj": s["attn.c_proj"]}, {f"{h}.mlp.c_proj": s["mlp.c_proj"]}
    if rc.mlp_writers is None: err |= direct_errors(work, rc, "writers", l, attn | mlp, rc.writers[l], rerun)
    else:  # the MLP's c_proj with draws of its own
      err |= direct_errors(work, rc, "writers", l, attn, rc.writers[l], rerun)
      err |= direct_errors(work, rc, "mlp_writers", l, mlp, rc.mlp_writers[l], rerun)
    err |= direct_errors(work, rc, "hidden", l, {f"{h}.mlp.c_fc": s["mlp.c_fc"]}, rc.hidden[l], rerun)
  err |= direct_errors(work, rc, "embedding", None, {"transformer.wte": s["embedding"]}, rc.embedding, rerun)
  # 3. the hubs' errors, and the attention internals scored against them (§3.4, §3.5)
  err |= attention_errors(work, rc, rerun)
  # 4. the head's errors (§3.6)
  err["lm_head", None] = head_errors(work, rc, head)
  # 5. the weights' gradients from the errors and the captured inputs, and the residual-mix scalars' by ES (§3.7, §3.8)
  return weight_grads(work, err, scalar_grads(work, rc))

def clean_pass(model, x:Tensor, y:Tensor, key:Tensor) -> Worker:
  """The capture, as a JIT that lives across steps. Each device captures its own: a forward costs less than copying
  activations."""
  jit = engine.jit(clean_capture, model)
  loss, rec = jit(x, y)
  return Worker(model, x, y, key, rec | {f"{site}:in": x for site in embeddings(model)}, loss, jit)

def clean_capture(model, x:Tensor, y:Tensor) -> tuple[Tensor, dict[str, Tensor]]:
  """model.capture without the embeddings' inputs, which are the batch x itself: a JIT returns the tensors of the call
  it captured, so at every replay those entries would hold that call's batch."""
  loss, rec = model.capture(x, y)
  return loss, {n: t for n, t in rec.items() if t is not x}

def embeddings(model) -> list[str]:  # the sites whose input is the batch of token ids
  return ["transformer.wte", *[f"value_embeds.{i}" for i in range(model.n_blocks) if model.has_ve(i)]]

def recorded(model, site:str, depth:int|None) -> str:
  """The capture's name of a site's output at a depth: the site itself, or `site@i` at loop i of the looped model."""
  return site if depth is None else site + model.tag(depth)

def tile(t:Tensor, n:int) -> Tensor: return t.repeat((n,) + (1,) * (t.ndim - 1))  # n copies of the batch: one per draw

# ***** direct draws: writers, hidden, embedding, hubs (§3.3, §3.4) *****

def direct_errors(work:list[Worker], rc:Recipe, group:str, l:int|None, sigma:dict[str, float], n:int,
                  rerun:str) -> dict[tuple[str, int|None], Tensor]:
  """n draws of a group's sites (site -> its σ), all jittered in every pass, each with its own noise: per site and
  depth, the estimate of dloss_t/dy_t at every token [B, T, width]. l: the parameter block, None outside the blocks; in
  the looped model a block is applied at several depths, each jittered with its own noise in the same pass."""
  if not n: return {}
  model, (B, T) = work[0].model, work[0].y.shape[:2]
  depths = (None,) if l is None else tuple(i for i in range(model.n_blocks) if model.pblock(i) == l)
  sites = tuple(sigma)
  outs = tuple((j, d, work[0].rec[recorded(model, site, d)].shape[-1]) for j, site in enumerate(sites) for d in depths)
  def ins(w:Worker) -> tuple: return w.x, w.y, w.model.rerun_stream(w.rec, sites) if rerun == "block" else {}
  E = sum_draws(direct_chunk, [(w.model, w.key, ins(w)) for w in work], path=(GROUPS.index(group), l or 0),
                chunks=n // rc.per_chunk, tokens=rc.per_chunk * B * T, shapes=[(B, T, w) for *_, w in outs],
                ints={"K": n},
                sites=sites, sigma=tuple(sigma.values()), per_chunk=rc.per_chunk, outs=outs, rerun=rerun,
                gamma=rc.gamma0 if l == 0 else 0.0, noise=rc.noise)
  return {(sites[j], d): e for (j, d, _), e in zip(outs, E)}

def direct_chunk(model, keys:Tensor, x:Tensor, y:Tensor, stream:dict[str, Tensor], K:Tensor, sites:tuple[str, ...],
                 sigma:tuple[float, ...], per_chunk:int, outs:tuple[tuple[int, int|None, int], ...], rerun:str,
                 gamma:float, noise:str) -> list[Tensor]:
  """G chunks of direct draws in one pass (keys [G, 2]), per_chunk draws each, one per copy of the batch; outs lists
  (site index, depth, width) of the estimates. Returns this pass's part of ĝ_t = −1/(σK) Σ_i r̃_t a_t for each."""
  B, T, G = *y.shape[:2], keys.shape[0]
  ks = [fold(keys, j) for j in range(len(sites))]  # each site's own noise
  jitter = {site: (k, s, noise) for site, k, s in zip(sites, ks, sigma)}
  loss = model.losses(tile(x, G * per_chunk), tile(y, G * per_chunk), jitter,
                      stream if rerun == "block" else None).reshape(G, per_chunk, B, T)
  # r_t = ℓ⁰_t − ℓ_t centred over the chunk's draws: ℓ⁰ cancels, r̃ = mean ℓ − ℓ (each draw in its own baseline,
  # which scales ĝ by (n−1)/n)
  reward = loss.mean(1, keepdim=True) - loss
  if gamma: reward = reward_to_go(reward, gamma)  # block 0 under AdamW (§3.12)
  def a(j:int, d:int|None, w:int) -> Tensor:  # the noise the model added at site j, depth d
    key = ks[j] if d is None else model.site_key(ks[j], d)
    return runs(key, (G * per_chunk * B, T, w), noise).reshape(G, per_chunk, B, T, w)
  return [-(reward.unsqueeze(-1) * a(j, d, w)).sum((0, 1)) / (sigma[j] * K) for j, d, w in outs]

def reward_to_go(r:Tensor, gamma:float) -> Tensor:
  """Σ_{s≥t} γ^(s−t) r_s along the last axis (tokens): block 0's jitter pays off mostly at later tokens (§3.12)."""
  T = r.shape[-1]
  return r @ credit(T, T, gamma).T

def credit(T:int, window:int, gamma:float) -> Tensor:
  """C[t, s] = γ^(s−t) for 0 <= s−t <= window: the discounted credit of a perturbation at t over the outputs s it
  reaches."""
  lag = Tensor.arange(T).reshape(1, T) - Tensor.arange(T).reshape(T, 1)
  return ((lag >= 0) & (lag <= window)).where(gamma ** lag.float(), 0.0).contiguous()  # not recomputed in the matmul

# ***** the attention: hub targets and local draws on the internals (§3.4, §3.5) *****

def attention_errors(work:list[Worker], rc:Recipe, rerun:str) -> dict[tuple[str, int|None], Tensor]:
  """The attention outputs' errors (hubs, "o@l": targets only, no weight of their own), then the attention internals
  scored against them, depth by depth (each loop of the looped model against its own target), one depth's attention held
  at a time."""
  model, err, targets = work[0].model, {}, {}
  for l in range(model.n_pblocks):
    hub = direct_errors(work, rc, "hubs", l, {f"o@{l}": rc.sigma["hubs"][l]}, rc.hubs[l], rerun)
    targets |= {d: t for (_, d), t in hub.items()}
  # copied to every device before any local work is queued: a copy out of a device waits for all the work queued on it
  for w in work: w.targets = {i: t.to(w.x.device).realize() for i, t in targets.items()}
  for i in targets:
    for w in work: w.attn = CleanAttention.capture(w.model, w.rec, i)
    l = model.pblock(i)
    for kind in local_kinds(model, i):  # n_layer=1's recipe allots gate and ve draws, which the looped model can't use
      if n := rc.local[kind][l]: err[error_site(kind, l), i] = local_errors(work, rc, kind, i, n)
    for w in work: w.attn.jit.release()
  return err

def local_errors(work:list[Worker], rc:Recipe, kind:str, i:int, n:int) -> Tensor:
  """n draws of one kind of the attention internals at depth i, against the hub target there: [B, T, H*hd], or [B, T, H]
  (gate)."""
  att = work[0].attn
  B, T, H, hd = att.t["q"].shape
  (E,) = sum_draws(local_chunk, [(w.model, w.key, (w.attn.t, w.targets[i])) for w in work],
                   path=(GROUPS.index(kind), i), chunks=n // rc.per_chunk, tokens=rc.per_chunk * B * T,
                   shapes=[(B, T, H if kind == "gate" else H * hd)],
                   ints={"K": n}, kind=kind, window=att.window, sigma=rc.sigma["local"], gamma=rc.gamma,
                   per_chunk=rc.per_chunk, noise=rc.noise)
  return E

def local_chunk(model, keys:Tensor, clean:dict[str, Tensor], target:Tensor, K:Tensor, kind:str, window:int, sigma:float,
                gamma:float, per_chunk:int, noise:str) -> list[Tensor]:
  """G chunks of local draws (keys [G, 2]), n = G per_chunk draws in all, one per copy of the batch. Each draw is scored
  by <target_s, Δo_s> per head, a first-order stand-in for the loss increase (so no minus sign and no centring): q by
  its own token's score, the others by the discounted sum over the later outputs they reach."""
  att, n = CleanAttention(model, window, clean), keys.shape[0] * per_chunk
  B, T, H, hd = clean["q"].shape
  # the gate is moved two-sided, by ±σ a: its slope divides by 2σ
  shape, s = ((per_chunk * B, T, H), 2 * sigma) if kind == "gate" else ((per_chunk * B, T, H, hd), sigma)
  a = NOISES[noise](fold(keys, 0), shape).reshape(n * B, *shape[1:])
  score = (att.delta(kind, a, sigma, n) * tile(target.reshape(B, T, H, hd), n)).sum(-1)  # [n B, T, H]
  # realized: fused into the sum over draws below, the gate's credit matmul made one kernel that was slow to compile
  R = score if kind == "q" else mix_rows(credit(T, att.window, gamma), score)
  return [(R.unsqueeze(-1) * a if kind != "gate" else R * a).reshape(n, B, T, -1).sum(0) / (s * K)]

def error_site(kind:str, l:int) -> str:  # the module whose weight a kind's errors update
  if kind == "ve": return f"value_embeds.{l}"
  return f"transformer.h.{l}.attn." + {"q": "c_q", "k": "c_k", "v": "c_v", "gate": "ve_gate"}[kind]

def gate(z:Tensor) -> Tensor: return 2 * z.sigmoid()

def local_kinds(model, i:int) -> list[str]:  # gate and ve where depth i has value embeddings (never in a looped model)
  return [kind for kind in KINDS if kind in ("q", "k", "v") or model.has_ve(i)]

class CleanAttention:
  """The clean attention at a depth, heads split, tokens first: raw q, k [B, T, H, hd]; processed q^, k^, values u = v +
  gate e (and the gate's logits z, the value embedding e); and what the draws read besides (kernels/attention.prepare).
  A draw recomputes only this attention, never the network: for q and k, o' − o (kernels/attention.moved); for v, gate
  and ve, which move only u, p Δu (kernels/attention.mixed). Its JITs are keyed by the window and the records, so depths
  alike share them. `t` holds the tensors, so that a JIT can take them as inputs."""
  def __init__(self, model, window:int, t:dict[str, Tensor]): self.model, self.window, self.t = model, window, t

  @classmethod
  def capture(cls, model, rec:dict[str, Tensor], i:int) -> CleanAttention:
    """From the clean pass's records of q, k, v (and gate, ve) at depth i, as a JIT that lives across steps. Its tensors
    are the JIT's outputs, which the next depth with the same window and records writes again, and `jit.release()` frees
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
    """Δo, the change of the attention output when every token's `kind` moves by σ a (a: [n B, T, H(, hd)]), all outputs
    at once."""
    t = self.t
    if kind in ("q", "k"):
      return moved(t, t["qh"], t["kh"], t["u"], self.hat(tile(t[kind], n) + sigma * a), kind, self.window)
    z, e = (tile(t[name], n) if name in t else None for name in ("z", "e"))
    du = {"v": lambda: sigma * a, "ve": lambda: sigma * a * gate(z).unsqueeze(-1),  # exact by linearity in u
          "gate": lambda: (gate(z + sigma * a) - gate(z - sigma * a)).unsqueeze(-1) * e}[kind]()
    return mixed(t, du, self.window)

def clean_attention(model, records:dict[str, Tensor], window:int) -> dict[str, Tensor]:
  """CleanAttention's tensors at a depth, from the clean pass's records of q, k, v (and gate, ve). Run as a JIT, from
  copies of the records: its outputs must own their buffers, as a view of an input would show the input of the call that
  the JIT captured."""
  att, r = CleanAttention(model, window, {}), {kind: t.float().clone() for kind, t in records.items()}
  t = {kind: att.heads(r[kind]) for kind in ("q", "k")}
  u = att.heads(r["v"])
  if "ve" in r: t["z"], t["e"] = r["gate"], att.heads(r["ve"])
  t["u"] = u + gate(t["z"]).unsqueeze(-1) * t["e"] if "ve" in r else u
  t["qh"], t["kh"] = att.hat(t["q"]), att.hat(t["k"])
  return t | prepare(t["qh"], t["kh"], t["u"], att.window, model.dtype)

# ***** the output head: slabs of the cached logits (§3.6) *****

def head_errors(work:list[Worker], rc:Recipe, head:str) -> Tensor:
  """The head's per-token errors [B, T, V]: from draws on slabs, or exact (`head_exact`), with no draws. Chunk m of a
  cycle of S jitters slab m (256 raw-logit columns) and recomputes the loss from the clean slab sums: no network rerun,
  and each reward reflects only 256 columns. Each slab gets rc.head / S draws."""
  w0 = work[0]
  if head == "exact": return engine.jit(head_exact, w0.model)(w0.rec["lm_head"], w0.y)
  (B, T, V), S = w0.rec["lm_head"].shape, slabs(w0.model)
  def clean(w:Worker) -> dict[str, Tensor]:
    # the raw logits as slabs, and the sums every draw reuses (a JIT of its own)
    return engine.jit(clean_head, w.model)(w.rec["lm_head"], w.y) | {"z": w.rec["lm_head"].reshape(B, T, S, V // S)}
  (E,) = sum_draws(head_chunk, [(w.model, w.key, (clean(w), w.y)) for w in work],
                   path=(GROUPS.index("head"), 0), chunks=rc.head // rc.per_chunk, run=S,
                   tokens=S * rc.per_chunk * B * T,
                   shapes=[(B, T, S, V // S)], ints={"K": rc.head // S}, sigma=rc.sigma["head"], per_chunk=rc.per_chunk,
                   noise=rc.noise)
  return E.reshape(B, T, V)

def slabs(model) -> int: return model.cfg.vocab // 256 if model.cfg.vocab % 256 == 0 else 1  # else one, all the vocab

def clean_head(model, z:Tensor, y:Tensor) -> dict[str, Tensor]:
  """What every draw on the clean raw logits z reuses: the softcapped logits' exp-sum per slab, the target's logit and
  the loss ℓ⁰."""
  B, T, V = z.shape
  S = slabs(model)
  c, hit = softcap(z.float(), model.cfg.softcap), (y.unsqueeze(-1) == Tensor.arange(V)).float()
  slab_sum = exp_sum(c.reshape(B, T, S, V // S))  # |c| <= cap, so exp needs no max-subtraction
  c_y = (c * hit).sum(-1)
  return {"slab_sum": slab_sum, "c_y": c_y, "loss0": slab_sum.sum(-1).log() - c_y}

def head_chunk(model, keys:Tensor, clean:dict[str, Tensor], y:Tensor, K:Tensor, sigma:float, per_chunk:int,
               noise:str) -> list[Tensor]:
  """G cycles of S chunks (keys [G, S, 2]), the G chunks on slab m keyed keys[:, m]. Returns this call's part of ĝ_t =
  −1/(σK) Σ_i r̃_t a_t per slab, r = ℓ⁰ − ℓ with ℓ recomputed from the jittered slab and the other slabs' clean sums."""
  B, T, S, W = clean["z"].shape
  slab_sum = clean["slab_sum"]
  def slab(m:int) -> Tensor:
    # a materialized, as two kernels read it; c2 left lazy, as its two sums over the slab are one kernel
    a = NOISES[noise](keys[:, m], (per_chunk, B, T, W)).reshape(-1, B, T, W).contiguous()
    c2 = softcap(clean["z"][:, :, m].float() + sigma * a, model.cfg.softcap)
    col = (y - m * W).unsqueeze(-1) == Tensor.arange(W)  # the target's column, where it is in this slab
    target = (y // W == m).where(col.where(c2, 0).sum(-1), clean["c_y"])
    reward = clean["loss0"] - ((slab_sum.sum(-1) - slab_sum[:, :, m] + exp_sum(c2)).log() - target)
    if B > 1: reward = reward - reward.mean(1, keepdim=True)  # centred across the batch at each draw and position
    return -(reward.unsqueeze(-1) * a).sum(0) / (sigma * K)
  return [Tensor.stack(*[slab(m).realize() for m in range(S)], dim=2)]  # a slab at a time: one slab's draws in memory

def head_exact(model, z:Tensor, y:Tensor) -> Tensor:
  """`head="exact"`: the head's per-token errors without draws. The head's output is the loss's own input, so its
  derivative needs no backward pass: with c = cap tanh(z / cap), dloss_t/dz_t = (softmax(c_t) − onehot(y_t)) (1 − (c_t /
  cap)²), from the clean forward's raw logits z alone. Not the release's, which estimates it from slabs (§3.6)."""
  c = softcap(z.float(), model.cfg.softcap)
  return (c.softmax(-1) - y.one_hot(z.shape[-1]).float()) * (1 - (c / model.cfg.softcap).square())

# ***** the residual-mix scalars: two-sided weight-space ES (§3.7) *****

def scalar_grads(work:list[Worker], rc:Recipe) -> dict[str, Tensor]:
  """The gradient of the mean loss for the residual-mix scalars, a chunk a draw."""
  L, x = work[0].model.params[SCALARS[0]].shape[0], work[0].x
  E = sum_draws(scalar_chunk, [(w.model, w.key, (w.x, w.y)) for w in work], path=(GROUPS.index("scalars"), 0),
                chunks=rc.scalar_draws, tokens=2 * x.numel(), shapes=[(L,), (L,)], ints={"K": rc.scalar_draws},
                sigma=rc.sigma["scalars"], noise=rc.noise)
  return dict(zip(SCALARS, E))

def scalar_chunk(model, keys:Tensor, x:Tensor, y:Tensor, K:Tensor, sigma:float, noise:str) -> list[Tensor]:
  """G draws (keys [G, 2]) as G members of one forward per sign, each with its own scalars λ ± σ a [G, L]. Returns their
  part of 1/(KN) Σ_i (ℓ(λ + σa_i) − ℓ(λ − σa_i)) / (2σ) a_i, ℓ the summed loss of the batch's N tokens."""
  params, G, N = model.params, keys.shape[0], x.numel()
  L = params[SCALARS[0]].shape[0]
  a = NOISES[noise](fold(keys, 0), (2 * L,))
  def loss(sign:int) -> Tensor:
    jittered = {n: (params[n] + sign * sigma * a[:, i * L:(i + 1) * L]).contiguous() for i, n in enumerate(SCALARS)}
    return model.losses(tile(x, G), tile(y, G), params=params | jittered).reshape(G, -1).sum(1)
  slope = ((loss(1) - loss(-1)) / (2 * sigma)).unsqueeze(1)
  return [(slope * a[:, :L]).sum(0) / (K * N), (slope * a[:, L:]).sum(0) / (K * N)]

# ***** reassembly (§3.8) *****

def weight_grads(work:list[Worker], err:dict[tuple[str, int|None], Tensor],
                 scalars:dict[str, Tensor]) -> tuple[dict[str, Tensor], Tensor]:
  """Each weight's gradient from its sites' errors and captured inputs, and the clean mean loss, as one JIT. It writes
  into buffers allocated here, so the estimate is the caller's to keep: a JIT's own outputs would be overwritten by the
  next step."""
  model, rec = work[0].model, work[0].rec
  out = {n: engine.empty(*p.shape, device=p.device) for n, p in model.params.items()}
  mean = engine.empty(device=work[0].y.device)
  ins = [rec[recorded(model, s + ":in", d)] for s, d in err]
  engine.jit(gradients, model, sites=tuple(err))(list(err.values()), ins, scalars, work[0].loss, out, mean)
  for w in work: w.jit.release()
  return out, mean

def gradients(model, errs:list[Tensor], inputs:list[Tensor], scalars:dict[str, Tensor], loss:Tensor,
              out:dict[str, Tensor], mean:Tensor, sites:tuple[tuple[str, int|None], ...]):
  """The outer products into `out`: a weight used at several depths (tied across loops) sums them; a block without draws
  gets zeros (no update)."""
  grads = dict(scalars)
  for (s, _), e, inp in zip(sites, errs, inputs):
    n, g = f"{s}.weight", weight_grad(e, inp, model.params[f"{s}.weight"].shape)
    grads[n] = grads[n] + g if n in grads else g
  Tensor.realize(*[o.assign(grads[n] if n in grads else o.zeros_like()) for n, o in out.items()],
                 mean.assign(loss.mean()))

def weight_grad(err:Tensor, inp:Tensor, shape:tuple[int, ...]) -> Tensor:
  """(1/N) Σ_t ĝ_t x_tᵀ over the N tokens, or for an embedding a scatter-add of the errors into the rows of the token
  ids (a one-hot matmul)."""
  n, err = err.shape[0] * err.shape[1], err.reshape(-1, err.shape[-1])
  if dtypes.is_int(inp.dtype):
    return outer_sum((inp.reshape(-1, 1) == Tensor.arange(shape[0])).cast(err.dtype), err) / n
  return outer_sum(err, inp.reshape(-1, shape[1])) / n
