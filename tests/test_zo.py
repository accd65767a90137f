"""Tests of zo.py: no autograd in the ZO paths, the SPSA cosine law (on the looped model too), EGGROLL's batched forward and dense
form against explicit perturbed matrices, replayed momentum against a stored buffer, resume, training against a sign-flipped
estimator, the CLI, and the looped model's ZO memory against its loop count.

Cost: tinygrad on a 2-core CPU spends seconds compiling each new kernel structure, so the in-process tests share one 1-block model
(6,178 parameters) and one batch, and the CLI runs (fresh processes that compile everything again) start in the background when the
module starts, so that they use the core that the in-process tests leave idle."""
import itertools, json, math, os, re, signal, subprocess, sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
import numpy as np
import pytest
from tinygrad import Context, Tensor, dtypes
from tinygrad.nn.state import safe_load
from kernels.noise import fold, gaussian, key as root_key
from kernels.perturb import Population, combine
from model import GPT, GPTConfig, Looped, LoopedConfig
import data
import tinygrad.engine.realize
import cosine, engine, estimators, optim, zo

CFG = GPTConfig(vocab=64, seq_len=16, n_layer=1, n_head=2, n_embd=16)
B, T = 2, 16
ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "DEV": "CPU"}  # NOOPT and PARALLEL from conftest.py
# the CLI's training runs: the tiny preset at vocab 64, 2x16 tokens a step, mezo with 2 directions, a replay window of 4 steps (so
# the window is full at the step-5 checkpoint and keeps sliding after the resume)
RUN = {"method": "mezo", "pop": 2, "model": "tiny", "vocab": 64, "seq": T, "batch": B, "lr": 3e-3, "eval-every": 5, "ckpt-every": 5,
       "replay": 4, "seed": 0}

@pytest.fixture(scope="module", autouse=True)
def fast_compile():
  """On the CPU, tinygrad's kernel optimizer costs ~3x more lowering time than these tiny kernels ever win back."""
  with Context(NOOPT=1): yield

def cli(*args, **flags) -> subprocess.CompletedProcess:
  argv = [*map(str, args), *(s for k, v in flags.items() for s in ((f"--{k}",) if v is True else (f"--{k}", str(v))))]
  return subprocess.run([sys.executable, "zo.py", *argv], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)

@pytest.fixture(scope="module", autouse=True)
def background(request, tmp_path_factory):
  """The CLI runs that the selected tests need, started now: a 10-step run, and a 5-step run then resumed to 10 steps; the --cosine
  table; the looped model's memory probes. They run while the in-process tests compile."""
  wanted = {getattr(item, "originalname", item.name) for item in request.session.items}
  out = tmp_path_factory.mktemp("runs")
  with ThreadPoolExecutor(2) as pool:
    jobs = {}
    if wanted & {"test_resume_continues_exactly", "test_resume_refusals", "test_plot", "test_cosine_at_checkpoint"}:
      jobs["full"] = pool.submit(cli, **RUN, steps=10, out=out / "full")
    if wanted & {"test_resume_continues_exactly", "test_resume_refusals", "test_plot"}:
      jobs["split"] = pool.submit(lambda: (cli(**RUN, steps=5, out=out / "split"), cli(**RUN, steps=10, out=out / "split", resume=True)))
    if "test_cli_cosine_table" in wanted:
      jobs["cosine"] = pool.submit(cli, "--cosine", "--pop", 4, 16, method="mezo", model="tiny", vocab=64, seq=T, batch=B)
    if "test_looped_zo_memory_flat" in wanted:
      for method, loops in itertools.product(("mezo", "es"), (4, 32)): jobs[method, loops] = pool.submit(memory_probe, method, loops)
    yield out, jobs

@pytest.fixture(scope="module")
def setup():
  """The model, one batch, and the autograd gradient of the mean token loss as float64 arrays."""
  model = GPT(CFG, seed=0)
  rng = np.random.default_rng(0)
  x, y = [Tensor(rng.integers(0, CFG.vocab, (B, T)).astype(np.int32)).realize() for _ in range(2)]
  true = {n: g.numpy().astype(np.float64) for n, g in estimators.estimate(model, x, y, "backprop", 1, 0).items()}
  return model, x, y, true

@pytest.fixture(scope="module")
def looped():
  """As `setup`, for a 4-loop looped model of the same width (5,122 parameters)."""
  model = Looped(LoopedConfig(vocab=CFG.vocab, seq_len=T, n_head=2, n_embd=16, loops=4), seed=0)
  rng = np.random.default_rng(0)
  x, y = [Tensor(rng.integers(0, CFG.vocab, (B, T)).astype(np.int32)).realize() for _ in range(2)]
  true = {n: g.numpy().astype(np.float64) for n, g in estimators.estimate(model, x, y, "backprop", 1, 0).items()}
  return model, x, y, true

def flat(g:dict, names) -> np.ndarray:
  if ts := [g[n] for n in names if isinstance(g[n], Tensor)]: Tensor.realize(*ts)  # one schedule for all, not one a parameter
  return np.concatenate([np.asarray(g[n].numpy() if isinstance(g[n], Tensor) else g[n], np.float64).ravel() for n in names])

# ***** 1. no autograd in the ZO paths *****

def test_no_autograd_in_zo_paths(setup, monkeypatch):
  # an estimator or optimizer step that differentiates (a disguised backprop, a .backward() to fill p.grad) raises here
  _, x, y, _ = setup
  model = GPT(CFG, seed=0)  # a model of its own: its JITs capture here, running the Python (another's would replay its kernels)
  def refuse(*a, **k): raise AssertionError("autograd in a ZO path")
  monkeypatch.setattr(Tensor, "backward", refuse)
  monkeypatch.setattr(Tensor, "gradient", refuse)
  with pytest.raises(AssertionError, match="autograd"): estimators.estimate(model, x, y, "backprop", 1, 0)  # the patch does bite
  for method, pop, opts in (("mezo", 4, {}), ("es", 8, {}), ("es", 8, {"rank": 1})):
    g = estimators.estimate(model, x, y, method, pop, 1, **opts)
    assert g.keys() == model.params.keys()
    for n, p in model.params.items():
      v = g[n].numpy()
      assert v.shape == p.shape and np.isfinite(v).all() and np.abs(v).sum() > 0, (method, opts, n)
  g = estimators.run(model, x, y, "mezo", 4, 1)[0]  # an estimate is a key and coefficients: any model of these shapes can take it
  for kind, momentum in (("sgd", 0.9), ("adamw", 0.8)):  # the seed replay (sgd) and the dense path (adamw), each captured here
    m = GPT(CFG, seed=0)
    opt = optim.Optimizer(m.params, {n: 1e-3 for n in m.params}, kind, momentum, 4)
    before = {n: p.numpy() for n, p in m.params.items()}
    opt.step(g)
    assert all(not np.array_equal(before[n], p.numpy()) and np.isfinite(p.numpy()).all() for n, p in m.params.items()), kind

# ***** 2. the SPSA law *****

# With K Gaussian directions z_k in D dimensions, g_hat = (1/K) sum_k (z_k.g) z_k (mezo; es unshaped with K antithetic pairs, i.e.
# pop 2K), E|g_hat|^2 = |g|^2 (D+K+1)/K and g_hat.g ~ |g|^2, so cos(g_hat, g) ~ sqrt(K/(K+D)). For K << D, cos ~ sqrt(chi2_K / D):
# its mean is sqrt(K/D)(1 - 1/(4K)) (6% low at K=4) and its std ~ 1/sqrt(2D) whatever K, i.e. a relative std ~ 1/sqrt(2K) of one
# key's cosine (0.35 at K=4, 0.09 at K=64, 0.03 at K=512, checked by simulation). For the 30% band to be a 3-sigma statement,
# 3 * 0.35/sqrt(n) <= 0.30 - 0.06 needs n >= 20 keys at K=4; n = 2 and 1 do at K=64 and 512.
# Also unbiased: g_hat.g/|g|^2 = mean over the K directions of chi2_1, so pooled over the 24*4 + 2*64 + 512 = 736 directions it is
# 1 +- sqrt(2/736) = 1 +- 0.05: within 0.2 is 4 sigma (a wrong scale, e.g. a missing 1/(2 eps) or 1/K, fails it; the cosine can't see it).
# None of this depends on D or the architecture, so it holds for the looped model too (every loop reads the tied weight plus the same
# perturbation); the bands of K = 4, 64, 512 don't overlap there (D = 5,122: law 0.028, 0.111, 0.302), so the cosine rises with K.
KEYS = {4: 24, 64: 2, 512: 1}

PAGE = re.findall(r"```python\n(.*?)```", (ROOT / "docs/estimator.md").read_text(), re.S)  # docs/estimator.md's code, as shown

@pytest.fixture(scope="module")
def page() -> list[str]:
  """The estimators of docs/estimator.md, registered by running exactly the code shown there: one-sided SPSA and two-sided SPSA with
  a decaying ε, whose cosines follow SPSA's law (their O(ε) bias, at ε = 1e-3, is far below the law's band), and sign-MeZO."""
  assert len(PAGE) == 3
  for block in PAGE: exec(block, {})
  return [re.search(r'@estimator\("(\w+)"', b).group(1) for b in PAGE]

def at_step(method:str, step:int) -> dict: return estimators.at_step(estimators.ESTIMATORS[method], step)  # as the training loop passes it

def signed(K:int, D:int) -> float:
  """sign-MeZO's cosine law: g_hat = (1/K) sum_k s_k z_k, s_k = sign(z_k.g), so E[g_hat.g] = |g| sqrt(2/pi) and E|g_hat|^2 =
  D/K + (2/pi)(K-1)/K (distinct directions' terms have E[s_j z_j].E[s_k z_k] = 2/pi)."""
  return math.sqrt(2 / math.pi) / math.sqrt(D / K + 2 / math.pi * (K - 1) / K)

@pytest.mark.parametrize("method, net", [("mezo", "setup"), ("es", "setup"), ("es", "looped"), *[(f"page{i}", "setup") for i in range(3)]])
def test_spsa_law(method:str, net:str, request, monkeypatch):
  # an estimator with a wrong direction/coefficient pairing, too few or correlated directions, or a wrong scale breaks this (es on the
  # looped model too: the cosine must rise with the population as on a plain model; and the docs' three estimators, sign-MeZO by its
  # own law: its g_hat.g/|g| is the mean of |N(0, 1)| over the directions, sqrt(2/pi) +- 0.022 at 736 directions)
  model, x, y, true = request.getfixturevalue(net)
  if method.startswith("page"): method = request.getfixturevalue("page")[int(method[4:])]
  sign = method == "signmezo"
  monkeypatch.setattr(estimators, "TOKENS", 4 * x.numel())  # 4 pairs a forward at every K: one forward compiled, not one per K (chunks
                                                    # leave the estimate as it is: test_estimate_pinned_chunked_or_not)
  names, gv = list(model.params), flat(true, model.params)
  D = gv.size
  rows, proj, dirs = {}, 0.0, 0
  for K, n in KEYS.items():
    cos = []
    for key in range(n):
      if method == "mezo": g = flat(estimators.estimate(model, x, y, "mezo", K, 100 + key), names)
      elif method == "es": g = flat(estimators.estimate(model, x, y, "es", 2 * K, 200 + key, shaping="none"), names)
      else: g = flat(estimators.estimate(model, x, y, method, K, 300 + key, **at_step(method, 0)), names)
      cos.append(g @ gv / (np.linalg.norm(g) * np.linalg.norm(gv)))
      proj, dirs = proj + K * (g @ gv) / (gv @ (gv if not sign else gv / np.linalg.norm(gv))), dirs + K
    rows[K] = (float(np.mean(cos)), signed(K, D) if sign else math.sqrt(K / (K + D)))
  msg = f"{method} on {net}, D={D}: " + ", ".join(f"K={K}: cos {c:.4f} law {law:.4f}" for K, (c, law) in rows.items()) + \
        f"; g_hat.g/|g|{'' if sign else '^2'} {proj / dirs:.3f}"
  assert all(abs(c / law - 1) < 0.3 for c, law in rows.values()), msg
  assert abs(proj / dirs / (math.sqrt(2 / math.pi) if sign else 1) - 1) < 0.2, msg

def test_es_population_change_on_one_model(setup):
  # es's jitted population forward must be keyed on the population: `--cosine --pop 8 128 --method es` runs es twice on one model
  model, x, y, _ = setup
  for pop in (8, 128):
    g, _ = estimators.run(model, x, y, "es", pop, 1)
    assert g.key.shape == (2,) and g.coef.shape == (pop // 2,)

def test_backprop_jit_follows_the_weights(setup):
  """backprop runs as a TinyJit that reads the weights as inputs: after an in-place update, and after a later call, each returned
  gradient is still that of the weights it was computed at (a gradient left in the JIT's output buffers would be overwritten)."""
  model, x, y, true = setup
  saved = {n: p.numpy() for n, p in model.params.items()}
  try:
    grads = []
    for scale in (1.0, 1.5, 2.0):  # the first call captures the JIT, the others replay it
      for n, p in model.params.items(): p.assign(Tensor(saved[n] * scale)).realize()
      grads.append(estimators.estimate(model, x, y, "backprop", 1, 0))
    for n in model.params: model.params[n].assign(Tensor(saved[n] * 1.5)).realize()
    fresh = estimators.estimate(GPT(CFG, seed=0), x, y, "backprop", 1, 0)  # a new model, a new JIT: scale 1, as in `true`
    for n in true:
      np.testing.assert_allclose(grads[0][n].numpy(), true[n], rtol=1e-4, atol=1e-7)
      np.testing.assert_allclose(fresh[n].numpy(), true[n], rtol=1e-4, atol=1e-7)
    assert not np.allclose(grads[1]["lm_head.weight"].numpy(), grads[2]["lm_head.weight"].numpy())  # other weights, other gradient
    np.testing.assert_allclose(grads[1]["lm_head.weight"].numpy(), estimators.estimate(model, x, y, "backprop", 1, 0)["lm_head.weight"].numpy(),
                               rtol=1e-5, atol=1e-8)
  finally:
    for n, p in model.params.items(): p.assign(Tensor(saved[n])).realize()

def test_checked_names_the_nonfinite_gradient(setup):
  """backprop's gradient is checked whole, one sum of squares; a non-finite one still stops the step naming the parameter that holds it,
  and a finite one passes with its loss."""
  model, x, y, _ = setup
  g, loss = estimators.run(model, x, y, "backprop", 1, 0)
  assert zo.checked(model, loss, g, 7, "out") == pytest.approx(loss.item())
  names, buf = list(model.params), g.buf.numpy()
  buf[sum(p.numel() for p in list(model.params.values())[:3]) + 1] = np.inf  # the second value of the fourth parameter
  with pytest.raises(zo.UsageError, match=rf"step 7: the estimate of {re.escape(names[3])} is not finite"):
    zo.checked(model, loss, estimators.Flat(t := Tensor(buf), estimators.flat_squares(loss, t).realize()), 7, "out")  # realized, as by a JIT

# the estimates for key 1 on the fixture (one forward for all of es's members; mezo's directions one JIT call each): per parameter, the
# projection on a fixed Gaussian vector and the norm. Recorded at 6c50254, and anew with four Gaussians a threefry call ([noise-gen]).
# Evaluated in chunks, they must stay where they are.
PINS = {("mezo", 4, 0): ([-5.42188, -3.07552, 7.03658, -6.25946, -1.07919, 2.96583, -3.69622, -6.10251, 18.8022, -1.99239, 0.12279, -0.0129451],
                         [9.17147, 4.33023, 4.71327, 4.49571, 1.49403, 4.38749, 9.20391, 8.77523, 9.0688, 9.07387, 0.176461, 0.0909214]),
        ("es", 8, 0): ([-297.963, -197.869, 416.662, -379.289, -74.2393, 171.65, -184.79, -328.241, 1115.58, -84.5067, 5.78835, -0.848917],
                       [524.241, 249.764, 270.939, 258.067, 85.7025, 253.09, 526.424, 502.663, 518.171, 521.759, 8.31838, 5.96246]),
        ("es", 8, 2): ([671.923, 324.097, 116.913, 477.827, 115.331, 448.152, 317.871, -535.379, 837.456, -969.629, 0.674993, -0.574787],
                       [560.075, 245.26, 277.106, 263.24, 94.0739, 306.32, 601.53, 457.434, 575.966, 528.34, 0.970026, 4.03708])}

@pytest.mark.parametrize("method, pop, rank", list(PINS))
def test_estimate_pinned_chunked_or_not(setup, method:str, pop:int, rank:int, monkeypatch):
  # the population forward (all pairs in one, B x T = 32 tokens) must give the pinned estimate, and one pair a forward (as on the
  # dust preset) exactly this one; a chunk that drew another pair's direction, lost a pair, or mixed up the signs of a pair across
  # its two forwards changes it
  model, x, y, _ = setup
  opts = {"rank": rank} if method == "es" else {}
  one = {n: t.numpy() for n, t in estimators.estimate(model, x, y, method, pop, 1, **opts).items()}
  rng = np.random.default_rng(1)
  proj, norm = [float((v * rng.standard_normal(v.shape)).sum()) for v in one.values()], [float(np.linalg.norm(v)) for v in one.values()]
  pin_proj, pin_norm = PINS[method, pop, rank]
  np.testing.assert_allclose(norm, pin_norm, rtol=1e-4)
  assert np.all(np.abs(np.array(proj) - pin_proj) <= 1e-4 * np.array(pin_norm)), (proj, pin_proj)
  monkeypatch.setattr(estimators, "TOKENS", x.numel())
  chunked = estimators.estimate(model, x, y, method, pop, 1, **opts)
  for n in one: np.testing.assert_array_equal(chunked[n].numpy(), one[n], err_msg=n)

# ***** 3. EGGROLL *****

def explicit_directions(keys:Tensor, shape:tuple[int, ...], rank:int) -> np.ndarray:
  """E_j [N, *shape] formed explicitly: A_j B_j^T / sqrt(r) for a matrix (A from the key folded with 0, B with 1), else Gaussian."""
  if len(shape) != 2: return gaussian(keys, shape).numpy().astype(np.float64)
  a, b = (gaussian(fold(keys, c), (d, rank)).numpy().astype(np.float64) for c, d in ((0, shape[0]), (1, shape[1])))
  return np.einsum("jor,jir->joi", a, b) / math.sqrt(rank)

def test_eggroll_equals_explicit_matrices(setup):
  # a batched low-rank forward with a wrong member order or sign, a missing 1/sqrt(r), or A and B swapped differs from the explicit one
  model, x, y, _ = setup
  pop, rank, sigma = 4, 2, 0.1  # rank 2, so that a missing 1/sqrt(r) shows; sigma 0.1, so that every member moves the loss by ~1e-2
  g, mean_loss = estimators.run(model, x, y, "es", pop, 7, sigma=sigma, shaping="none", rank=rank)
  keys = fold(g.key, Tensor.arange(pop // 2))  # pair j's direction
  E = {n: explicit_directions(fold(keys, i), p.shape, rank) for i, (n, p) in enumerate(model.params.items())}
  W = {n: p.numpy().astype(np.float64) for n, p in model.params.items()}
  sign = [1, -1] * (pop // 2)  # member m = 2j + (0 or 1) is W + sign_m sigma E_j
  explicit = np.array([model.losses(x, y, params={n: Tensor((W[n] + sign[m] * sigma * E[n][m // 2]).astype(np.float32)) for n in W})
                       .mean().item() for m in range(pop)])
  def batched(sign:int) -> np.ndarray:  # the pairs' members of one sign, one forward
    params = {n: Population(p, fold(keys, i), sign * sigma, rank) for i, (n, p) in enumerate(model.params.items())}
    return model.losses(x.repeat(pop // 2, 1), y.repeat(pop // 2, 1), params=params).reshape(pop // 2, -1).mean(1).numpy()
  batched = np.stack([batched(1), batched(-1)], 1).reshape(-1)
  # a float32 loss of ~4.2 from logits summed in another order: errors ~1e-6; 2e-5 is 40 ulps, 500x below the members' spread
  clean = model.losses(x, y).mean().item()
  assert np.abs(explicit - clean).min() > 1e-2, (explicit, clean)
  np.testing.assert_allclose(batched, explicit, rtol=0, atol=2e-5)
  # es's own coefficients and loss come from that forward: coef_j = (L_2j - L_2j+1) / (pop sigma), unshaped
  np.testing.assert_allclose(g.coef.numpy(), (explicit[0::2] - explicit[1::2]) / (pop * sigma), rtol=0, atol=4e-5 / (pop * sigma))
  assert abs(mean_loss.item() - explicit.mean()) < 2e-5
  # the dense form: sum_j coef_j A_j B_j^T / sqrt(r) (float32 sums of 2 pairs x rank 2 terms: relative error ~1e-7)
  coef = g.coef.numpy().astype(np.float64)
  for n, d in g.dense(model.params).items():
    ref = np.einsum("j,j...->...", coef, E[n])
    np.testing.assert_allclose(d.numpy(), ref, rtol=0, atol=1e-5 * np.abs(ref).max(), err_msg=n)

def test_dense_form_of_any_number_of_directions():
  # combine pads a full-rank sum over 9..32 keys with keys of coefficient 0 (kernels/perturb.UNROLLED): a pad that shifted the keys
  # against their coefficients, or left the added keys any weight, differs from the explicit sum (float32 sums of <= 33 terms: ~1e-6)
  rng = np.random.default_rng(0)
  for n in (4, 16, 33):
    keys, coef = fold(root_key(5), Tensor.arange(n)), rng.standard_normal(n).astype(np.float32)
    ref = np.einsum("j,j...->...", coef.astype(np.float64), gaussian(keys, (8, 4)).numpy().astype(np.float64))
    np.testing.assert_allclose(combine(keys, Tensor(coef), (8, 4), 0).numpy(), ref, rtol=0, atol=1e-5 * np.abs(ref).max(), err_msg=str(n))

# ***** 4. replayed momentum *****

def test_replayed_momentum_equals_buffer():
  # a replay with a wrong decay power, an off-by-one history shift, or lost slots differs from the buffer m <- mu m + g; so does the
  # optimizer's own buffer (replay 0, the default) if it applied the estimate wrongly
  rng = np.random.default_rng(0)
  mu, lr, N, steps = 0.9, 1e-2, 4, 20
  shapes = {"w": (48, 32), "s": (8,)}
  init = {n: rng.normal(0, 1, s).astype(np.float32) for n, s in shapes.items()}
  # synthetic estimates: random root keys, coefficients +-1 (so every step's g has the same expected norm)
  gs = [estimators.Compact(Tensor(rng.integers(0, 2**32, 2, dtype=np.uint32)), Tensor(rng.choice([-1.0, 1.0], N).astype(np.float32)))
        for _ in range(steps)]
  probe = {n: Tensor(v) for n, v in init.items()}
  dense = [{n: t.numpy().astype(np.float64) for n, t in g.dense(probe).items()} for g in gs]
  def replay(W:int) -> list[dict[str, np.ndarray]]:
    ps = {n: Tensor(v).realize() for n, v in init.items()}
    opt, out = optim.Optimizer(ps, {n: lr for n in ps}, "sgd", mu, W), []
    for g in gs:
      opt.step(g)
      out.append({n: p.numpy().astype(np.float64) for n, p in ps.items()})
    return out
  def buffer(W:int) -> list[dict[str, np.ndarray]]:  # float64; W=steps is the stored buffer m <- mu m + g exactly
    th, out = {n: v.astype(np.float64) for n, v in init.items()}, []
    for t in range(steps):
      th = {n: th[n] - lr * sum(mu ** a * dense[t - a][n] for a in range(min(W, t + 1))) for n in th}
      out.append(th)
    return out
  def gap(a:list, b:list, t:int) -> float:  # relative difference of step t's update
    da, db = (flat(x[t], shapes) - flat(x[t - 1], shapes) for x in (a, b))
    return float(np.linalg.norm(da - db) / np.linalg.norm(db))
  full, stored, ref = replay(steps), replay(0), buffer(steps)
  scale = np.abs(flat(ref[-1], shapes) - flat(init, shapes)).max()
  for t in range(steps):  # float32 parameters of size ~1 after 20 updates: 1e-5 of the largest displacement is ~100 ulps
    np.testing.assert_allclose(flat(full[t], shapes), flat(ref[t], shapes), rtol=0, atol=1e-5 * scale)
    np.testing.assert_allclose(flat(stored[t], shapes), flat(ref[t], shapes), rtol=0, atol=1e-5 * scale)
  short = replay(5)
  assert gap(short, buffer(5), steps - 1) < 1e-5  # a window of 5 keeps exactly the last 5 steps
  # and so misses the tail sum_{a>=5} mu^a g_{t-a}: for nearly orthogonal steps of equal norm its relative size is
  # sqrt(sum_{a=5..19} mu^2a / sum_{a<20} mu^2a) = 0.57 ~ mu^5; the cross terms of 80 directions in 1544 dims move it by a few %
  tail = math.sqrt(sum(mu ** (2 * a) for a in range(5, steps)) / sum(mu ** (2 * a) for a in range(steps)))
  assert abs(gap(short, ref, steps - 1) / tail - 1) < 0.2, (gap(short, ref, steps - 1), tail)

def test_replay_keeps_no_buffer():
  # --replay's point is memory: the state is the last W steps' keys and coefficients, no momentum buffer of D floats; and an estimate
  # without seeds (Dust's, backprop's) is refused, where SGD without its buffer would silently drop the momentum
  ps = {"w": Tensor.zeros(48, 32).contiguous().realize()}
  opt = optim.Optimizer(ps, {"w": 1e-3}, "sgd", 0.9, 4)
  opt.step(estimators.Compact(Tensor([1, 2], dtype=dtypes.uint32), Tensor([1.0, -1.0])))
  assert {k: t.numel() for k, t in opt.state().items() if t.numel() > 1} == {"replay.keys": 4 * 2, "replay.coef": 4 * 2}
  with pytest.raises(ValueError, match="replay 0"): opt.step({"w": Tensor.zeros(48, 32)})

def test_old_replay_history_refused():
  # the history now keeps a root key per step; a checkpoint that kept a key per direction ([W, N, 2]) must stop with one clear error,
  # not load and fail later inside the update's JIT
  ps = {"w": Tensor.zeros(4, 3).contiguous().realize()}
  opt = optim.Optimizer(ps, {"w": 1e-3}, "sgd", 0.9, 4)
  with pytest.raises(ValueError, match=r"replay history has keys of shape \(4, 2, 2\).*--force"):
    opt.load({"replay.keys": Tensor.zeros(4, 2, 2, dtype=dtypes.uint32), "replay.coef": Tensor.zeros(4, 2)})
  opt.load({"replay.keys": Tensor.zeros(4, 2, dtype=dtypes.uint32), "replay.coef": Tensor.zeros(4, 2)})
  assert opt.keys.shape == (4, 2) and opt.coef.shape == (4, 2)

# ***** 6. training, against the same estimator with its sign flipped *****

def train_val(method:str, pop:int, lr:float, flip:bool, steps:int=40, **opts) -> tuple[float, float]:
  """(val loss before, after) of `steps` SGD steps (momentum 0.9 replayed over 8 steps) on the synthetic Markov source."""
  src = data.load("synthetic", CFG.vocab, T, 0)
  val = [tuple(map(Tensor, src.batch("val", i, B, T))) for i in range(4)]
  model = GPT(CFG, seed=0)
  opt = optim.Optimizer(model.params, {n: lr for n in model.params}, "sgd", 0.9, 8)
  def val_loss() -> float: return float(np.mean([model.losses(vx, vy).mean().item() for vx, vy in val]))
  before = val_loss()
  for step in range(steps):
    x, y = map(Tensor, src.batch("train", step, B, T))
    g, _ = estimators.run(model, x, y, method, pop, step, **opts, **at_step(method, step))
    opt.step(estimators.Compact(g.key, -g.coef, g.rank) if flip else g)
  return before, val_loss()

# lrs from a sweep at 40 steps (two key streams each): the defaults (0.05) diverge on this model (the val loss climbs past 7);
# mezo pop 16: 0.003 lowers it by ~0.03, 0.01 by 0.04-0.10, 0.03 diverges; es pop 32 (rank shaping, coefficients ~1/(pop sigma)):
# 1e-4 by ~0.03, 3e-4 by 0.04-0.11, 1e-3 diverges. So each runs at a third of its divergence lr.
@pytest.mark.parametrize("method, pop, lr", [("mezo", 16, 1e-2), ("es", 32, 3e-4), *[(f"page{i}", 16, 1e-2) for i in range(3)]])
def test_training_lowers_val_loss(method:str, pop:int, lr:float, request):
  # an estimator that points uphill, or carries no gradient signal (pure noise also raises the loss, through the curvature), fails
  # The val batches are fixed, so the val loss has no sampling noise. To first order a step moves it by -lr g.g_hat, to second order by
  # +lr^2/2 g_hat.H.g_hat for either sign: the flipped run must rise, the true one fall by a margin, 0.01 nats (0.25% of ln 64).
  # docs/estimator.md's SPSAs have MeZO's scale, so they run at MeZO's lr. Sign-MeZO's |g_hat|^2 ~ D/K where MeZO's is |g|^2 (D + K)/K,
  # so at |g| times MeZO's lr its steps have MeZO's length but sqrt(2/pi) of its first-order gain: measured there, a gain of 0.064 and a
  # curvature term of 0.055 (half the true and flipped runs' sum and difference). Half that lr halves the gain and quarters the
  # curvature term (|g| at the setup's initial weights, which are these).
  if method.startswith("page"): method = request.getfixturevalue("page")[int(method[4:])]
  if method == "signmezo": lr *= np.linalg.norm(flat(true := request.getfixturevalue("setup")[3], list(true))) / 2
  b0, a0 = train_val(method, pop, lr, flip=False)
  b1, a1 = train_val(method, pop, lr, flip=True)
  assert b0 == b1 and b0 - a0 > 0.01 and b1 - a1 < 0, f"{method}: val {b0:.4f} -> {a0:.4f}, flipped -> {a1:.4f}"

def test_page_plugin_flags_and_schedule(page, tmp_path, monkeypatch):
  # docs/estimator.md's estimators as a --plugin file: `python zo.py --plugin my_estimators.py --method spsa2 --decay 0.2` must train
  # with it, its flags reaching it and the step reaching it as a tensor; and its schedule eps_t must compile nothing after the first
  # steps: a step passed as an int (eps_t a float: a constant of the kernels, a key of engine.jit's captures) compiles new kernels at
  # every step, which the counts of lowered programs and captured JITs see
  monkeypatch.setattr(signal, "signal", lambda *a: None)  # zo.main's Ctrl-C handler would outlive the run in this process
  (plugin := tmp_path / "my_estimators.py").write_text("\n".join(PAGE))
  real, seen, counts = zo.run, [], []
  def spy(*a, **kw):
    counts.append((len(tinygrad.engine.realize.to_program_cache), len(engine._jits)))
    seen.append({k: v.item() if isinstance(v, Tensor) else v for k, v in kw.items()})
    return real(*a, **kw)
  monkeypatch.setattr(zo, "run", spy)
  zo.main(["--plugin", str(plugin), "--method", "spsa2", "--pop", "4", "--eps", "2e-3", "--decay", "0.2", "--model", "tiny", "--vocab", "64",
           "--seq", str(T), "--batch", str(B), "--steps", "10", "--out", str(tmp_path / "run")])
  end = (len(tinygrad.engine.realize.to_program_cache), len(engine._jits))
  assert seen == [{"eps": 2e-3, "decay": 0.2, "step": float(s)} for s in range(10)], seen
  assert [r["step"] for r in metrics(tmp_path / "run")] == list(range(10))
  assert counts[3] == end, f"programs and JITs at the start of each step: {counts}, at the end: {end}"
  with pytest.raises(SystemExit) as e: zo.main(["--plugin", str(plugin), "--method", "signmezo", "--decay", "0.2"])
  assert e.value.code == 2

# ***** 5. resume (CLI) *****

def metrics(path:Path) -> list[dict]: return [json.loads(line) for line in open(path / "metrics.jsonl")]

def test_resume_continues_exactly(background):
  # a checkpoint without the replay history or the step, or a data order that depends on the process, changes steps 5..9
  out, jobs = background
  full, (first, second) = jobs["full"].result(), jobs["split"].result()
  for r in (full, first, second): assert r.returncode == 0, r.stderr[-2000:]
  a, b = metrics(out / "full"), metrics(out / "split")
  assert [r["step"] for r in a] == [r["step"] for r in b] == list(range(10))
  assert all(r["tokens"] == (r["step"] + 1) * B * T and r["seconds"] >= 0 for r in a + b)
  np.testing.assert_allclose([r["train_loss"] for r in b], [r["train_loss"] for r in a], rtol=0, atol=1e-6)
  assert all("val_loss" in r for r in (a[0], a[5], a[9], b[0], b[4], b[5], b[9]))  # every 5 steps and at the end of each run
  for ra, rb in zip(a, b):
    if "val_loss" in ra and "val_loss" in rb: assert abs(ra["val_loss"] - rb["val_loss"]) < 1e-6, (ra, rb)
  pa, pb = safe_load(str(out / "full" / "model.safetensors")), safe_load(str(out / "split" / "model.safetensors"))
  for n in [k for k in pa if k.startswith("param.")]: np.testing.assert_allclose(pb[n].numpy(), pa[n].numpy(), rtol=0, atol=1e-6, err_msg=n)
  config = json.load(open(out / "split" / "config.json"))
  assert config["steps"] == 10 and config["forwards_per_step"] == 2 * RUN["pop"]  # MeZO: two forwards per direction

def test_resume_refusals(background):
  # resuming into another method or model shape, or overwriting a run without --force, must stop with exit code 2 and one line
  out, jobs = background
  full, (first, _) = jobs["full"].result(), jobs["split"].result()
  assert full.returncode == 0 and first.returncode == 0, (full.stderr[-2000:], first.stderr[-2000:])
  before = {d: (out / d / "metrics.jsonl").read_text() for d in ("full", "split")}
  for over, name, says in (({"method": "es", "resume": True}, "split", "method"), ({"vocab": 32, "resume": True}, "split", "vocab"),
                           ({}, "full", "--resume")):
    r = cli(**(RUN | over), steps=12, out=out / name)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and r.stderr.startswith("zo: error:") and says in r.stderr, \
      (over, r.stderr[-2000:])
  assert all((out / d / "metrics.jsonl").read_text() == before[d] for d in before), "a refused run touched the log"

def png_size(path:Path) -> tuple[int, int]:
  """(width, height) from a PNG's signature and IHDR chunk; an error if the file is no PNG."""
  head = path.read_bytes()[:24]
  assert head[:8] == b"\x89PNG\r\n\x1a\n" and head[12:16] == b"IHDR", head
  return int.from_bytes(head[16:20], "big"), int.from_bytes(head[20:24], "big")

def test_plot(background, tmp_path:Path):
  # plot.py draws the val loss of two real (tiny) runs, and a bench's Dust rows beside the reference, as PNG images
  out, jobs = background
  assert jobs["full"].result().returncode == 0 and jobs["split"].result()[1].returncode == 0
  bench = tmp_path / "bench.json"
  bench.write_text(json.dumps([{"preset": "dust", "method": "dust", "pop": p, "devices": 1, "s": s} for p, s in ((256, 2.0), (1024, 5.0))]))
  for args, png in (([out / "full", out / "split"], tmp_path / "loss.png"), (["--bench", bench, "--reference", ROOT / "docs/reference.json"],
                                                                          tmp_path / "dust.png")):
    r = subprocess.run([sys.executable, "plot.py", *map(str, args), "--out", str(png)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    w, h = png_size(png)
    assert w > 100 and h > 100, (png, w, h)

def test_reach_table(tmp_path:Path):
  # the race table: a run's time to reach the target's final loss is its FIRST evaluation at or below it (not its last, not a
  # train loss), "never" when none is, and the rows go from the best final val loss to the worst
  import plot
  curves = {"target": [(0, 5.0, 10.0), (9, 2.0, 90.0)], "fast": [(0, 5.0, 1.0), (4, 1.9, 2.0), (9, 1.5, 3.0)],
            "slow": [(0, 5.0, 1.0), (9, 2.5, 4.0)]}
  for name, evals in curves.items():
    (tmp_path / name).mkdir()
    rows = [{"step": s, "tokens": 10 * (s + 1), "train_loss": 0.0, "seconds": t, "val_loss": v} for s, v, t in evals]
    rows.insert(1, {"step": 1, "tokens": 20, "train_loss": 1.0, "seconds": 1.5})  # a line without an evaluation is skipped
    (tmp_path / name / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
  table = plot.reach_table([str(tmp_path / n) for n in curves], str(tmp_path / "target")).splitlines()
  assert "2.000" in table[0] and table[2:] == ["| fast | 1.500 | 3.0 | 2.0 | 50 |", "| target | 2.000 | 90.0 | 90.0 | 100 |",
                                               "| slow | 2.500 | 4.0 | never | never |"], table
  # a run without any evaluation is refused with one line naming it, not a traceback
  (tmp_path / "none").mkdir()
  (tmp_path / "none" / "metrics.jsonl").write_text(json.dumps({"step": 0, "tokens": 10, "train_loss": 1.0, "seconds": 1.0}) + "\n")
  r = subprocess.run([sys.executable, "plot.py", str(tmp_path / "fast"), str(tmp_path / "none"), "--reach", str(tmp_path / "fast"), "--out",
                      str(tmp_path / "x.png")], cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert r.returncode == 2 and "Traceback" not in r.stderr and "no val loss in" in r.stderr and "none" in r.stderr, r.stderr[-2000:]

def test_best_table(tmp_path:Path):
  # the fine-tuning race's table: each method's row is its run of lowest val loss along the way (its kept best: not its last val,
  # and a run that failed later keeps what it reached), listing every lr tried in increasing order with its lowest val, the seconds and
  # forwards (steps x the declared forwards a step) to that val, the val of the last evaluation by 10, 20 and 40 s ("-" before the
  # first), and how docs/device_run.sh's log says it ended; the best method first. A run stopped before its first evaluation (a first
  # step longer than the budget) is an lr tried with no val ("-"), and a method with no other is last, its row all "-"
  import plot
  runs = {"b-0.01": ("b", 0.01, 4, [(0, 5.0, 1.0), (5, 1.0, 5.0), (9, 2.0, 9.0)], 130),
          "b-0.1": ("b", 0.1, 4, [(0, 5.0, 1.0), (4, 1.2, 5.0), (9, 1.5, 9.0)], 130),
          "b-1": ("b", 1.0, 4, [(0, 5.0, 1.0), (5, 0.5, 3.0), (7, 1.6, 12.0)], 0),
          "a-1": ("a", 1.0, 3, [(0, 5.0, 11.0), (8, 1.8, 30.0)], 2), "a-2": ("a", 2.0, 3, [], 130),
          "z-1": ("z", 1.0, 3, [], 130), "c": ("c", None, 3, [(0, 5.0, 1.0)], 0)}
  for name, (method, lr, fps, evals, code) in runs.items():
    (tmp_path / name).mkdir()
    (tmp_path / name / "config.json").write_text(json.dumps({"method": method, "lr": lr, "forwards_per_step": fps, "batch": 2, "seq": 5,
                                                             "steps": 1000000, "tokens": 1000}))
    (tmp_path / name / "log.txt").write_text(f"H100\n{name}: exit {code} after 9s, --force, last line: {{}}\n")
    rows = [{"step": s, "tokens": 10 * (s + 1), "train_loss": 0.0, "seconds": t, "val_loss": v} for s, v, t in evals]
    (tmp_path / name / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
  table = plot.best_table(plot.best_runs([str(tmp_path / n) for n in runs if n != "c"])).splitlines()
  assert table[2:] == ["| b | 1 | 0.01: 1.000, 0.1: 1.200, 1: 0.500 | 0.500 | 3.0 | 24 | 0.500 | 1.600 | 1.600 | patience |",
                       "| a | 1 | 1: 1.800, 2: - | 1.800 | 30.0 | 27 | - | 5.000 | 1.800 | failed (exit 2) |",
                       "| z | 1 | 1: - | - | - | - | - | - | - | budget |"], table
  # a run without its lr (the method's default) is refused in one line that names it
  r = subprocess.run([sys.executable, "plot.py", str(tmp_path / "a-1"), str(tmp_path / "c"), "--best", "--out", str(tmp_path / "x.png")],
                     cwd=ROOT, capture_output=True, text=True, timeout=300)
  said = r.stderr.splitlines()[-1]
  assert r.returncode == 2 and "Traceback" not in r.stderr and str(tmp_path / "c") in said and "--lr" in said, r.stderr[-2000:]

# ***** 7. the command line *****

# docs/design.md's list of the flags, read from it so that a flag it promises can't go missing from the parser unnoticed
FLAGS = re.findall(r"--[\w-]+", re.search(r"The flags:\n`(.*?)`", (ROOT / "docs/design.md").read_text(), re.S).group(1))

def test_cli_help_and_bad_method():
  # a flag missing from the parser, or a bad method that gets past argparse (or exits 1 with a traceback), fails here
  r = cli("--help")
  assert r.returncode == 0, r.stderr
  assert not (missing := [f for f in FLAGS if not re.search(rf"(?<![\w-]){f}(?![\w-])", r.stdout)]), missing
  r = cli(method="sgd", steps=1)
  assert r.returncode == 2 and "invalid choice" in r.stderr, r.stderr

def test_device_defaults():
  # the default run of each kind of device (README), and a flag the user gives always wins: the CPU's 32 states only for the
  # synthetic chain, since a text's bytes need a vocab of 256
  def run(device:str, *argv:str) -> tuple:
    zo.device_defaults(args := zo.parse(list(argv)), device)
    return args.model, args.vocab, args.tokens
  assert run("CPU") == ("tiny", 32, 20_000) and run("CUDA") == ("small", None, 500_000)
  assert run("CPU", "--data", "t.txt") == ("tiny", None, 20_000) and run("CPU", "--vocab", "256", "--tokens", "7") == ("tiny", 256, 7)
  assert run("METAL", "--model", "tiny") == ("tiny", None, 500_000)

TYPES = ("mlp in", "mlp out", "attn out", "q", "k", "v", "gate", "ve", "wte", "head", "scalars")  # every layer type of the tiny GPT

def test_cli_cosine_table(background):
  # a table without a row per pop, a column per layer type, or with values that aren't cosines fails here
  r = background[1]["cosine"].result()
  assert r.returncode == 0, r.stderr[-2000:]
  lines = r.stdout.strip().splitlines()
  head = next(i for i, line in enumerate(lines) if line.split()[:1] == ["pop"])
  assert all(re.search(rf"(?<!\S){t}(?!\S)", lines[head]) for t in TYPES), lines[head]
  rows = [line.split() for line in lines[head + 1:]]
  assert [row[0] for row in rows] == ["4", "16"] and lines[head - 1].endswith("at initialisation"), lines
  vals = np.array([[float(v) for v in row[1:]] for row in rows])
  assert vals.shape == (2, len(TYPES)) and (np.abs(vals) <= 1).all() and not np.array_equal(vals[0], vals[1]), lines

# protects: --cosine --resume measures at the checkpoint's weights (not at initialisation), and says where it measured; it refuses
# another model or data than the run's, naming the flag
def test_cosine_at_checkpoint(background, monkeypatch, capsys):
  out, jobs = background
  assert jobs["full"].result().returncode == 0
  seen = []
  def spy(model, *a, **kw):
    if not seen: seen.append({n: p.numpy() for n, p in model.params.items()})
    return estimators.estimate(model, *a, **kw)
  monkeypatch.setattr(cosine, "estimate", spy)
  argv = ["--cosine", "--resume", "--out", str(out / "full"), "--method", "mezo", "--pop", "4",
          *(s for k in ("model", "vocab", "seq", "batch", "seed") for s in (f"--{k}", str(RUN[k])))]
  zo.main(argv)
  assert f"at the checkpoint of step 10 in {out / 'full'}" in capsys.readouterr().out
  ckpt = safe_load(str(out / "full" / "model.safetensors"))
  init = GPT(GPTConfig.preset("tiny", vocab=RUN["vocab"]), seed=RUN["seed"]).params
  for n, w in seen[0].items():
    np.testing.assert_array_equal(w, ckpt[f"param.{n}"].numpy(), err_msg=n)
  assert any(not np.array_equal(w, init[n].numpy()) for n, w in seen[0].items())  # training moved the weights: a real check
  with pytest.raises(SystemExit) as e: zo.main(argv + ["--seed", "1"])  # another seed: another synthetic chain than the run's
  err = capsys.readouterr().err
  assert e.value.code == 2 and err.startswith(f"zo: error: --cosine --resume: {out / 'full'} is a run of --seed 0, not --seed 1"), err

# ***** 8. the looped model's memory *****

def looped_memory(method:str, loops:int) -> dict[str, int]:
  """Bytes that tinygrad allocates (GlobalCounters.mem_used) for the tiny looped model at `loops` loops, above its parameters and an
  8x16 batch: `kept` after two clean forwards, and the `peak` during three `method` steps (each TinyJit's capture at its first
  call, then its replays), above what was allocated before them."""
  from tinygrad import GlobalCounters
  from tests.bench import PEAK as peak  # the benchmark's peak tracker: importing it wraps tinygrad's Buffer.allocate
  model = Looped(LoopedConfig.preset("tiny", loops=loops, vocab=CFG.vocab, seq_len=T), seed=0)
  rng = np.random.default_rng(0)
  x, y = [Tensor(rng.integers(0, CFG.vocab, (8, T)).astype(np.int32)).realize() for _ in range(2)]
  base = GlobalCounters.mem_used
  for _ in range(2): model.losses(x, y).mean().item()
  start = peak[0] = GlobalCounters.mem_used
  for step in range(3): estimators.run(model, x, y, method, 4, step)[0].coef.realize()
  return {"kept": start - base, "peak": peak[0] - start}

def memory_probe(method:str, loops:int) -> subprocess.CompletedProcess:
  """looped_memory in a fresh process: what tinygrad caches is per process, and a leak shows in the first passes of one."""
  code = f"import json; from tests.test_zo import looped_memory; print(json.dumps(looped_memory({method!r}, {loops})))"
  return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)

@pytest.mark.parametrize("method", ["mezo", "es"])
def test_looped_zo_memory_flat(background, method:str):
  # A ZO step holds one loop's activations at a time, so its peak is the same at 4 and 32 loops (173,624 bytes for mezo, 690,984 for
  # es, measured); 1.2x leaves room for a constant-size change. A step that keeps every loop's activations grows toward 8x: a lazy
  # forward run eagerly (tinygrad holds every .contiguous() buffer of one schedule until it ends) took the mezo step's peak from 0.54 MB
  # to 2.8 MB. A clean forward keeps nothing: tinygrad 0.14 leaked the buffers whose numbers met a cached schedule's placeholders,
  # 1.1 MB after two forwards at 32 loops (model.py).
  runs = {loops: background[1][method, loops].result() for loops in (4, 32)}
  for r in runs.values(): assert r.returncode == 0, r.stderr[-2000:]
  m = {loops: json.loads(r.stdout.splitlines()[-1]) for loops, r in runs.items()}
  assert m[32]["peak"] <= 1.2 * m[4]["peak"] and m[4]["kept"] == m[32]["kept"] == 0, f"{method}: {m}"
