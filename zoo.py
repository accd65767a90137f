"""The zeroth-order zoo: four estimators from 2024-2026, each its paper's update as one short function (docs/zoo.md has
the math).

  hizoo    a diagonal Hessian estimate Σ, kept as an exponential average, scales the perturbation by Σ^(-1/2)
  lozo     each matrix perturbed along a low-rank U Vᵀ, V kept for ν steps, U fresh every step
  conmezo  directions drawn in a cone around the momentum's direction
  zomuon   a subspace estimate of each matrix, orthogonalised by Newton-Schulz before the update

Their perturbations are not the plain Gaussians of a key (Compact), so each evaluates model.losses at θ + ε·E_k with E_k
built as tensors, and returns a dense estimate per parameter, all of a step in one engine.jit function. A direction's
noise is still a pure function of the step's key: E_k's Gaussians for parameter i come from fold(key, k, i), as MeZO's
z_k do. What an estimator keeps from step to step (Σ, the momentum, a window's key) lives in `state`, which the training
loop keeps and checkpoints (registry.py).
"""
from __future__ import annotations
import math
import numpy as np
from tinygrad import Tensor, dtypes
from kernels.noise import fold, gaussian
from estimators import spsa
from registry import POSITIVE, Option, Run, activations, estimator, itemsize, size
import engine

def memory(run:Run) -> float|None:  # a forward of the batch, and the pop directions E_k as dense tensors
  if (fwd := activations(run.model, run.tokens // run.steps)) is None: return None
  return fwd + run.pop * size(run.model) * itemsize(run.model)

def kept(state:dict[str, Tensor], name:str, like:Tensor, fill:float) -> Tensor:
  """state[name], made at the first step as a tensor of like's shape filled with `fill`."""
  if name not in state: state[name] = Tensor.full(like.shape, fill, device=like.device).contiguous().realize()
  return state[name]

def window(state:dict[str, Tensor], key:Tensor, step:Tensor, every:int) -> Tensor:
  """The key of this step's window of ν = `every` steps: fold(run key, floor(step / ν)), a tensor, so a new window
  compiles nothing. The run key is the first step's key, kept in state (the step's own key changes every step)."""
  if "key" not in state: state["key"] = key.contiguous().realize()
  return fold(state["key"], (step / every).floor().cast(dtypes.uint32))

def losses_along(model, x:Tensor, y:Tensor, E:list[dict[str, Tensor]], eps:float,
                 signs:tuple[int, ...]=(1, -1)) -> Tensor:
  """[K, len(signs)]: L(θ + s·ε·E_k) for each direction k and sign s, each forward realized apart, each perturbed weight
  materialized (noise fused into a matmul's operand is made again for every output row: docs/design.md principle 2).
  s·ε is data of the kernels (engine.scalar), so the forwards of both signs share their compiled kernels."""
  def loss(e:dict[str, Tensor], s:int) -> Tensor:
    signed = engine.scalar(s, np.float32, x.device) * eps
    return model.losses(x, y, params={n: (p + signed * e[n]).contiguous()
                                      for n, p in model.params.items()}).mean().realize()
  return Tensor.stack(*[Tensor.stack(*[loss(e, s) for s in signs]) for e in E])

def clean_loss(model, x:Tensor, y:Tensor) -> Tensor: return model.losses(x, y).mean().realize()

def combined(E:list[dict[str, Tensor]], coef:Tensor) -> dict[str, Tensor]:
  """Σ_k coef_k E_k, per parameter."""
  return {n: sum(coef[k] * e[n] for k, e in enumerate(E)) for n in E[0]}

def direction_keys(key:Tensor, pop:int) -> list[Tensor]:
  """fold(key, k) for k < pop, each a buffer of its own (engine.buffer_of: each direction's forward is then one
  graph)."""
  return [engine.buffer_of(fold(key, k)) for k in range(pop)]

def gaussians(model, key:Tensor, pop:int) -> list[dict[str, Tensor]]:
  """z_k for k < pop: parameter i's Gaussian from fold(key, k, i), MeZO's directions, each made once."""
  return [{n: gaussian(fold(k, i), p.shape).contiguous() for i, (n, p) in enumerate(model.params.items())}
          for k in direction_keys(key, pop)]

# ***** HiZOO *****

@estimator("hizoo", memory=memory, forwards=lambda run: 2 * run.pop + 1,
           eps=Option("the perturbation scale ε", check=POSITIVE),
           smooth=Option("α, the weight of a step's Hessian estimate in Σ's exponential average",
                         check=(lambda v: 0 < v <= 1, "in (0, 1]")))
def hizoo(model, x:Tensor, y:Tensor, pop:int, key:Tensor, state:dict[str, Tensor], eps:float=1e-3,
          smooth:float=1e-6) -> tuple[dict[str, Tensor], Tensor]:
  """HiZOO, a diagonal-Hessian-informed MeZO (Zhao et al., "Second-order fine-tuning without pain for LLMs", ICLR 2025):
  perturb by ε Σ^(-1/2) z_k, re-estimate Σ from the two perturbed losses and the clean one L, then step along the
  rescaled directions:
    Σ'_k = (L(θ + εΣ^(-1/2) z_k) + L(θ − εΣ^(-1/2) z_k) − 2L) / (2ε²) · Σ (z_k² − 1),   Σ ← (1 − α) Σ + α mean_k |Σ'_k|
    g = Σ_k (L(θ + εΣ^(-1/2) z_k) − L(θ − εΣ^(-1/2) z_k)) / (2εK) · Σ^(-1/2) z_k   (Σ the updated one, as in the paper)
  Σ starts at 1 (MeZO's first step). K directions average their Σ'_k into one update of Σ (the paper's code updates Σ
  after each)."""
  sigma = {n: kept(state, f"sigma.{n}", p, 1.0) for n, p in model.params.items()}
  return engine.jit(hizoo_step, model, pop=pop, eps=eps, smooth=smooth)(x, y, key, sigma)

def hizoo_step(model, x:Tensor, y:Tensor, key:Tensor, sigma:dict[str, Tensor], pop:int, eps:float, smooth:float):
  Z, clean = gaussians(model, key, pop), clean_loss(model, x, y)
  losses = losses_along(model, x, y, [{n: z[n] / sigma[n].sqrt() for n in z} for z in Z], eps)  # [K, 2]
  curvature = (losses[:, 0] + losses[:, 1] - 2 * clean) / (2 * eps ** 2)  # z_kᵀ Σ^(-1/2) H Σ^(-1/2) z_k / 2
  hessian = {n: sum((curvature[k] * s * (z[n].square() - 1)).abs() for k, z in enumerate(Z)) / pop
             for n, s in sigma.items()}
  Tensor.realize(*[s.assign((1 - smooth) * s + smooth * hessian[n]) for n, s in sigma.items()])
  coef, _ = spsa(losses, eps)
  return {n: g / sigma[n].sqrt() for n, g in combined(Z, coef).items()}, clean

# ***** LOZO *****

@estimator("lozo", memory=memory, forwards=lambda run: 2 * run.pop,
           eps=Option("the perturbation scale ε", check=POSITIVE),
           subspace=Option("r, the rank of a matrix's perturbation U Vᵀ (V's columns span its rows' subspace)",
                           check=POSITIVE),
           every=Option("ν, the steps that keep one V", check=POSITIVE))
def lozo(model, x:Tensor, y:Tensor, pop:int, key:Tensor, step:Tensor, state:dict[str, Tensor], eps:float=1e-3,
         subspace:int=2, every:int=50) -> tuple[dict[str, Tensor], Tensor]:
  """LOZO, low-rank zeroth-order fine-tuning (Chen et al., "Enhancing zeroth-order fine-tuning for language models with
  low-rank structures", ICLR 2025): each matrix is perturbed along E_k = U_k Vᵀ, U_k [m, r] Gaussian, fresh every
  direction and step, V [n, r] Gaussian, the same for ν steps (lazy sampling); a vector or scalar parameter along a
  Gaussian z_k, as in MeZO:
    g = Σ_k (L(θ + εE_k) − L(θ − εE_k)) / (2εK) · E_k,   E_k = U_k Vᵀ / √r
  E_k has unit variance per entry, as MeZO's z_k: the paper perturbs by ε U_k Vᵀ and divides its g by r, the same g with
  ε√r for ε (E[U Vᵀ ⟨G, U Vᵀ⟩] = r G, so E[g] = G). V comes from the window's key (window) where the paper stores it; a
  matrix of fewer than r rows or columns gets their rank."""
  return engine.jit(lozo_step, model, pop=pop, eps=eps, rank=subspace)(x, y, key, window(state, key, step, every))

def lozo_step(model, x:Tensor, y:Tensor, key:Tensor, vkey:Tensor, pop:int, eps:float, rank:int):
  def E(k:Tensor, i:int, shape:tuple[int, ...]) -> Tensor:  # k: direction k's key, fold(key, k)
    if len(shape) != 2: return gaussian(fold(k, i), shape)
    r = min(rank, *shape)
    return (gaussian(fold(k, i), (shape[0], r)) @
            gaussian(fold(vkey, i), (shape[1], r)).T / math.sqrt(r)).contiguous()  # U_k Vᵀ/√r
  directions = [{n: E(k, i, p.shape) for i, (n, p) in enumerate(model.params.items())}
                for k in direction_keys(key, pop)]
  coef, loss = spsa(losses_along(model, x, y, directions, eps), eps)
  return combined(directions, coef), loss

# ***** ConMeZO *****

@estimator("conmezo", memory=memory, forwards=lambda run: 2 * run.pop,
           eps=Option("the perturbation scale ε", check=POSITIVE),
           angle=Option("θ, the cone's half-angle around the momentum, in radians",
                        check=(lambda v: 0 <= v <= math.pi / 2, "in [0, π/2]")),
           beta=Option("β, the momentum's decay: m ← βm + (1 − β)g", check=(lambda v: 0 <= v < 1, "in [0, 1)")))
def conmezo(model, x:Tensor, y:Tensor, pop:int, key:Tensor, state:dict[str, Tensor], eps:float=1e-3, angle:float=1.4,
            beta:float=0.9) -> tuple[dict[str, Tensor], Tensor]:
  """ConMeZO, cone-restricted MeZO (Behric et al., "ConMeZO: adaptive descent-direction sampling for gradient-free
  finetuning of large language models", 2025): SPSA along directions drawn in a cone of half-angle θ around the momentum
  m, over all D parameters:
    z_k = cos θ √D m/|m| + sin θ u_k,   g = Σ_k (L(θ + εz_k) − L(θ − εz_k)) / (2εK) · z_k,   m ← βm + (1 − β)g
  u_k the Gaussian of fold(key, k) (MeZO's z_k); |z_k|² ≈ D as MeZO's, and cos(z_k, m) ≈ cos θ. While m = 0 (the first
  step) z_k = u_k. The paper's warm-up of θ and β is left out: a schedule of them would be a function of `step`."""
  m = {n: kept(state, f"m.{n}", p, 0.0) for n, p in model.params.items()}
  return engine.jit(conmezo_step, model, pop=pop, eps=eps, angle=angle, beta=beta)(x, y, key, m)

def conmezo_step(model, x:Tensor, y:Tensor, key:Tensor, m:dict[str, Tensor], pop:int, eps:float, angle:float,
                 beta:float):
  norm = engine.squares(list(m.values())).sum().sqrt()  # |m|
  axis = (norm > 0).where(math.cos(angle) * math.sqrt(size(model)) / norm, 0.0)  # √D cos θ / |m|
  spread = (norm > 0).where(math.sin(angle), 1.0)
  Z = [{n: axis * m[n] + spread * u[n] for n in u} for u in gaussians(model, key, pop)]
  coef, loss = spsa(losses_along(model, x, y, Z, eps), eps)
  g = combined(Z, coef)
  Tensor.realize(*g.values())  # before m changes under it
  Tensor.realize(*[t.assign(beta * t + (1 - beta) * g[n]) for n, t in m.items()])
  return g, loss

# ***** ZO-Muon *****

def msign(X:Tensor, iterations:int=24) -> Tensor:
  """The polar factor U Vᵀ of X = U S Vᵀ by the Newton-Schulz iteration X ← 1.5X − 0.5 X Xᵀ X from X/|X|_F: each
  singular value, in (0, 1] at the start, goes σ → 1.5σ − 0.5σ³, rising by 1.5x while small and converging quadratically
  near 1, so 24 iterations take any σ ≥ 1e-3 to 1 within float32's rounding. (Muon's quintic takes fewer and leaves σ in
  about [0.7, 1.2].) Zero stays zero. X may be a batch of matrices, [..., m, n]."""
  if X.shape[-2] > X.shape[-1]: return msign(X.transpose(-1, -2), iterations).transpose(-1, -2)  # X Xᵀ: the short side
  X = X / (X.square().sum((-2, -1), keepdim=True).sqrt() + 1e-30)
  return engine.iterated(lambda X: 1.5 * X - 0.5 * (X @ X.transpose(-1, -2)) @ X, X, iterations)

@estimator("zomuon", memory=memory, forwards=lambda run: run.pop + 1,
           eps=Option("the perturbation scale ε", check=POSITIVE),
           subspace=Option("r, the dimension of a matrix's subspace P", check=POSITIVE),
           every=Option("ν, the steps that keep one subspace P", check=POSITIVE))
def zomuon(model, x:Tensor, y:Tensor, pop:int, key:Tensor, step:Tensor, state:dict[str, Tensor], eps:float=1e-3,
           subspace:int=4, every:int=50) -> tuple[dict[str, Tensor], Tensor]:
  """ZO-Muon, subspace gradient orthogonalisation (Lang et al., "Powering up zeroth-order training via subspace gradient
  orthogonalization", 2026): each matrix [m, n] is perturbed in the span of P [m, r] (orthonormal columns, kept ν steps)
  along Gaussians Ψ_k [r, n]; the subspace estimate is one-sided, and its matrix sign is the update:
    G = Σ_k (L(θ + εPΨ_k) − L(θ)) / (εK) · Ψ_k,   update P msign(G)   (its singular values 1)
  A vector or scalar parameter takes the one-sided estimate along a Gaussian z_k, unorthogonalised. P is the polar
  factor of a Gaussian (msign), which is distributed as the paper's QR of one, from the window's key (window); it is K +
  1 forwards a step."""
  return engine.jit(zomuon_step, model, pop=pop, eps=eps, rank=subspace)(x, y, key, window(state, key, step, every))

def zomuon_step(model, x:Tensor, y:Tensor, key:Tensor, pkey:Tensor, pop:int, eps:float, rank:int):
  P = engine.by_shape(msign, {n: gaussian(fold(pkey, i), (p.shape[0], min(rank, *p.shape)))
                              for i, (n, p) in enumerate(model.params.items()) if p.ndim == 2})
  # Ψ_k = Pᵀ z_k: Gaussian [r, n], made once for its forward and G
  Psi = [{n: (P[n].T @ z[n]).contiguous() if n in P else z[n] for n in z} for z in gaussians(model, key, pop)]
  losses = losses_along(model, x, y, [{n: P[n] @ psi[n] if n in P else psi[n] for n in psi} for psi in Psi], eps,
                        signs=(1,))
  clean = clean_loss(model, x, y)
  G = combined(Psi, (losses[:, 0] - clean) / (eps * pop))
  orthogonal = engine.by_shape(msign, {n: g for n, g in G.items() if n in P})
  return {n: P[n] @ orthogonal[n] if n in P else g for n, g in G.items()}, clean
