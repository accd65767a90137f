"""Tests of model.py: the Dust preset's parameters and init, the step-0 loss, causality and windows, jitter sites, capture and
the rerun from the first jittered block, the float32 softmax under half precision, and the looped model."""
import math
import numpy as np
import pytest
from tinygrad import Tensor, dtypes
from tinygrad.uop.ops import Ops
from model import GPT, GPTConfig, Looped, LoopedConfig
from kernels.noise import key, gaussian
from kernels.norm import qk_norm, rms, rope

CFG = GPTConfig(vocab=64, seq_len=16, n_layer=2, n_head=2, n_embd=16)  # block 0: window 8, no VE; block 1: full window, VE
B, T, SIGMA = 2, 16, 0.5

def batch(vocab:int, b:int, t:int, seed:int=0) -> tuple[Tensor, Tensor]:
  toks = np.random.default_rng(seed).integers(0, vocab, (b, t + 1)).astype(np.int32)
  return Tensor(toks[:, :-1]).realize(), Tensor(toks[:, 1:]).realize()

def block_sites(cfg:GPTConfig, l:int) -> list[str]:
  pre = f"transformer.h.{l}"
  sites = [f"{pre}.attn.c_q", f"{pre}.attn.c_k", f"{pre}.attn.c_v", f"o@{l}", f"{pre}.attn.c_proj", f"{pre}.mlp.c_fc", f"{pre}.mlp.c_proj"]
  return sites + ([f"{pre}.attn.ve_gate", f"value_embeds.{l}"] if cfg.has_ve(l) else [])

def loss_np(t:Tensor) -> np.ndarray: return t.numpy().astype(np.float64)

@pytest.fixture(scope="module")
def dust() -> GPT: return GPT(GPTConfig.preset("dust"), seed=0)

@pytest.fixture(scope="module")
def tiny():
  """A 2-block model with a larger head (std 0.2, logits O(1)) so that every jitter moves the loss well above float noise."""
  m = GPT(CFG, seed=0)
  m.params["lm_head.weight"] = Tensor(np.random.default_rng(1).normal(0, 0.2, (CFG.vocab, CFG.n_embd)).astype(np.float32)).realize()
  x, y = batch(CFG.vocab, B, T)
  clean = loss_np(m.losses(x, y))
  _, cache = m.capture(x, y)
  return m, x, y, clean, cache

# ***** the Dust preset: parameters, init, step-0 loss *****

def test_dust_param_count(dust):
  # a missing/extra tensor (VE on the wrong blocks, a tied head, a gain or bias) changes the count of docs/dust.md §1.3
  assert dust.num_params() == 37_749_776 and len(dust.params) == 60
  names = set(dust.params)
  for n in ("transformer.wte.weight", "transformer.h.3.attn.c_q.weight", "value_embeds.1.weight", "transformer.h.1.attn.ve_gate.weight",
            "lm_head.weight", "resid_lambdas", "x0_lambdas", "transformer.h.7.mlp.c_proj.weight"): assert n in names, n
  assert "value_embeds.0.weight" not in names and "transformer.h.0.attn.ve_gate.weight" not in names
  assert sorted(n for n in names if n.startswith("value_embeds")) == [f"value_embeds.{l}.weight" for l in (1, 3, 5, 7)]
  assert dust.params["transformer.h.1.attn.ve_gate.weight"].shape == (8, 32) and dust.params["resid_lambdas"].shape == (8,)
  assert dust.params["transformer.h.0.mlp.c_fc.weight"].shape == (2048, 512) and dust.params["transformer.h.0.mlp.c_proj.weight"].shape == (512, 2048)

def test_dust_windows_and_ve():
  # the SSSL pattern with the last block forced long, and VE on blocks with the parity of L-1 (docs/dust.md §1.1)
  cfg = GPTConfig.preset("dust")
  assert [cfg.window(l) for l in range(8)] == [1024, 1024, 1024, 2048, 1024, 1024, 1024, 2048]
  assert [l for l in range(8) if cfg.has_ve(l)] == [1, 3, 5, 7]
  assert [GPTConfig.preset("tiny", n_layer=3).has_ve(l) for l in range(3)] == [True, False, True]

@pytest.mark.parametrize("name,bound", [("attn.c_q", 0.076547), ("attn.c_k", 0.076547), ("attn.c_v", 0.076547), ("mlp.c_fc", 0.076547),
                                        ("attn.c_proj", 0.11482), ("mlp.c_proj", 0.057410)])
def test_dust_uniform_init(dust, name, bound):
  # a wrong bound (fan_out instead of fan_in, no 1.5x on the writers) or a normal draw moves max|w| or the std
  for l in (0, 7):
    w = dust.params[f"transformer.h.{l}.{name}.weight"].numpy()
    assert np.abs(w).max() <= bound * 1.00001 and np.abs(w).max() == pytest.approx(bound, rel=1e-3)
    assert w.std() == pytest.approx(bound / math.sqrt(3), rel=0.01) and abs(w.mean()) < 0.01 * bound

def test_dust_other_init(dust):
  # wte N(0,1), head N(0,0.001), VE uniform(±s), gates zero, resid 1, x0 0.1 (docs/dust.md §1.3)
  p = {k: v.numpy() for k, v in dust.params.items() if not k.startswith("transformer.h.") or "ve_gate" in k}
  assert p["transformer.wte.weight"].std() == pytest.approx(1.0, rel=0.01) and abs(p["transformer.wte.weight"].mean()) < 0.01
  assert p["lm_head.weight"].std() == pytest.approx(0.001, rel=0.01) and abs(p["lm_head.weight"].mean()) < 1e-5
  ve = p["value_embeds.3.weight"]
  assert np.abs(ve).max() == pytest.approx(0.076547, rel=1e-3) and ve.std() == pytest.approx(0.076547 / math.sqrt(3), rel=0.01)
  for l in (1, 3, 5, 7): assert not p[f"transformer.h.{l}.attn.ve_gate.weight"].any()
  np.testing.assert_array_equal(p["resid_lambdas"], np.ones(8, np.float32))
  np.testing.assert_allclose(p["x0_lambdas"], np.full(8, 0.1), rtol=1e-6)
  assert not np.array_equal(p["transformer.wte.weight"], p["lm_head.weight"] * 1000)  # untied, independent draws

def test_dust_step0_loss(dust):
  # the head std 0.001 gives near-uniform logits: the mean loss is ln 4096 (docs/dust.md §1.4); a wrong head/softcap/CE breaks it
  x, y = batch(4096, 1, 64)  # windows don't matter for the initial loss, so one short row
  loss = dust.losses(x, y)
  assert loss.shape == (1, 64) and loss.dtype == dtypes.float32
  assert loss.mean().item() == pytest.approx(math.log(4096), abs=0.01)

def test_small_step0_loss():
  # the same on a small config, which the CPU runs use
  m = GPT(CFG, seed=3)
  x, y = batch(CFG.vocab, B, T, seed=1)
  assert m.losses(x, y).mean().item() == pytest.approx(math.log(CFG.vocab), abs=0.01)

def test_seed():
  # weights must be a pure function of the seed: a run and its resume/eval share them, another seed differs everywhere
  a, b, c = (GPT(GPTConfig.preset("tiny"), seed=s) for s in (0, 0, 1))
  assert set(a.params) == set(b.params) == set(c.params)
  for n in a.params:
    np.testing.assert_array_equal(a.params[n].numpy(), b.params[n].numpy())
    if "ve_gate" not in n and "lambdas" not in n: assert not np.array_equal(a.params[n].numpy(), c.params[n].numpy()), n

# ***** causality, windows, jitter *****

def test_causal(tiny):
  # a token at t must not move the loss at any position < t (a missing or transposed mask leaks the future), and moves all >= t
  m, x, y, clean, _ = tiny
  t = 6
  xn = x.numpy().copy()
  xn[:, t] = (xn[:, t] + 1) % CFG.vocab
  l2 = loss_np(m.losses(Tensor(xn), y))
  np.testing.assert_allclose(l2[:, :t], clean[:, :t], atol=1e-6, rtol=0)
  assert (np.abs(l2[:, t:] - clean[:, t:]) > 1e-4).all()

def test_rope_and_rms(tiny):
  # RoPE with angle pos * 10000^(-2j/hd) on the halves [a cos + b sin, -a sin + b cos] (docs/dust.md §1.2), and a weightless RMSNorm
  m, hd = tiny[0], CFG.n_embd // CFG.n_head
  ang = np.arange(CFG.seq_len)[:, None] * 10000.0 ** (-2 * np.arange(hd // 2) / hd)[None, :]
  np.testing.assert_allclose(m.cos.numpy().reshape(CFG.seq_len, -1), np.cos(ang), atol=1e-6)
  np.testing.assert_allclose(m.sin.numpy().reshape(CFG.seq_len, -1), np.sin(ang), atol=1e-6)
  x = np.random.default_rng(0).normal(size=(1, CFG.seq_len, 2, hd)).astype(np.float32)
  a, b, c, s = x[..., :hd // 2], x[..., hd // 2:], np.cos(ang)[:, None], np.sin(ang)[:, None]
  np.testing.assert_allclose(rope(Tensor(x), m.cos, m.sin).numpy(), np.concatenate([a * c + b * s, b * c - a * s], -1), atol=1e-5)
  np.testing.assert_allclose(rms(Tensor(x)).numpy(), x / np.sqrt((x ** 2).mean(-1, keepdims=True) + 1e-6), atol=1e-5)
  r = np.concatenate([a * c + b * s, b * c - a * s], -1)  # QK-norm: RoPE, then the norm (kernels/norm.py's CUDA kernel is test_cuda's)
  np.testing.assert_allclose(qk_norm(Tensor(x), m.cos, m.sin, dtypes.float32).numpy(), r / np.sqrt((r ** 2).mean(-1, keepdims=True) + 1e-6),
                             atol=1e-5)

def test_jitter_sigma0_and_sanity(tiny):
  # sigma 0 adds exactly nothing; a jitter at block 0's c_fc reaches every position (noise added at the wrong place/shape fails)
  m, x, y, clean, _ = tiny
  np.testing.assert_array_equal(loss_np(m.losses(x, y, {"transformer.h.0.mlp.c_fc": (key(5), 0.0)})), clean)
  l1 = loss_np(m.losses(x, y, {"transformer.h.0.mlp.c_fc": (key(5), SIGMA)}))
  assert (np.abs(l1 - clean) > 1e-5).all()
  # the noise is a function of the key: the same key again gives the same losses, another key others
  np.testing.assert_array_equal(loss_np(m.losses(x, y, {"transformer.h.0.mlp.c_fc": (key(5), SIGMA)})), l1)
  assert not np.allclose(loss_np(m.losses(x, y, {"transformer.h.0.mlp.c_fc": (key(6), SIGMA)})), l1)

# ***** capture and rerun from the first jittered block *****

def test_capture(tiny):
  # capture's losses are the clean ones, and its records are each site's real input/output (a stale or shifted record fails)
  m, x, y, clean, cache = tiny
  l, _ = m.capture(x, y)
  np.testing.assert_allclose(loss_np(l), clean, atol=1e-5)
  sites = ["transformer.wte", "lm_head"] + [s for l in range(CFG.n_layer) for s in block_sites(CFG, l)]
  for k in ["x0", "x.0", "x.1", "x.2", "h.0", "h.1"] + sites + [s + ":in" for s in sites if not s.startswith("o@")]:
    assert k in cache and cache[k] is not None and cache[k].uop.is_realized, k
  assert cache["o@0:in"] is None
  c = {k: v.numpy() for k, v in cache.items() if v is not None}
  P = {k: v.numpy() for k, v in m.params.items()}
  for s in ("transformer.h.0.mlp.c_fc", "transformer.h.1.attn.c_q", "transformer.h.1.mlp.c_proj", "transformer.h.1.attn.ve_gate", "lm_head"):
    np.testing.assert_allclose(c[s], c[s + ":in"] @ P[s + ".weight"].T, atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(c["transformer.h.1.attn.c_proj:in"], c["o@1"], atol=1e-6)
  np.testing.assert_array_equal(c["transformer.wte"], P["transformer.wte.weight"][x.numpy()])
  np.testing.assert_array_equal(c["value_embeds.1"], P["value_embeds.1.weight"][x.numpy()])
  xs = c["transformer.wte"] / np.sqrt((c["transformer.wte"] ** 2).mean(-1, keepdims=True) + 1e-6)
  np.testing.assert_allclose(c["x0"], xs, atol=1e-5)
  np.testing.assert_array_equal(c["x.0"], c["x0"])
  np.testing.assert_allclose(c["h.0"], 1.1 * c["x0"], atol=1e-6)  # resid 1, x0 0.1
  np.testing.assert_allclose(c["h.1"], c["x.1"] + 0.1 * c["x0"], atol=1e-6)

def np_head(z:np.ndarray, y:np.ndarray) -> np.ndarray:
  c = 15 * np.tanh(z.astype(np.float64) / 15)
  mx = c.max(-1, keepdims=True)
  return (np.log(np.exp(c - mx).sum(-1, keepdims=True)) + mx)[..., 0] - np.take_along_axis(c, y[..., None], -1)[..., 0]

def test_jitter_value(tiny):
  # the jitter is exactly sigma * gaussian(key, shape) added to the site's output (noise on the input, a wrong scale or key fails)
  m, x, y, clean, cache = tiny
  np.testing.assert_allclose(np_head(cache["lm_head"].numpy(), y.numpy()), clean, atol=1e-5)
  g = gaussian(key(3), (B, T, CFG.vocab)).numpy()
  out = loss_np(m.losses(x, y, {"lm_head": (key(3), SIGMA)}))
  np.testing.assert_allclose(out, np_head(cache["lm_head"].numpy() + SIGMA * g, y.numpy()), atol=1e-5)
  # a writer in the last block: its noise lands in the final residual stream x.2
  x2 = cache["x.2"].numpy() + SIGMA * gaussian(key(4), (B, T, CFG.n_embd)).numpy()
  z = (x2 / np.sqrt((x2 ** 2).mean(-1, keepdims=True) + 1e-6)) @ m.params["lm_head.weight"].numpy().T
  out = loss_np(m.losses(x, y, {"transformer.h.1.mlp.c_proj": (key(4), SIGMA)}, cache=cache))
  np.testing.assert_allclose(out, np_head(z, y.numpy()), atol=1e-4)

def test_entry(tiny):
  # the rerun starts at the first jittered block, and reuses its attention only when every jitter there is after it
  m = tiny[0]
  e = lambda *names: m.entry({n: (None, SIGMA) for n in names})
  assert e("transformer.wte")[0] == -1 and e("transformer.h.1.mlp.c_fc", "transformer.wte")[0] == -1
  assert e("lm_head")[0] == CFG.n_layer
  assert e("transformer.h.1.attn.c_q") == (1, False) and e("value_embeds.1") == (1, False) and e("transformer.h.1.attn.ve_gate") == (1, False)
  assert e("transformer.h.1.mlp.c_fc") == (1, True) and e("o@1") == (1, True) and e("transformer.h.0.attn.c_proj") == (0, True)
  assert e("transformer.h.1.mlp.c_proj", "transformer.h.1.attn.c_k") == (1, False)
  assert e("transformer.h.1.attn.c_v", "transformer.h.0.mlp.c_proj", "lm_head") == (0, True)

@pytest.mark.parametrize("group", ["ends", 0, 1])
def test_rerun_from_block(tiny, group):
  # the cached rerun equals the full jittered pass for every site, also on the batch repeated along B (a wrong entry
  # block, a reused attention that the jitter changed, or a cache not tiled like the batch fails), and the jitter did something
  m, x, y, clean, cache = tiny
  sites = ["transformer.wte", "lm_head"] if group == "ends" else block_sites(CFG, group)
  x3, y3 = x.repeat(3, 1), y.repeat(3, 1)
  for i, s in enumerate(sites):
    j = {s: (key(100 + i), SIGMA)}
    full, rerun = loss_np(m.losses(x, y, j)), loss_np(m.losses(x, y, j, cache=cache))
    np.testing.assert_allclose(rerun, full, atol=1e-5, rtol=0, err_msg=s)
    assert np.abs(full - clean).max() > 1e-3, s
    full3, rerun3 = loss_np(m.losses(x3, y3, j)), loss_np(m.losses(x3, y3, j, cache=cache))
    np.testing.assert_allclose(rerun3, full3, atol=1e-5, rtol=0, err_msg=s)
    assert np.abs(full3[B:2 * B] - full3[:B]).max() > 1e-4, s  # each copy of the batch gets its own noise

def test_rerun_reads_cache(tiny):
  # the rerun really starts from the cache (a full pass that ignores it passes the equalities above): poisoning the cached
  # block input moves it only for jitters that start there, and the cached attention output only when the attention is reused
  m, x, y, _, cache = tiny
  def moved(site:str, poison:str) -> bool:
    j = {site: (key(7), SIGMA)}
    bad = {**cache, poison: (cache[poison] + 1).realize()}
    return not np.allclose(loss_np(m.losses(x, y, j, cache=cache)), loss_np(m.losses(x, y, j, cache=bad)), atol=1e-5)
  assert moved("transformer.h.1.attn.c_q", "x.1") and not moved("transformer.h.1.attn.c_q", "o@1")
  assert moved("transformer.h.1.mlp.c_fc", "o@1") and not moved("transformer.h.1.mlp.c_fc", "x.0")
  assert moved("lm_head", "x.2") and not moved("transformer.wte", "x.1")

def test_half_matmuls():
  # under dtype=half the matmuls read half weights (the attention's float32 scores: tests/test_attention.py)
  m = GPT(CFG, seed=0, dtype=dtypes.half)
  x, y = batch(CFG.vocab, B, T)
  loss = m.losses(x, y)
  assert loss.dtype == dtypes.float32
  topo = loss.uop.toposort()
  for n in ("transformer.h.0.attn.c_q.weight", "transformer.h.1.mlp.c_fc.weight", "lm_head.weight"):
    assert any(u.op is Ops.CAST and u.dtype == dtypes.half and u.src[0] is m.params[n].uop for u in topo), n
  assert any(u.op is Ops.MUL and u.dtype == dtypes.half for u in topo)

def test_half_forward():
  # the half model computes the same losses as float32 to half precision (a dtype mismatch or overflow fails)
  x, y = batch(CFG.vocab, B, T)
  l32, l16 = (loss_np(GPT(CFG, seed=0, dtype=dt).losses(x, y)) for dt in (dtypes.float32, dtypes.half))
  np.testing.assert_allclose(l16, l32, atol=2e-2)

# ***** the looped model *****

@pytest.fixture(scope="module")
def looped():
  """The tiny looped model at 2 loops (each loop's noise kernel compiles on its own), with the larger head of `tiny`."""
  m = Looped(LoopedConfig.preset("tiny", loops=2), seed=0)
  m.params["lm_head.weight"] = Tensor(np.random.default_rng(1).normal(0, 0.2, (m.cfg.vocab, m.cfg.n_embd)).astype(np.float32)).realize()
  x, y = batch(m.cfg.vocab, B, T, seed=2)
  return m, x, y

def test_looped_params():
  # weights are tied across loops: the parameter count (one block, one lambda each) must not grow with the loop count
  a, b = Looped(LoopedConfig.preset("tiny", loops=2)), Looped(LoopedConfig.preset("tiny", loops=8))
  d, V = 32, 256
  assert a.num_params() == b.num_params() == 2 * V * d + 12 * d * d + 2
  assert set(a.params) == set(b.params) and not any(n.startswith("value_embeds") or ".h.1." in n for n in a.params)

def test_looped_losses(looped):
  # the loop count is honoured per call (and equals a model built with it); the initial loss is ln(vocab)
  m, x, y = looped
  l1, l3 = loss_np(m.losses(x, y, loops=1)), loss_np(m.losses(x, y, loops=3))
  assert not np.allclose(l1, l3, atol=1e-6, rtol=0) and m.loops == 2
  np.testing.assert_allclose(loss_np(m.losses(x, y)), loss_np(m.losses(x, y, loops=2)), atol=1e-6)
  m3 = Looped(LoopedConfig.preset("tiny", loops=3), seed=0)
  assert m3.losses(x, y).mean().item() == pytest.approx(math.log(256), abs=0.01)  # with its own head (std 0.001)
  m3.params["lm_head.weight"] = m.params["lm_head.weight"]
  np.testing.assert_allclose(loss_np(m3.losses(x, y)), l3, atol=1e-6)

def test_looped_noise_per_loop(looped, monkeypatch):
  # a block site gets independent noise at every loop: the key is folded with the loop index (the same noise each loop fails)
  m, x, y = looped
  k = key(9)
  k0, k1 = m.site_key(k, 0).numpy(), m.site_key(k, 1).numpy()
  assert not np.array_equal(k0, k1) and not np.array_equal(k0, k.numpy())
  np.testing.assert_array_equal(m.site_key(k, None).numpy(), k.numpy())
  j = {"transformer.h.0.mlp.c_fc": (k, SIGMA)}
  per_loop = loss_np(m.losses(x, y, j))
  monkeypatch.setattr(m, "site_key", lambda key, i: key)
  assert not np.allclose(per_loop, loss_np(m.losses(x, y, j)), atol=1e-6)

def test_looped_capture(looped):
  # capture records each loop's sites separately, and a cached rerun (always from the embedding) equals the full pass
  m, x, y = looped
  l, cache = m.capture(x, y)
  np.testing.assert_allclose(loss_np(l), loss_np(m.losses(x, y)), atol=1e-5)
  assert all(f"transformer.h.0.attn.c_q@{i}" in cache for i in range(m.loops)) and "lm_head" in cache and "x.2" in cache
  assert not np.allclose(cache["transformer.h.0.attn.c_q@0"].numpy(), cache["transformer.h.0.attn.c_q@1"].numpy())
  j = {"transformer.h.0.mlp.c_fc": (key(9), SIGMA)}
  full = loss_np(m.losses(x, y, j))
  assert np.abs(full - loss_np(l)).max() > 1e-5
  np.testing.assert_allclose(loss_np(m.losses(x, y, j, cache=cache)), full, atol=1e-6)
