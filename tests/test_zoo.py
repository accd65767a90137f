"""Tests of zoo.py's estimators against their defining properties, on a synthetic quadratic L(θ) = ½ Σ h ⊙ (θ − 1)² (a "model" with a
params dict and losses(x, y, params=...), all the estimators touch), and of --init. The quadratic's loss is exact at any ε, and its
kernels compile in seconds where the tiny GPT's take tens of seconds per estimator on 2 cores."""
import contextlib, json, math, os, subprocess, sys
from pathlib import Path
import numpy as np
import pytest
from tinygrad import Context, Tensor
import estimators, optim, zo, zoo

ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "DEV": "CPU"}

@pytest.fixture(scope="module", autouse=True)
def fast_compile():
  with Context(NOOPT=1): yield

class Quadratic:
  """L(θ) = ½ Σ_n Σ h_n ⊙ (θ_n − 1)², curvatures h_n ~ U(1, 10) of a seed; x and y are unused."""
  def __init__(self, shapes:dict[str, tuple[int, ...]], start:float=0.0, seed:int=0, h:dict[str, np.ndarray]|None=None):
    rng = np.random.default_rng(seed)
    self.h = {n: Tensor(h[n] if h else rng.uniform(1, 10, s).astype(np.float32)).realize() for n, s in shapes.items()}
    self.params = {n: Tensor.full(s, start).contiguous().realize() for n, s in shapes.items()}
  def num_params(self) -> int: return sum(p.numel() for p in self.params.values())
  def losses(self, x:Tensor, y:Tensor, params:dict|None=None) -> Tensor:
    ps = self.params if params is None else params
    return (sum(((ps[n] - 1).square() * self.h[n]).sum() for n in ps) / 2).reshape(1, 1)

X = Y = Tensor.zeros(1, 1).contiguous().realize()

def step_of(method:str, model, pop:int, step:int, state:dict, **opts) -> dict[str, np.ndarray]:
  g, _ = estimators.run(model, X, Y, method, pop, step, state=state, **opts, **estimators.at_step(estimators.ESTIMATORS[method], step))
  return {n: t.numpy() for n, t in g.items()}

def test_hizoo_sigma_converges_to_the_hessian_diagonal():
  # At the minimum, L(θ ± εΣ^(-1/2)z) = ε²/2 Σ_j (H_j/Σ_j) z_j² exactly, so a step's Σ'_i = Σ_i χ (z_i² − 1)/2 with χ = Σ_j (H_j/Σ_j) z_j².
  # Σ = κH makes χ = χ²_D/κ and E|Σ'_i| = H_i E[χ²_D |z_1² − 1|]/2 = κH_i for κ = E[χ²_D |z_1² − 1|]/2: the average's fixed point is the
  # true diagonal up to κ (the paper's |·| keeps Σ positive and moves its level from H to κH; without it E[Σ'] = H exactly).
  # κ by Monte Carlo (10^6 draws: ±0.3%). The ratios Σ_i/Σ_j are pulled to H_i/H_j only through coordinate i's own term of χ
  # (E[z²|z² − 1|] = 2.2 against E|z² − 1| = 0.97 for the others): a rate of ~0.25α a step, 80 steps at α = 0.05, so 1000 steps of
  # burn-in leave e^-12 of the start. Each step's relative noise is α·std(X) with X = E-normalized Σ'_i, ~1.5/√K at K = 16: a stationary
  # std of 0.05·0.375/√(2·0.0125) = 0.12, averaged over 2000 steps (25 correlation times) ±0.024, plus O(α) of bias: 0.15 is over 4 sigma.
  # MeZO's direction (Σ kept at 1) is off by 2x at H = 2 and 4x at H = 4.
  H = np.array([1.0, 2.0, 4.0, 0.5], np.float32)
  model, state = Quadratic({"w": (4,)}, start=1.0, h={"w": H}), {}
  z = np.random.default_rng(0).standard_normal((10**6, 4))
  kappa = np.mean((z ** 2).sum(1) * np.abs(z[:, 0] ** 2 - 1)) / 2
  seen = []
  for step in range(3000):
    step_of("hizoo", model, 16, step, state, eps=1.0, smooth=0.05)
    if step >= 1000: seen.append(state["sigma.w"].numpy())
  ratio = np.mean(seen, 0) / (kappa * H)
  assert np.all(np.abs(ratio - 1) < 0.15), (ratio, kappa)

def test_lozo_rank_and_window():
  # A matrix's estimate Σ_k c_k U_k Vᵀ has rank r (float32 products of rank r leave σ_(r+1)/σ_1 ~ 1e-7; 1e-5 is the bound), and its rows
  # lie in V's column span: the steps of one window of ν = 3 stack to rank r, two windows' to 2r. MeZO's Gaussian estimate has full rank.
  model, state, r = Quadratic({"w": (12, 10), "b": (5,)}), {}, 2
  gs = [step_of("lozo", model, 2, step, state, eps=1e-2, subspace=r, every=3)["w"] for step in range(6)]
  def rank(m:np.ndarray) -> int:
    s = np.linalg.svd(m.astype(np.float64), compute_uv=False)
    return int((s > 1e-5 * s[0]).sum())
  assert [rank(g) for g in gs] == [r] * 6
  assert rank(np.concatenate(gs[:3])) == r and rank(np.concatenate(gs[3:])) == r  # V constant within a window
  assert rank(np.concatenate([gs[0], gs[3]])) == 2 * r  # and another in the next

def test_estimate_is_the_callers():
  # estimators.estimate's dict estimate is the caller's: a later estimate (the JIT's replays reuse its output buffers) leaves it alone
  model = Quadratic({"w": (12, 10), "b": (5,)})
  gs = [estimators.estimate(model, X, Y, "lozo", 2, seed, state={}, **estimators.at_step(estimators.ESTIMATORS["lozo"], 0))
        for seed in range(4)]
  kept = [{n: t.numpy() for n, t in g.items()} for g in gs]
  later = estimators.estimate(model, X, Y, "lozo", 2, 9, state={}, **estimators.at_step(estimators.ESTIMATORS["lozo"], 0))
  assert not np.array_equal(later["w"].numpy(), kept[3]["w"])
  for g, k in zip(gs, kept):
    for n in g: np.testing.assert_array_equal(g[n].numpy(), k[n], err_msg=n)

def test_conmezo_directions_in_the_cone():
  # With one direction g = c z, and z = cos θ √D m̂ + sin θ u: cos(z, m) = cos θ + sin³θ a/√D − cos θ sin²θ b/√(2D) + O(1/D), a = u·m̂
  # and b = (|u|² − D)/√(2D) standard normals, a std of at most 1.23/√D = 0.019 at D = 4096: 4/√D is over 3 sigma for each of 8 keys.
  # MeZO's z is independent of m: |cos| ~ 1/√D = 0.016, where cos θ = 0.17.
  D, angle = 4096, 1.4
  model = Quadratic({"w": (D,)})
  m = np.random.default_rng(1).standard_normal(D).astype(np.float32)
  for key in range(8):
    g = step_of("conmezo", model, 1, key, {"m.w": Tensor(m).contiguous().realize()}, angle=angle)["w"]
    cos = abs(g @ m) / (np.linalg.norm(g) * np.linalg.norm(m))
    assert abs(cos - math.cos(angle)) < 4 / math.sqrt(D), (key, cos)

def test_zomuon_update_is_orthogonal():
  # The update P msign(G): P has orthonormal columns and msign(G) the singular values 1 of G's r nonzero ones (24 Newton-Schulz steps
  # take any σ/|G|_F ≥ 1e-3 to 1 within float32 rounding, ~1e-6), so its r singular values are 1 and the rest 0: 1e-3 covers the
  # rounding. MeZO's estimate has D's spread of singular values at the gradient's scale.
  model, r = Quadratic({"w": (12, 10), "v": (10, 30)}), 3
  for name, g in step_of("zomuon", model, 4, 0, {}, eps=1e-2, subspace=r).items():
    s = np.linalg.svd(g.astype(np.float64), compute_uv=False)
    assert np.all(np.abs(s[:r] - 1) < 1e-3) and np.all(s[r:] < 1e-3), (name, s)

def zomuon_reference(model, seed:int, window_key:Tensor, pop:int, eps:float, rank:int) -> dict[str, np.ndarray]:
  """zoo.zomuon_step's math written out per parameter and run eagerly: each matrix's msign apart (no stacking by shape, no
  JIT), from the same Gaussians."""
  from kernels.noise import fold, gaussian, key as root_key
  P = {n: zoo.msign(gaussian(fold(window_key, i), (p.shape[0], min(rank, *p.shape))))
       for i, (n, p) in enumerate(model.params.items()) if p.ndim == 2}
  Psi = [{n: P[n].T @ z[n] if n in P else z[n] for n in z} for z in zoo.gaussians(model, root_key(seed), pop)]
  losses = [model.losses(X, Y, params={n: p + eps * (P[n] @ psi[n] if n in P else psi[n]) for n, p in model.params.items()}).item()
            for psi in Psi]
  clean = model.losses(X, Y).item()
  G = {n: sum((losses[k] - clean) / (eps * pop) * psi[n] for k, psi in enumerate(Psi)) for n in Psi[0]}
  return {n: (P[n] @ zoo.msign(g) if n in P else g).numpy() for n, g in G.items()}

def test_zomuon_matches_its_reference():
  # The step stacks same-shape matrices (engine.by_shape) and runs as a JIT, captured at step 0 and replayed at step 1 with a new
  # window (ν = 1: a new P): both estimates are the per-matrix math's within float32 rounding. Two matrices share a shape, so a
  # matrix given its neighbour's P or G (an index wrong in the stacking) is off by O(1).
  from kernels.noise import fold, key as root_key
  model, state, eps, r = Quadratic({"w": (6, 4), "b": (4,), "u": (6, 4), "v": (4, 6)}), {}, 1e-2, 2
  for step in range(2):
    got = step_of("zomuon", model, 3, step, state, eps=eps, every=1, subspace=r)
    want = zomuon_reference(model, step, fold(root_key(0), step), 3, eps, r)
    for n in want: np.testing.assert_allclose(got[n], want[n], rtol=1e-4, atol=1e-5, err_msg=f"{n} at step {step}")

def descent(method:str, lr:float, flip:bool, shapes:dict, steps:int=30, **opts) -> tuple[float, float]:
  """(loss before, after) `steps` plain SGD steps from θ = 0, the estimate's sign flipped or not."""
  model, state = Quadratic(shapes), {}
  opt = optim.Optimizer(model.params, {n: lr for n in model.params}, "sgd", 0.0, 0)
  before = model.losses(X, Y).item()
  for step in range(steps):
    g, _ = estimators.run(model, X, Y, method, 4, step, state=state, **opts, **estimators.at_step(estimators.ESTIMATORS[method], step))
    opt.step({n: -t for n, t in g.items()} if flip else g)
  return before, model.losses(X, Y).item()

# lrs: SGD on SPSA's estimate (E|g|² = (D + K)/K |∇L|²) is stable on a quadratic for lr < 2K/((D + K) h_max), 6e-3 here (D = 130,
# K = 4, h_max = 10): a third of it, 2e-3, for hizoo, lozo and conmezo (HiZOO's Σ^(-1/2) only shrinks its steps). ZO-Muon's matrix step
# has spectral norm lr, and θ is √(mn) = 11-17 from the minimum in spectral norm: lr 0.1 moves it by at most 3 in 30 steps.
@pytest.mark.parametrize("method, lr, shapes, opts", [
  ("hizoo", 2e-3, {"w": (12, 10), "b": (10,)}, {"eps": 1e-2, "smooth": 1e-2}), ("lozo", 2e-3, {"w": (12, 10), "b": (10,)}, {"every": 5}),
  ("conmezo", 2e-3, {"w": (12, 10), "b": (10,)}, {}), ("zomuon", 0.1, {"w": (12, 10), "v": (10, 8)}, {"eps": 1e-2, "every": 5})])
def test_training_lowers_loss(method:str, lr:float, shapes:dict, opts:dict):
  # an estimator that points uphill, or carries no gradient signal, fails: the true run must fall by 1% of the loss, the flipped one rise
  b0, a0 = descent(method, lr, False, shapes, **opts)
  b1, a1 = descent(method, lr, True, shapes, **opts)
  assert b0 == b1 and b0 - a0 > 0.01 * b0 and a1 > b1, f"{method}: {b0:.3f} -> {a0:.3f}, flipped -> {a1:.3f}"

# ***** --init *****

def cli(*args:str) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, "zo.py", *args], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)

RUN = ["--model", "tiny", "--vocab", "64", "--seq", "16", "--batch", "2", "--pop", "2", "--seed", "0", "--eval-every", "1"]

def test_init_from_a_run(tmp_path:Path):
  # step 0's val loss is measured after its update: at lr 1e-30 the update is below float32's resolution of the weights, so it is the
  # initial weights' val loss, which must be the source run's last one on the same val batches (a pure function of --data, --seq,
  # --batch and --seed). A mismatched model, a missing run or checkpoint: one line, exit 2.
  src = tmp_path / "src"
  r = cli(*RUN, "--method", "mezo", "--lr", "3e-3", "--steps", "3", "--out", str(src))
  assert r.returncode == 0, r.stderr[-2000:]
  r = cli(*RUN, "--method", "lozo", "--lr", "1e-30", "--steps", "1", "--init", str(src), "--out", str(tmp_path / "ft"))
  assert r.returncode == 0, r.stderr[-2000:]
  last = [json.loads(line) for line in open(src / "metrics.jsonl")][-1]["val_loss"]
  first = json.loads(open(tmp_path / "ft" / "metrics.jsonl").readline())
  assert first["step"] == 0 and abs(first["val_loss"] - last) < 1e-6, (first, last)
  assert json.load(open(tmp_path / "ft" / "config.json"))["init"] == str(src)
  for flags, says in ((["--vocab", "32"], f"--init {src}: that run's model is another: --vocab 64 there, 32 here"),
                      (["--init", str(tmp_path / "none")], f"--init: no run in {tmp_path / 'none'}"),):
    r = cli(*RUN, "--method", "mezo", "--steps", "1", "--init", str(src), *flags, "--out", str(tmp_path / "bad"))
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and says in r.stderr, r.stderr[-2000:]

def test_resume_with_state_continues_exactly(tmp_path:Path, monkeypatch):
  # ConMeZO's momentum lives in the estimator's state: a checkpoint without it (or a resume that doesn't restore it) starts the second
  # part from m = 0, whose directions differ, and steps 2 and 3 change
  monkeypatch.setattr(zo, "on_signals", lambda *a: contextlib.nullcontext())  # zo.main's signal thread is the process's, not a test's
  run = [*RUN, "--method", "conmezo", "--lr", "3e-3", "--ckpt-every", "2"]
  zo.main([*run, "--steps", "4", "--out", str(tmp_path / "full")])
  zo.main([*run, "--steps", "2", "--out", str(tmp_path / "split")])
  zo.main([*run, "--steps", "4", "--out", str(tmp_path / "split"), "--resume"])
  def losses(p:Path) -> list[float]: return [json.loads(line)["train_loss"] for line in open(p / "metrics.jsonl")]
  assert losses(tmp_path / "split") == losses(tmp_path / "full"), (losses(tmp_path / "split"), losses(tmp_path / "full"))
