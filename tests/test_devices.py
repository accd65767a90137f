"""Tests of --devices (devices.py): the mezo/es/dust population split over several tinygrad CPU devices (CPU, CPU:1) in one process.
The same key gives the same estimate on 1 and 2 devices, each device draws its own keys on its own copy of the model, a training run
on 2 devices follows the one on 1 device, and bad --devices values stop with one line and exit code 2.

Cost: the in-process tests use 1-block models (6,178 parameters) and one batch; the CLI test trains the tiny preset for 3 steps on 1
and on 2 devices, in this process (zo.main), and the bad --devices values stop before a model is built."""
import json, signal
import numpy as np
import pytest
from tinygrad import Context, Tensor
from tinygrad.nn.state import safe_load
from model import GPT, GPTConfig
import devices
import engine, estimators, zo

CFG = GPTConfig(vocab=64, seq_len=16, n_layer=1, n_head=2, n_embd=16)
B, T = 2, 16

@pytest.fixture(scope="module", autouse=True)
def fast_compile():
  with Context(NOOPT=1): yield

@pytest.fixture(scope="module")
def batch() -> tuple[Tensor, Tensor]:
  rng = np.random.default_rng(0)
  return tuple(Tensor(rng.integers(0, CFG.vocab, (B, T)).astype(np.int32)).realize() for _ in range(2))

def test_names_and_shares():
  # a device list that restarts at index 0 (CUDA:2 -> CUDA, CUDA:1) or shares that overlap, skip or reorder draws fail here
  assert devices.names("CPU", 3) == ["CPU", "CPU:1", "CPU:2"] and devices.names("CUDA:2", 2) == ["CUDA:2", "CUDA:3"]
  assert devices.shares(5, 2) == [range(0, 2), range(2, 5)] and devices.shares(4, 4) == [range(i, i + 1) for i in range(4)]

# (method, pop, opts, loss scale of a coefficient): unshaped, so a coefficient is a loss difference over that scale
CASES = [("mezo", 3, {}, 2 * 1e-3 * 3), ("es", 6, {"shaping": "none"}, 6 * 1e-2)]

@pytest.mark.parametrize("method, pop, opts, scale", CASES)
def test_same_key_same_estimate(batch, monkeypatch, method:str, pop:int, opts:dict, scale:float):
  # the population split 1 + 2 over two devices: a device that drew other keys, evaluated another device's draws, put its losses
  # in another order, or read weights other than the model's, changes the coefficients; 3 ulps of a loss of ~4.2 is 1.5e-6.
  # And no autograd on any device.
  def refuse(*a, **k): raise AssertionError("autograd in a ZO path")
  for f in ("backward", "gradient"): monkeypatch.setattr(Tensor, f, refuse)
  model, (x, y) = GPT(CFG, seed=0), batch
  def run(n:int) -> tuple[np.ndarray, np.ndarray, float, str]:  # read at once: the next call's JIT writes its outputs again
    g, loss = estimators.run(model, x, y, method, pop, 3, devices=n, **opts)
    return g.key.numpy(), g.coef.numpy(), loss.item(), g.coef.device
  (k1, c1, l1, d1), (k2, c2, l2, d2) = run(1), run(2)
  np.testing.assert_array_equal(k2, k1)
  np.testing.assert_allclose(c2, c1, rtol=0, atol=1.5e-6 / scale)
  assert np.abs(c1).min() > 100 * 1.5e-6 / scale, c1  # the draws move the loss well above that
  assert abs(l2 - l1) < 1.5e-6 and d1 == d2 == "CPU"

def test_dust_same_key_same_estimate(batch):
  # Dust splits every group's chunks over the devices, each device capturing the clean pass itself, and takes the share-weighted
  # mean on the first device: a device that drew another share's keys, normalized by the wrong count, or read a stale capture
  # moves the estimate by far more than float rounding (a few ulps of the per-share means, 1e-5 of the largest entry)
  model, (x, y) = GPT(CFG, seed=0), batch
  g1, g2 = (estimators.estimate(model, x, y, "dust", 64, 5, devices=n) for n in (1, 2))
  for name, a in g1.items():
    a, b = a.numpy(), g2[name].numpy()
    assert np.abs(a).max() > 0 and np.abs(a - b).max() <= 1e-5 * np.abs(a).max(), name
  assert all(g.device == "CPU" for g in g2.values())

@pytest.mark.parametrize("method, pop", [("mezo", 3), ("es", 6)])
def test_each_device_draws_its_own_keys(batch, monkeypatch, method:str, pop:int):
  # every device must run a forward on its own replica (parameters on that device) over its own block of draws, the blocks
  # disjoint and together all of them: a split that gives each device draws 0..n-1, or runs everything on CPU, fails here
  seen:dict[str, list[int]] = {}
  def spy(fn):
    def wrapped(m, k, x, y, key, *a, **kw):  # runs when its JIT captures, once a device: the graph is built on that device's replica
      assert devices.device(m) == x.device == key.device and all(p.device == x.device for p in m.params.values())
      return fn(m, k, x, y, key, *a, **kw)
    return wrapped
  stack = engine.stack
  def recorded(fn, m, *inputs, items:range, **kw):  # every call: the directions each device gets
    seen.setdefault(inputs[0].device, []).extend(items)
    return stack(fn, m, *inputs, items=items, **kw)
  monkeypatch.setattr(estimators, "perturbed_losses", spy(estimators.perturbed_losses))
  monkeypatch.setattr(engine, "stack", recorded)
  model, (x, y) = GPT(CFG, seed=1), batch  # a new model, so new JITs that call the spy
  estimators.run(model, x, y, method, pop, 4, devices=2)
  assert seen == {"CPU": [0], "CPU:1": [1, 2]}, seen

def test_training_on_two_devices(tmp_path, monkeypatch):
  # a 3-step run on 2 devices: the replica on CPU:1 must see each update (its copy refreshed every step), so its train losses
  # and final weights follow the 1-device run to float tolerance; and --devices must reach the estimator
  monkeypatch.setattr(signal, "signal", lambda *a: None)  # zo.main's Ctrl-C handler would outlive the run in this process
  spread, ns = estimators.spread, []
  def spy(m, n, *a):  # the steps' calls: not the first step's dry run (engine.compile_ahead)
    if engine.AHEAD is None: ns.append(n)
    return spread(m, n, *a)
  monkeypatch.setattr(estimators, "spread", spy)
  run = ["--method", "mezo", "--pop", "3", "--model", "tiny", "--vocab", "64", "--seq", str(T), "--batch", str(B), "--steps", "3",
         "--lr", "3e-3"]
  for n in (1, 2): zo.main(run + ["--devices", str(n), "--out", str(tmp_path / str(n))])
  logs = [[json.loads(line) for line in open(tmp_path / str(n) / "metrics.jsonl")] for n in (1, 2)]
  assert [r["step"] for r in logs[1]] == [0, 1, 2] and json.load(open(tmp_path / "2" / "config.json"))["devices"] == 2
  np.testing.assert_allclose([r["train_loss"] for r in logs[1]], [r["train_loss"] for r in logs[0]], rtol=0, atol=2e-6)
  assert ns == [1] * 3 + [2] * 3, ns
  w1, w2 = (safe_load(str(tmp_path / str(n) / "model.safetensors")) for n in (1, 2))
  for k in (k for k in w1 if k.startswith("param.")): np.testing.assert_allclose(w2[k].numpy(), w1[k].numpy(), rtol=0, atol=1e-6, err_msg=k)

@pytest.mark.parametrize("argv, says", [(["--devices", "0"], "at least 1"), (["--pop", "2", "--devices", "3"], "--pop 2 has 2"),
                                        (["--method", "es", "--pop", "2", "--devices", "2"], "--pop 2 has 1"),
                                        (["--method", "backprop", "--devices", "2"], "one device"),
                                        (["--cosine", "--pop", "4", "16", "--devices", "8"], "--pop 4 has 4")])
def test_bad_devices(tmp_path, capsys, argv:list[str], says:str):
  # a bad --devices must stop before any work with exit code 2 and one line naming the flag, not a traceback or a silent 1-device run
  with pytest.raises(SystemExit) as e: zo.main(["--method", "mezo", "--steps", "1", "--out", str(tmp_path)] + argv)
  err = capsys.readouterr().err
  assert e.value.code == 2 and len(err.strip().splitlines()) == 1 and err.startswith("zo: error: --devices") and says in err, err
