"""Tests of dust.py: the recipe tables and their rules, no autograd in the estimator, rerun-from-block = full rerun, the cosine to
the autograd gradient rising with the population per layer type, and per-token node perturbation beating weight-space ES."""
import copy, math, pathlib, re
from dataclasses import replace
import numpy as np
import pytest
from tinygrad import Tensor, Context, dtypes
from kernels import attention, flash
from kernels.loss import cross_entropy
from kernels.noise import gaussian, key, runs
from model import GPT, GPTConfig, Looped, LoopedConfig
import devices, dust, engine, estimators, optim, recipes

B, T = 4, 16
TYPES = {"c_fc": "mlp.c_fc", "mlp.c_proj": "mlp.c_proj", "attn.c_proj": "attn.c_proj", "q": "attn.c_q", "k": "attn.c_k", "v": "attn.c_v",
         "gate": "ve_gate", "ve": "value_embeds", "wte": "transformer.wte", "head": "lm_head", "scalars": "_lambdas"}

@pytest.fixture(scope="module", autouse=True)
def fast_compile():
  """On the CPU, tinygrad's kernel optimizer costs ~3x more lowering time than these tiny kernels ever win back."""
  with Context(NOOPT=1): yield

@pytest.fixture(scope="module")
def setup():
  model = GPT(GPTConfig.preset("tiny", seq_len=T), seed=0)
  rng = np.random.default_rng(0)
  x, y = [Tensor(rng.integers(0, model.cfg.vocab, (B, T)).astype(np.int32)).realize() for _ in range(2)]
  return model, x, y, {}

def estimate(setup, pop:int, key:int, **opts) -> dict[str, np.ndarray]:
  model, x, y, memo = setup
  k = (pop, key, tuple(sorted(opts.items())))
  if k not in memo: memo[k] = {n: g.numpy() for n, g in estimators.estimate(model, x, y, "dust", pop, key, **opts).items()}
  return memo[k]

def cosine(a:np.ndarray, b:np.ndarray) -> float: return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))

# ***** recipe *****

def test_recipe_table_256_1024():
  """§3.11's table, exactly, on the 8-block model."""
  r = dust.recipe(256)
  assert (r.per_chunk, r.embedding, r.head, r.gamma) == (2, 10, 1024, 0.98)
  assert r.writers == r.hidden == (38, 32, 16, 10, 6, 4, 2, 2) and r.hubs == (6, 6, 4, 2, 2, 2, 2, 2)
  assert r.local == {"q": (2,) * 8, "v": (20,) * 8, "gate": (0, 6) * 4, "k": (12,) * 8, "ve": (0, 8) * 4}
  r = dust.recipe(1024)
  assert (r.per_chunk, r.embedding, r.head, r.gamma) == (8, 40, 4096, 0.98)
  assert r.writers == r.hidden == (152, 128, 64, 40, 24, 16, 8, 8) and r.hubs == (24, 24, 16, 8, 8, 8, 8, 8)
  assert r.local == {"q": (8,) * 8, "v": (80,) * 8, "gate": (0, 24) * 4, "k": (48,) * 8, "ve": (0, 32) * 4}
  assert r.sigma == {"attn.c_proj": 0.2, "mlp.c_proj": 0.2, "mlp.c_fc": 0.2, "embedding": 0.2, "head": 0.05, "local": 0.05, "scalars": 0.03,
                     "hubs": (0.2,) * 4 + (0.4,) * 4} and r.scalar_draws == 8

def test_recipe_override_and_optimizers():
  r = dust.recipe(16384, "10M")
  assert r.writers == (2176, 1792, 896, 512, 384, 256, 128, 128) and r.hubs == (768, 640, 512, 256, 256, 256, 256, 256)
  assert (r.per_chunk, r.gamma, r.embedding, r.head, r.lr, r.momentum) == (16, 0.99, 640, 65536, 0.25, 0.95)
  assert dust.recipe(16384, "1M").gamma == 0.98
  r = dust.recipe(256)  # SGD groups (§4.1)
  assert (r.lr, r.momentum) == (0.25, 0.95)
  assert [r.lr_for(n) for n in ("transformer.wte.weight", "value_embeds.1.weight", "x0_lambdas", "lm_head.weight")] == [1000, 0.3, 0.03, 0.25]
  assert (r.gamma0, r.warmdown) == (0.0, 0.0)

def test_noise_recipe():
  """The Noise record's AdamW recipe (§3.14): per 256 of population writers 4, hidden 8, hubs 8 a block, embedding 32, head 3P, per
  block q 2, v 20, gate 6, k 12, ve 72; sigmas doubled; block 0 by a reward-to-go; lr 0.0015 flat for 70% of the steps."""
  r = dust.recipe(1024, optimizer="adamw")
  assert (r.per_chunk, r.writers, r.hidden, r.hubs, r.embedding, r.head) == (8, (16,) * 8, (32,) * 8, (32,) * 8, 128, 3072)
  assert r.local == {"q": (8,) * 8, "v": (80,) * 8, "gate": (0, 24) * 4, "k": (48,) * 8, "ve": (0, 288) * 4}
  assert r.sigma == {"attn.c_proj": 0.4, "mlp.c_proj": 0.4, "mlp.c_fc": 0.4, "embedding": 0.8, "head": 0.1, "local": 0.1, "scalars": 0.06,
                     "hubs": (0.4,) * 4 + (0.8,) * 4}
  assert (r.gamma0, r.gamma, r.lr, r.momentum, r.warmdown) == (0.3, 0.98, 0.0015, 0.7, 0.3)
  assert [r.lr_for(n) for n in ("transformer.wte.weight", "value_embeds.1.weight", "resid_lambdas", "lm_head.weight")] == \
    pytest.approx([0.45, 0.45, 0.045, 0.0015])
  r = dust.recipe(16384, "10M", "adamw")  # no tuned override under AdamW: neither its counts nor its credit decay 0.99
  assert (r.per_chunk, r.writers, r.hidden, r.hubs, r.embedding, r.head, r.gamma) == (16, (256,) * 8, (512,) * 8, (512,) * 8, 2048, 49152, 0.98)
  assert r.local == {"q": (128,) * 8, "v": (1280,) * 8, "gate": (0, 384) * 4, "k": (768,) * 8, "ve": (0, 4608) * 4}
  r = dust.recipe(24576, optimizer="adamw")  # the record's scale, "24k": §3.14's table
  assert (sum(r.writers), sum(r.hidden), sum(r.hubs), r.embedding, r.head) == (3072, 6144, 6144, 3072, 73728)
  assert sum(r.writers) + sum(r.hidden) + sum(r.hubs) + r.embedding == 18432
  assert sum(v[1] for v in r.local.values()) == 10752 and r.local["ve"][1] == 6912

@pytest.mark.parametrize("pop", [64, 100, 1280])
def test_noise_recipe_rejects_populations(pop:int):
  """Its counts are per 256 of population, and every one must split into chunks of nrep draws (1280 / 256 * 4 = 20 writers, nrep 8)."""
  with pytest.raises(ValueError, match="multiple of 256" if pop % 256 else "don't split into chunks of 8"): dust.recipe(pop, optimizer="adamw")

# protects: direct_scale multiplies the direct draws (writers, hidden, hubs, embedding) and no others, and reaches the estimator
def test_direct_scale(setup):
  r, r15 = dust.recipe(1024, optimizer="adamw"), dust.recipe(1024, optimizer="adamw", direct_scale=1.5)
  assert (r15.writers, r15.hidden, r15.hubs, r15.embedding) == ((24,) * 8, (48,) * 8, (48,) * 8, 192)
  assert r15 == replace(r, writers=r15.writers, hidden=r15.hidden, hubs=r15.hubs, embedding=r15.embedding)
  race = dust.recipe(1024, "10M", "adamw", 6, direct_scale=1.5)  # the race's 6 blocks: 1.5 x 128 writers, spread evenly
  assert (race.writers, race.hidden, race.embedding) == ((32,) * 6, (64,) * 6, 192)
  with pytest.raises(ValueError, match="scaled by 1.1: its draw counts don't split into chunks of 8"):
    dust.recipe(1024, optimizer="adamw", direct_scale=1.1)
  with pytest.raises(ValueError, match="scaled by 0.05: a block or the embedding gets none"):  # 4 x 0.05 writers a block round to 0
    dust.recipe(256, optimizer="adamw", direct_scale=0.05)
  # chunk c of a group keeps its key, so twice the draws are the recipe's and as many more: the direct weights' estimates move,
  # the head's slab draws stay the same
  base, twice = estimate(setup, 64, 1), estimate(setup, 64, 1, direct_scale=2)
  for n in ("transformer.h.0.mlp.c_fc.weight", "transformer.h.0.attn.c_proj.weight", "transformer.wte.weight"):
    assert not np.allclose(base[n], twice[n]), n
  np.testing.assert_array_equal(base["lm_head.weight"], twice["lm_head.weight"])

# protects: qkv_scale multiplies the attention internals' q, k and v draws and no others, and reaches the estimator
def test_qkv_scale(setup):
  r, r4 = dust.recipe(1024, optimizer="adamw"), dust.recipe(1024, optimizer="adamw", qkv_scale=4)
  assert r4 == replace(r, local=r.local | {kind: tuple(4 * c for c in r.local[kind]) for kind in ("q", "k", "v")})
  race = dust.recipe(1024, "10M", "adamw", 6, direct_scale=1.5, qkv_scale=4)  # the race's best run (docs/race)
  assert race.local == {"q": (32,) * 6, "v": (320,) * 6, "gate": (0, 24) * 3, "k": (192,) * 6, "ve": (0, 288) * 3}
  with pytest.raises(ValueError, match="q, k, v draws scaled by 1.1: its draw counts don't split into chunks of 8"):
    dust.recipe(1024, optimizer="adamw", qkv_scale=1.1)
  with pytest.raises(ValueError, match="scaled by 0.2: a block gets no q, k or v draws"):  # 2 x 0.2 q draws a block round to 0
    dust.recipe(256, optimizer="adamw", qkv_scale=0.2)
  # as with direct_scale, the kinds' first chunks keep their keys: q, k and v's estimates move, the direct sites' and the gate's don't
  base, twice = estimate(setup, 64, 1), estimate(setup, 64, 1, qkv_scale=2)
  for n in ("c_q", "c_k", "c_v"): assert not np.allclose(base[f"transformer.h.1.attn.{n}.weight"], twice[f"transformer.h.1.attn.{n}.weight"]), n
  for n in ("transformer.h.1.attn.ve_gate.weight", "transformer.h.1.mlp.c_fc.weight", "transformer.wte.weight", "lm_head.weight"):
    np.testing.assert_array_equal(base[n], twice[n], err_msg=n)

def test_reward_to_go():
  """r_t = sum_{s>=t} gamma^(s-t) c_s, against the sum written out."""
  c = np.random.default_rng(0).standard_normal((3, 2, 12)).astype(np.float32)
  want = np.array([[[sum(0.3 ** (s - t) * row[s] for s in range(t, 12)) for t in range(12)] for row in m] for m in c])
  np.testing.assert_allclose(dust.reward_to_go(Tensor(c), 0.3).numpy(), want, rtol=1e-5, atol=1e-6)

@pytest.mark.parametrize("n_layer", [2, 3, 4, 8, 12])
def test_recipe_sums_and_divisibility(n_layer:int):
  """P counts the direct draws (3/4 of P under AdamW), at every depth after resampling; every count splits into chunks (§3.9)."""
  for pop in recipes.POPULATIONS:
    for budget in ("1M", "10M"):
      for opt, total in (("sgd", pop), ("adamw", pop * 3 // 4))[:1 if pop == 64 else 2]:
        r = dust.recipe(pop, budget, opt, n_layer)
        assert sum(r.writers) + sum(r.hidden) + sum(r.hubs) + r.embedding == total, (pop, budget, opt)
        assert len(r.writers) == len(r.hubs) == n_layer and all(len(v) == n_layer for v in r.local.values())
        counts = [*r.writers, *r.hidden, *r.hubs, r.embedding, *(c for v in r.local.values() for c in v)]
        assert all(c % r.per_chunk == 0 for c in counts) and r.head % (16 * r.per_chunk) == 0

def test_recipe_resampling_rule():
  """Fewer blocks: contiguous groups of the 8-block tilt, summed. More: a split that keeps the tilt's order."""
  assert dust.recipe(1024, n_layer=2).writers == (152 + 128 + 64 + 40, 24 + 16 + 8 + 8)
  assert dust.recipe(256, n_layer=4).hubs == (12, 6, 4, 4)
  w = dust.recipe(1024, n_layer=16).writers
  assert sum(w) == 440 and w[0] >= w[4] >= w[-1] > 0

@pytest.mark.parametrize("pop", [0, 32, 128, 512, 2048, 100000])
def test_recipe_rejects_other_populations(pop:int):
  with pytest.raises(ValueError, match="64, 256, 1024, 4096, 16384"): dust.recipe(pop)

# ***** the estimator on the tiny model *****

def test_no_autograd(setup, monkeypatch):
  def refuse(*a, **k): raise AssertionError("autograd used in dust")
  monkeypatch.setattr(Tensor, "backward", refuse)
  monkeypatch.setattr(Tensor, "gradient", refuse)
  g = estimate(setup, 64, 1)
  model = setup[0]
  assert g.keys() == model.params.keys() and all(g[n].shape == p.shape and np.isfinite(g[n]).all() for n, p in model.params.items())
  assert all(np.abs(g[n]).sum() > 0 for n in g), "every parameter gets an estimate"

def test_same_key_same_estimate(setup):
  model, x, y, _ = setup
  a, b, c = estimate(setup, 64, 1), estimators.estimate(model, x, y, "dust", 64, 1), estimate(setup, 64, 2)
  assert all(np.array_equal(a[n], b[n].numpy()) for n in a)
  assert all(not np.allclose(a[n], c[n]) for n in a)

def test_reward_to_go_on_block_zero_only(setup):
  """gamma0 > 0 changes block 0's direct draws (and the attention internals scored against block 0's hub errors) and nothing else."""
  model, x, y, _ = setup
  own = estimate(setup, 64, 1)
  to_go = {n: g.numpy() for n, g in estimators.estimate(model, x, y, "dust", 64, 1, rc=replace(dust.recipe(64, n_layer=2), gamma0=0.3)).items()}
  for n in own:
    assert np.array_equal(own[n], to_go[n]) != n.startswith("transformer.h.0."), n

def test_rerun_from_block_equals_full_rerun(setup):
  """§3.10: a jitter at block l can't change anything upstream, so starting there from the cached activations is exact."""
  block, full = estimate(setup, 64, 1), estimate(setup, 64, 1, rerun="full")
  for n in block:
    assert np.abs(block[n] - full[n]).max() <= 1e-3 * np.abs(full[n]).max(), n

# the estimate for key 1 at P = 64 on the fixture, recorded before the speed work: per parameter, its projection on a fixed Gaussian
# vector and its norm. Speed changes (JIT reuse, kernels, fusion) must leave the estimate where it was, to float32 rounding. Moved
# once by the CPU's cos(2 pi u) as polynomials (within 1.8e-4 of the norms), and recorded anew with four Gaussians a threefry call
# (kernels/noise.py, [noise-gen]): other noise, another estimate.
PIN_PROJ = [0.00319267, -0.0055914, 0.0100661, 0.00353266, 0.00126674, -0.00855373, -0.00357972, 3.15098e-05, 0.0038323, 0.00407528, -0.000774471,
            -0.00111475, 0.00378042, 0.00077003, -0.00090742, -0.392608, 9.43566e-06, -4.70706e-06]
PIN_NORM = [0.00248785, 0.00661938, 0.0162859, 0.0166013, 0.00231814, 0.00876107, 0.010702, 0.00342826, 0.00550978, 0.00964057, 0.000420182,
            0.00192351, 0.00848607, 0.0074505, 0.00255396, 0.81461, 0.000358442, 0.00016337]

def test_estimate_pinned(setup):
  g, rng = estimate(setup, 64, 1), np.random.default_rng(1)
  proj, norm = [float((v * rng.standard_normal(v.shape)).sum()) for v in g.values()], [float(np.linalg.norm(v)) for v in g.values()]
  np.testing.assert_allclose(norm, PIN_NORM, rtol=1e-4)
  assert np.all(np.abs(np.array(proj) - PIN_PROJ) <= 1e-4 * np.array(PIN_NORM)), (proj, PIN_PROJ)

def test_chunks_per_call_leave_the_estimate(setup, monkeypatch):
  # two chunks a call where a group's count allows, as a GPU runs as many as fit CALL_TOKENS (the CPU one): a call that gave two
  # chunks one key, lost one, or summed one twice changes it. Two, not more: each other count a call would be other kernels to compile
  model, x, y, _ = setup
  one = estimate(setup, 64, 1)
  monkeypatch.setattr(devices, "batches_chunks", lambda device: True)
  monkeypatch.setattr(devices, "CALL_TOKENS", 2 * dust.recipe(64).per_chunk * B * T)  # a direct, local or scalar chunk's tokens, twice
  batched = estimators.estimate(model, x, y, "dust", 64, 1)
  for n, g in batched.items(): np.testing.assert_allclose(g.numpy(), one[n], rtol=1e-4, atol=1e-6 * np.abs(one[n]).max(), err_msg=n)

def test_jit_reuse_across_steps():
  """Each chunk's TinyJit outlives its step: on the third step (the JITs replaying), with a new batch and weights changed in place,
  the estimate must equal a fresh model's (fresh JITs) on the same batch, weights and key, exactly."""
  rng = np.random.default_rng(0)
  def nudge(model:GPT, step:int):
    for i, p in enumerate(model.params.values()): p.assign(p + step * (i + 1) * 1e-3).realize()
  reused = GPT(GPTConfig.preset("tiny", seq_len=T), seed=0)
  for step in range(3):
    nudge(reused, step)
    x, y = [Tensor(rng.integers(0, 256, (B, T)).astype(np.int32)).realize() for _ in range(2)]
    a = estimators.estimate(reused, x, y, "dust", 64, 10 + step)
  fresh = GPT(GPTConfig.preset("tiny", seq_len=T), seed=0)
  for step in range(3): nudge(fresh, step)
  b = estimators.estimate(fresh, x, y, "dust", 64, 12)
  assert all(np.array_equal(a[n].numpy(), b[n].numpy()) for n in a)

NOISES = {"gaussian": ((64, 256, 1024), (1, 2)), "rademacher": ((256, 1024), (3, 4))}  # populations, keys (others than Gaussian's)

@pytest.fixture(scope="module")
def cosines(setup) -> dict[tuple[str, int], list[dict[str, float]]]:
  """Per (noise, population) and key, per layer type, the cosine of the estimate to the autograd gradient of the mean loss."""
  model, x, y, _ = setup
  names = list(model.params)
  true = dict(zip(names, [g.numpy() for g in model.losses(x, y).mean().gradient(*[model.params[n] for n in names])]))
  def per_type(est:dict[str, np.ndarray]) -> dict[str, float]:
    cat = lambda d, pat: np.concatenate([d[n].ravel() for n in names if pat in n])  # noqa: E731
    return {t: cosine(cat(est, pat), cat(true, pat)) for t, pat in TYPES.items()}
  out = {(noise, pop): [per_type(estimate(setup, pop, key, **({} if noise == "gaussian" else {"noise": noise}))) for key in keys]
         for noise, (pops, keys) in NOISES.items() for pop in pops}
  print("\ncosine to autograd         " + " ".join(f"{t:>11}" for t in TYPES))
  for (noise, pop), cs in out.items(): print(f"{noise:>10} pop {pop:5d}     " + " ".join(f"{np.mean([c[t] for c in cs]):11.3f}" for t in TYPES))
  return out

def test_cosines(cosines):
  """One test per question, from one fixture, so that the cosines (~8 minutes of a 2-core CPU) are computed once: pytest-xdist runs a
  module fixture again on every worker that gets one of its tests. Every layer type's cosine rises with the population; the head's
  is high; the residual scalars always get 8 antithetic draws (§3.7), so their estimate doesn't depend on the population."""
  c = {pop: {t: float(np.mean([k[t] for k in cosines["gaussian", pop]])) for t in TYPES} for pop in NOISES["gaussian"][0]}
  rising = [t for t in TYPES if t != "scalars" and not (c[1024][t] > c[64][t] + 0.1 and c[1024][t] > c[256][t])]
  assert not rising, (rising, c)
  assert c[1024]["head"] >= 0.9, c
  assert c[64]["scalars"] == c[1024]["scalars"] > 0.5, c

@pytest.mark.parametrize("pop", NOISES["rademacher"][0])
def test_rademacher_not_worse(cosines, pop:int):
  """--noise rademacher against Gaussian draws: the mean over the layer types of the difference of their cosines (each averaged over
  its 2 keys) is not below -3 standard errors. Each type's error comes from the spread of its two keys under each noise (one degree
  of freedom a noise and type, 22 pooled). For a linear response Rademacher's estimate has the smaller variance per coordinate
  (|g|^2 - g_i^2 against |g|^2 + g_i^2: its fourth moment is 1, not 3), so it should not be worse."""
  g, r = cosines["gaussian", pop], cosines["rademacher", pop]
  d = [np.mean([k[t] for k in r]) - np.mean([k[t] for k in g]) for t in TYPES]
  var = [sum((cs[0][t] - cs[1][t]) ** 2 / 2 / 2 for cs in (g, r)) for t in TYPES]  # s^2 / 2 per noise: the variance of a 2-key mean
  assert np.mean(d) >= -3 * math.sqrt(sum(var)) / len(TYPES), (pop, dict(zip(TYPES, d)))

def test_head_slabs():
  """A 1024-word vocab is 4 slabs of 256, one per chunk in turn (§3.6): the estimate must cover every column, point along the exact
  dloss_t/dz_t of the soft-capped cross-entropy and be normalised by each slab's draws (shrunk by (B-1)/B from the batch centring)."""
  rng = np.random.default_rng(0)
  V, cap, nrep = 1024, 15.0, 8
  z, y = rng.normal(0, 4, (B, T, V)), rng.integers(0, V, (B, T))
  c = cap * np.tanh(z / cap)
  p = np.exp(c - c.max(-1, keepdims=True))
  true = (p / p.sum(-1, keepdims=True) - np.eye(V)[y]) * (1 - np.tanh(z / cap) ** 2)
  model = type("Capped", (), {"cfg": GPTConfig(vocab=V, softcap=cap)})
  rc = replace(dust.recipe(1024), head=256 * nrep, per_chunk=nrep)  # 256 chunks of 8 draws, 64 cycles over the 4 slabs, σ 0.05
  work = [dust.Worker(model, None, Tensor(y.astype(np.int32)), key(3), {"lm_head": Tensor(z.astype(np.float32))})]
  est = dust.head_errors(work, rc, "slabs").numpy()
  for j in range(V // 256):
    assert cosine(est[..., 256 * j:256 * (j + 1)].ravel(), true[..., 256 * j:256 * (j + 1)].ravel()) > 0.6, f"slab {j}"
  assert 0.6 < (est * true).sum() / (true * true).sum() < 0.9

# protects: head="exact" gives the head the autograd gradient of the mean loss, and changes no other parameter's estimate
def test_head_exact(setup):
  model, x, y, _ = setup
  true = model.losses(x, y).mean().gradient(model.params["lm_head.weight"])[0].numpy()
  slabs, exact = estimate(setup, 64, 1), estimate(setup, 64, 1, head="exact")
  np.testing.assert_allclose(exact["lm_head.weight"], true, rtol=1e-3, atol=1e-4 * np.abs(true).max())
  assert all(np.array_equal(exact[n], slabs[n]) for n in slabs if n != "lm_head.weight")
  # at init the logits are too small for the softcap's slope to matter: large ones, against autograd through the loss itself
  rng = np.random.default_rng(0)
  z, t = Tensor(rng.normal(0, 20, (B, T, 64)).astype(np.float32)), Tensor(rng.integers(0, 64, (B, T)).astype(np.int32))
  np.testing.assert_allclose(dust.head_exact(model, z, t).numpy(), cross_entropy(z, t, model.cfg.softcap).sum().gradient(z)[0].numpy(),
                             rtol=1e-4, atol=1e-6)

def test_clean_attention_follows_its_records():
  """The attention capture is a JIT per window that lives across steps, its memory freed after use: at every call (the capture, the
  replays) its tensors must come from the records passed then, not from those of the call it captured (which an output that is a
  view of an input would show), and survive the release and re-allocation. A fresh model copy (its first call, a capture of these
  very records) is the reference."""
  model, rng = GPT(GPTConfig.preset("tiny", seq_len=T), seed=0), np.random.default_rng(5)
  for _ in range(4):
    x, y = [Tensor(rng.integers(0, 256, (B, T)).astype(np.int32)).realize() for _ in range(2)]
    _, rec = model.capture(x, y)  # eager: new record tensors at every call
    att, ref = dust.CleanAttention.capture(model, rec, 1), dust.CleanAttention.capture(copy.copy(model), rec, 1)
    assert att.t.keys() == ref.t.keys() and all(np.allclose(att.t[n].numpy(), ref.t[n].numpy(), atol=1e-6) for n in ref.t)
    att.jit.release()

@pytest.mark.parametrize("kind", ("v", "gate", "ve"))
def test_local_delta_in_half(setup, kind:str):
  """On a GPU the v, gate and ve draws read the clean probabilities p in half precision (float32 accumulation): they enter linearly,
  Δo = p Δu, with no difference of nearby values taken, so rounding p and Δu to half (eps = 2^-11) moves Δo by ~eps relative.
  Allow 2x. (q and k need a difference o' - o; in tensor ops they stay in float32, where the two models agree exactly. On NVIDIA GPUs
  kernels/flash.py's kernels take over: test_fused_attention_draws.)"""
  model, x, y, _ = setup
  _, rec = model.capture(x, y)
  half = copy.copy(model)
  half.dtype = dtypes.half
  sigma, eps, outs = 0.05, 2.0 ** -11, []
  for m in (model, half):
    att = dust.CleanAttention.capture(m, rec, 1)
    a = gaussian(key(3), (2 * B, T, model.cfg.n_head) + (() if kind == "gate" else (model.cfg.n_embd // model.cfg.n_head,)))
    outs.append(att.delta(kind, a, sigma, 2).numpy())
  rel = np.linalg.norm(outs[1] - outs[0]) / np.linalg.norm(outs[0])
  assert rel < 2 * eps, rel

@pytest.mark.skipif(not flash.fits(Tensor.empty(1, 128, 1, 64, dtype=dtypes.half), Tensor.empty(1, 128, 1, 64, dtype=dtypes.half)),
                    reason="kernels/flash.py runs on NVIDIA GPUs (sm_80+) only")
def test_fused_attention_draws():
  """On NVIDIA GPUs the attention-internal draws run kernels/flash.py's kernels (run on the GPU machine): q and k make o' - o from the
  change of q^ or k^ in half, and v, gate and ve remake p in the flash kernel. Their chunk estimates against the tensor ops'
  (CUDA_KERNELS=0: o' - o in float32, p kept in half), from the same capture and keys: the kernels round each term to half, 2^-11
  relative; allow 4x that of the largest value. A draw reading another draw's noise or sequence, a wrong sign or a lost term fails by
  O(1). (Measured on the H200 with the dust preset, at depths 0, 3 and 7: 2e-4 to 6e-4.)"""
  cfg = GPTConfig(vocab=256, seq_len=256, n_layer=2, n_head=2, n_embd=128)  # heads of 64, 128-token blocks: shapes the kernels take
  model, tensor_ops = GPT(cfg, dtype=dtypes.half), GPT(cfg, dtype=dtypes.half)  # the same weights; two objects, as JITs are per model
  rng = np.random.default_rng(0)
  x, y = [Tensor(rng.integers(0, cfg.vocab, (2, cfg.seq_len)).astype(np.int32)).realize() for _ in range(2)]
  _, rec = model.capture(x, y)
  target = Tensor(rng.normal(size=(2, cfg.seq_len, cfg.n_embd)).astype(np.float32) * 1e-3).realize()
  rc = replace(dust.recipe(1024), per_chunk=2)
  for i in range(cfg.n_layer):  # block 1 has value embeddings: all five kinds
    out = {}
    for fused, m in ((True, model), (False, tensor_ops)):
      with Context(CUDA_KERNELS=int(fused)):
        w = dust.Worker(m, x, y, key(0), rec, attn=dust.CleanAttention.capture(m, rec, i), targets={i: target})
        assert ("u16" in w.attn.t) == fused  # the kernels' half copies (kernels/attention.prepare)
        for kind in dust.local_kinds(m, i): out[fused, kind] = dust.local_errors([w], rc, kind, i, 2).numpy()
        w.attn.jit.release()
    for kind in dust.local_kinds(model, i):
      np.testing.assert_allclose(out[True, kind], out[False, kind], atol=4 * 2**-11 * np.abs(out[False, kind]).max(), rtol=0, err_msg=kind)

def test_local_draws_hold_their_group_of_scores(monkeypatch):
  """A k chunk reruns the attention for each of its nrep draws, in groups whose float32 scores fit attention.SCORES (here two
  draws'). The memory plan of its JIT, made at the capture and reused by every replay, holds one group's T x T scores and softmax
  (0.67 MiB here) besides tensors of size B T d; all draws at once hold at least every score of the chunk (1 MiB here; 2.1 measured),
  which at pop 1024 on the dust preset was the whole update's peak (8.6 GB). The plan is measured, not the memory in use: the JITs
  share one arena, as large as the largest plan in the process, so a replay allocates nothing and a capture what others need."""
  model = GPT(GPTConfig.preset("tiny"), seed=0)
  B, T, nrep = 4, 64, 8
  scores = B * model.cfg.n_head * T * T * 4  # one draw's
  monkeypatch.setattr(attention, "SCORES", 2 * scores)
  rng = np.random.default_rng(0)
  x, y = [Tensor(rng.integers(0, model.cfg.vocab, (B, T)).astype(np.int32)).realize() for _ in range(2)]
  rec = model.capture(x, y)[1]
  target = Tensor(rng.normal(size=(B, T, model.cfg.n_embd)).astype(np.float32)).realize()
  work, rc = [dust.Worker(model, x, y, key(1), rec, attn=dust.CleanAttention.capture(model, rec, 1), targets={1: target})], \
    replace(dust.recipe(1024), per_chunk=nrep)
  before = len(engine.SCRATCH.users)
  dust.local_errors(work, rc, "k", 1, 3 * nrep).realize()  # captures the chunk's JIT, whose memory plan its replays reuse
  plan = max(sum(u.nbytes() for u, _ in arenas) for _, arenas in engine.SCRATCH.users[before:])  # the largest plan captured here
  assert plan < nrep * scores, (plan, nrep * scores)

# ***** per-token node perturbation vs weight-space ES on one linear layer *****

class Linear:
  """y_t = W x_t with the per-token loss |y_t - target_t|^2 / 2: a one-site model with the interface dust.direct_errors drives."""
  def __init__(self, W:Tensor): self.params = {"w.weight": W}
  def rerun_stream(self, rec:dict, sites) -> dict: return {}  # nothing upstream of the one site to resume from
  def losses(self, x:Tensor, target:Tensor, jitter:dict|None=None, cache:dict|None=None, params:dict|None=None) -> Tensor:
    out = x @ (params or self.params)["w.weight"].T
    if jitter and "w" in jitter: out = out + jitter["w"][1] * runs(jitter["w"][0], out.shape)  # as model.Pass.site
    return (out - target).square().sum(-1) / 2

def test_node_perturbation_beats_weight_space_es():
  rng = np.random.default_rng(0)
  d, draws, nrep, sigma = 16, 64, 8, 0.1
  W, x, target = rng.normal(0, d ** -0.5, (d, d)), rng.normal(0, 1, (B, T, d)), rng.normal(0, 1, (B, T, d))
  true = np.einsum("bto,bti->oi", x @ W.T - target, x) / (B * T)
  model, xt, tt = Linear(Tensor(W.astype(np.float32))), Tensor(x.astype(np.float32)), Tensor(target.astype(np.float32))
  rec = {"w": xt @ model.params["w.weight"].T, "w:in": xt}
  rc = replace(dust.recipe(1024), per_chunk=nrep)
  err = dust.direct_errors([dust.Worker(model, xt, tt, key(7), rec)], rc, "embedding", None, {"w": sigma}, draws, "block")["w", None]
  G = dust.weight_grad(err, xt, W.shape).numpy()
  node = cosine(G.ravel(), true.ravel())
  assert abs((G * true).sum() / (true * true).sum() - (nrep - 1) / nrep) < 0.1  # unbiased up to the centring's (n-1)/n
  def mean_loss(w:np.ndarray) -> float: return float(np.square(x @ w.T - target).sum(-1).mean() / 2)
  eps = rng.normal(0, 1, (draws // 2, d, d))  # the same number of forward passes: draws/2 antithetic pairs
  es = sum((mean_loss(W + sigma * e) - mean_loss(W - sigma * e)) / (2 * sigma) * e for e in eps)
  weight = cosine(es.ravel(), true.ravel())
  assert node > 0.9 and node > weight + 0.4, (node, weight)
  assert math.isclose(weight, math.sqrt(draws / 2 / (draws / 2 + d * d)), abs_tol=0.2)  # ES's known cosine: the baseline is sane

# ***** the looped model: one weight-tied block, jittered at every loop with each loop's own noise *****

def test_recipe_one_block():
  """The looped model has one parameter block: every population's recipe resamples to n_layer=1 and keeps its totals and chunks."""
  for pop in recipes.POPULATIONS:
    for budget in ("1M", "10M"):
      for opt in ("sgd", "adamw")[:1 if pop == 64 else 2]:
        r, r8 = dust.recipe(pop, budget, opt, n_layer=1), dust.recipe(pop, budget, opt)
        assert (r.writers, r.hidden, r.hubs, r.embedding, r.head) == ((sum(r8.writers),), (sum(r8.hidden),), (sum(r8.hubs),), r8.embedding, r8.head)
        assert all(len(v) == 1 and v[0] % r.per_chunk == 0 for v in r.local.values()) and r.sigma["hubs"] == (r8.sigma["hubs"][0],)

@pytest.fixture(scope="module")
def looped():
  model = Looped(LoopedConfig.preset("tiny", loops=3, vocab=64, seq_len=T), seed=0)
  rng = np.random.default_rng(0)
  x, y = [Tensor(rng.integers(0, model.cfg.vocab, (B, T)).astype(np.int32)).realize() for _ in range(2)]
  return model, x, y, {}

def test_looped_no_autograd(looped, monkeypatch):
  def refuse(*a, **k): raise AssertionError("autograd used in dust")
  monkeypatch.setattr(Tensor, "backward", refuse)
  monkeypatch.setattr(Tensor, "gradient", refuse)
  g, model = estimate(looped, 64, 1), looped[0]
  assert g.keys() == model.params.keys() and all(g[n].shape == p.shape and np.isfinite(g[n]).all() for n, p in model.params.items())
  assert all(np.abs(g[n]).sum() > 0 for n in g), "every parameter gets an estimate"

@pytest.mark.parametrize("which", ["looped", "gpt"])
def test_depths_share_their_attention_jits(which:str, looped):
  """Depths with the same window and the same records share CleanAttention's JIT and the local draws' JITs: every loop of the looped
  model; in a 6-block GPT (the small preset's pattern: windows S S S L S L, value embeddings on blocks 1, 3, 5) blocks 0, 2, 4 and
  blocks 3, 5, while blocks 1 and 3 differ only in their window. At each depth a replay must read that depth's records and target,
  not those of the depth it was captured at, and a depth like one seen before must capture nothing. A fresh model copy at each depth
  (its own JITs, captured on that depth's inputs) is the reference: the same kernels, so the same numbers."""
  model, x, y, _ = looped
  if which == "gpt": model = GPT(GPTConfig.preset("tiny", seq_len=T, n_layer=6), seed=0)
  _, rec = model.capture(x, y)
  rng, seen, rc = np.random.default_rng(2), set(), replace(dust.recipe(1024), per_chunk=2)
  for i in range(model.n_blocks):
    target, out = Tensor(rng.normal(size=(B, T, model.cfg.n_embd)).astype(np.float32)).realize(), []
    like = (model.window(i), tuple(dust.local_kinds(model, i)))
    for m in (model, copy.copy(model)):
      jits = len(engine._jits)
      w = dust.Worker(m, x, y, key(4), rec, attn=dust.CleanAttention.capture(m, rec, i), targets={i: target})
      out.append({kind: dust.local_errors([w], rc, kind, i, 4).numpy() for kind in dust.local_kinds(m, i)})
      w.attn.jit.release()
      if m is model: assert like not in seen or len(engine._jits) == jits, f"depth {i} captured again"
    seen.add(like)
    for kind in out[1]: np.testing.assert_array_equal(out[0][kind], out[1][kind], err_msg=f"depth {i}, {kind}")

def test_looped_cosine_rises_with_population(looped):
  """The tied block's gradient sums each loop's outer product (error regressed on that loop's noise, times that loop's input):
  its cosine to autograd is positive at P = 64 and rises to P = 1024, per matrix too. The scalars are 1-element vectors here."""
  model, x, y, _ = looped
  names = list(model.params)
  true = dict(zip(names, [g.numpy() for g in model.losses(x, y).mean().gradient(*[model.params[n] for n in names])]))
  groups = {"all": names, "block": [n for n in names if n.startswith("transformer.h.0.")]} | \
           {n.removeprefix("transformer.h.0.").removesuffix(".weight"): [n] for n in names if not n.endswith("_lambdas")}
  def cosines(est:dict[str, np.ndarray]) -> dict[str, float]:
    return {t: cosine(*[np.concatenate([d[n].ravel() for n in ns]) for d in (est, true)]) for t, ns in groups.items()}
  c = {pop: cosines(estimate(looped, pop, 1)) for pop in (64, 1024)}
  print("\nlooped cosine to autograd " + " ".join(f"{t:>12}" for t in groups))
  for pop, cs in c.items(): print(f"pop {pop:5d}                 " + " ".join(f"{cs[t]:12.3f}" for t in groups))
  assert c[64]["all"] > 0 and c[64]["block"] > 0, c
  assert all(c[1024][t] > c[64][t] for t in groups), c
  assert all(c[1024][t] > c[64][t] + 0.1 for t in groups if t not in ("all", "lm_head")), c  # the head is already good at 64

# ***** docs/dust.md §3.16, "Change Dust": each worked change takes effect, and a few SGD steps with it lower the loss *****

def changes() -> list[str]:
  text = (pathlib.Path(__file__).resolve().parent.parent / "docs/dust.md").read_text()
  return re.findall(r"```python\n(.*?)```", text[text.index("### 3.16 Change Dust"):text.index("## 4. Optimisers")], re.S)

@pytest.mark.parametrize("change", range(4))
def test_change_dust(setup, change:int, monkeypatch):
  model, x, y, _ = setup
  assert len(changes()) == 4
  rc = dust.recipe(64, n_layer=model.n_pblocks)  # the recipe that `estimate` runs
  scope = {"rc": rc, "replace": replace}
  exec(changes()[change], scope)
  changed = scope["changed"]
  base = estimate(setup, 64, 1)
  paths, sum_draws = [], dust.sum_draws  # the key-tree addresses (group, block) the changed step draws at
  monkeypatch.setattr(dust, "sum_draws", lambda *a, path, **kw: paths.append(path) or sum_draws(*a, path=path, **kw))
  new = {n: g.numpy() for n, g in estimators.estimate(model, x, y, "dust", 64, 1, rc=changed).items()}
  monkeypatch.undo()
  moved = {n for n in base if not np.array_equal(base[n], new[n])}
  blocks = range(model.n_pblocks)
  writers = {f"transformer.h.{l}.{m}.c_proj.weight" for l in blocks for m in ("attn", "mlp")}
  if change == 0: assert moved == writers, moved
  if change == 1:
    assert sum(changed.writers) + sum(changed.hubs) == sum(rc.writers) + sum(rc.hubs) and changed.hubs != rc.hubs
    assert writers <= moved and any(".attn.c_v" in n for n in moved), moved
    assert not any(k in n for n in moved for k in ("c_fc", "wte", "lm_head", "lambdas")), moved
  if change == 2: assert moved and all(n.startswith("transformer.h.0.") for n in moved), moved
  if change == 3:
    assert moved == writers, moved
    # its draws are keyed apart: no (group, block) address in the key tree is drawn twice in a step
    assert len(paths) == len(set(paths)) and (dust.GROUPS.index("mlp_writers"), 0) in paths, paths
    for bad in (rc.writers[:1], tuple(w + 1 for w in rc.writers)):  # a count per block, each whole chunks
      with pytest.raises(ValueError, match="mlp_writers"): replace(rc, mlp_writers=bad)
    assert recipes.forwards(changed) > recipes.forwards(rc) and len(changed.counts()) == len(rc.counts()) + model.n_pblocks
  fresh = GPT(GPTConfig.preset("tiny", seq_len=T), seed=0)
  opt = optim.Optimizer(fresh.params, {n: changed.lr_for(n) for n in fresh.params}, "sgd", changed.momentum, 0)
  losses = []
  for step in range(5):
    g, loss = estimators.run(fresh, x, y, "dust", 64, step, rc=changed)
    losses.append(float(loss.item()))
    opt.step(g)
  assert losses[-1] < losses[0], losses
