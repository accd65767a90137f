"""docs/depth/depth.py, the harness of docs/depth.md: its float64 reference, its loop-by-loop backprop and its cosines.
Float32's unit roundoff is u = 2^-24 ~ 6e-8 and half's 2^-11 ~ 4.9e-4."""
import os, sys
import numpy as np
from tinygrad import Tensor, TinyJit, dtypes
import estimators
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "depth"))
import depth  # noqa: E402

T, B = 8, 2

def test_float64_matches_float32_at_one_loop() -> None:
  # one loop's gradient in float32 carries the roundings of some hundred ops (sums of up to 128 terms among them), so within
  # ~1e3 u = 6e-5 of the exact one per layer type, where half's (rel 1e-3 measured) is ~20x farther. The reference must also be
  # another computation than float32's: an unchanged float32 graph would agree exactly
  x, y = depth.batch(T, B)
  loss64, g64 = depth.gradient(1, T, "float64", None, x, y)
  loss32, g32 = depth.gradient(1, T, "float32", None, x, y)
  assert abs(loss64 - loss32) < 1e-6 * loss64
  for t, c in depth.compare(g32, g64).items():
    assert 0 < c["rel"] < 6e-5, t
  _, g16 = depth.gradient(1, T, "half", None, x, y)
  assert depth.compare(g16, g64)["block"]["rel"] > 6e-5

def test_float64_graph_computes_in_float64() -> None:
  # every arithmetic op of the reference's loss and gradient is float64: float32 appears only as the RoPE tables' buffers
  m = depth.looped(1, T, "float64")
  x, y = depth.batch(T, B)
  with depth.in_float64():
    loss, grads = estimators.gradient(m, x, y)
  uops = {u for t in (loss, *grads) for u in t.uop.toposort()}
  floats = {u.op.name for u in uops if u.dtype in (dtypes.float32, dtypes.half)}
  assert floats <= {"BUFFER", "RESHAPE"}, floats
  assert any(u.dtype == dtypes.float64 for u in uops)

def test_backprop_by_loop_is_the_gradient() -> None:
  # Backprop's loop-by-loop gradient at 2 loops in float64 against central differences (h = 1e-4) of the model's own loss
  # (Looped.losses, the whole graph, as zo's backprop differentiates it) in float64, along a random unit direction and along
  # the gradient itself in each layer type: within 3e-8 |g_type| measured (h^2 terms, float64's rounding / h), bound 1e-6,
  # where a loop or x0's path counted twice or left out is off by O(|g_type| / sqrt(numel)) >= 1e-2 |g_type| (a loop's
  # weight gradient assigned instead of added: 2e-2). Then float32's loop-by-loop gradient against it to float32's rounding
  x, y = depth.batch(T, B)
  loss, g = depth.gradient(2, T, "float64", None, x, y)
  m, h, rng = depth.looped(2, T, "float64"), 1e-4, np.random.default_rng(0)
  forward = TinyJit(lambda *ps: m.losses(x, y, params=dict(zip(m.params, ps))).mean().realize())
  def f(v:dict[str, np.ndarray], s:float) -> float:  # the loss at θ + s h v
    with depth.in_float64(): return forward(*[(p + s * h * Tensor(v[n]) if n in v else p.clone()).realize() for n, p in m.params.items()]).item()
  assert abs(f({}, 0) - loss) < 1e-12
  for t in dict.fromkeys(map(depth.layer_type, g)):
    names = [n for n in g if depth.layer_type(n) == t]
    norm = np.sqrt(sum((g[n] ** 2).sum() for n in names))
    for d in ({n: rng.normal(size=g[n].shape) for n in names}, {n: g[n] for n in names}):
      d = {n: v / np.sqrt(sum((w ** 2).sum() for w in d.values())) for n, v in d.items()}
      slope = sum((g[n] * d[n]).sum() for n in names)
      assert abs((f(d, 1) - f(d, -1)) / (2 * h) - slope) < 1e-6 * norm, t
  _, g32 = depth.gradient(2, T, "float32", None, x, y)
  for t, c in depth.compare(g32, g).items(): assert c["rel"] < 1e-5, t

def test_compare_on_known_cases() -> None:
  # g = a ref + t |ref| e, e a unit vector orthogonal to ref: cos = a / sqrt(a^2 + t^2), rel = sqrt((a - 1)^2 + t^2); here per
  # group, with another (a, t) in each layer type, so the "block" and "whole" groups mix them as their norms weigh them
  rng = np.random.default_rng(0)
  shapes = {n: p.shape for n, p in depth.looped(1, T, "float32").params.items()}
  ref = {n: rng.normal(size=s) for n, s in shapes.items()}
  types = list(dict.fromkeys(map(depth.layer_type, shapes)))
  a, t = {k: 0.5 + i for i, k in enumerate(types)}, {k: 0.1 * i for i, k in enumerate(types)}
  g = {}
  for k in types:
    names = [n for n in shapes if depth.layer_type(n) == k]
    r = np.concatenate([ref[n].ravel() for n in names])
    e = rng.normal(size=r.size)
    e -= (e @ r) / (r @ r) * r
    v = a[k] * r + t[k] * np.linalg.norm(r) * e / np.linalg.norm(e)
    for n, part in zip(names, np.split(v, np.cumsum([ref[n].size for n in names])[:-1])): g[n] = part.reshape(ref[n].shape)
  c = depth.compare(g, ref)
  for k in types:
    assert np.isclose(c[k]["cos"], a[k] / np.hypot(a[k], t[k])) and np.isclose(c[k]["rel"], np.hypot(a[k] - 1, t[k])), k
  assert np.isclose(depth.compare(ref, ref)["whole"]["cos"], 1) and depth.compare(ref, ref)["whole"]["rel"] == 0
  neg = depth.compare({n: -v for n, v in ref.items()}, ref)["whole"]
  assert np.isclose(neg["cos"], -1) and np.isclose(neg["rel"], 2)
  # the whole: sum of a_k |r_k|^2 over sqrt(sum of (a_k^2 + t_k^2) |r_k|^2) times |r|, the norms weighing the types
  sq = {k: sum((ref[n] ** 2).sum() for n in shapes if depth.layer_type(n) == k) for k in types}
  whole = sum(a[k] * sq[k] for k in types) / np.sqrt(sum((a[k] ** 2 + t[k] ** 2) * sq[k] for k in types) * sum(sq.values()))
  assert np.isclose(c["whole"]["cos"], whole)
