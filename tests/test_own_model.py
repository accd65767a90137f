"""docs/model.md, run from the page: each of its code blocks saved as the learner's own file, each of its commands run through
zo.py's command line (zo.main), nothing of zo's edited. Every training run must lower its validation loss, the refusals must be
one line that names what the model lacks, and the binary GPT's backprop gradient must be zero at c_fc and nonzero elsewhere.

Cost (docs/performance.md has each test's cold seconds): the runs are the page's, sized to seconds (one block 16 wide, 2x16 tokens
a step; the counter 130 floats; Dust one tiny block at 4x16 tokens). The binary GPT's mezo and es runs share their population
forward (16 members a call)."""
import json, re, shlex, signal
from pathlib import Path
from types import SimpleNamespace
import numpy as np
import pytest
from tinygrad import Context, Tensor, dtypes
from kernels.noise import fold, gaussian, key as root_key
from model import GPT, GPTConfig
import dust, estimators, flags, registry, zo

ROOT = Path(__file__).resolve().parent.parent
PAGE = (ROOT / "docs/model.md").read_text()
BLOCKS = dict(zip(re.findall(r"Save\s+this\s+as\s+`(\w+\.py)`", PAGE), re.findall(r"```python\n(.*?)```", PAGE, re.S)))
COMMANDS = [shlex.split(line.strip())[2:] for line in PAGE.splitlines() if line.startswith("    python zo.py")]

@pytest.fixture(scope="module", autouse=True)
def fast_compile():
  """On the CPU, tinygrad's kernel optimizer costs ~3x more lowering time than these tiny kernels ever win back."""
  with Context(NOOPT=1): yield

@pytest.fixture
def learner(tmp_path, monkeypatch):
  """The page's files in a folder of the learner's; zo's registries as they were after the test (the plugins add models)."""
  for name, code in BLOCKS.items(): (tmp_path / name).write_text(code)
  monkeypatch.setattr(registry, "MODELS", dict(registry.MODELS))
  monkeypatch.setattr(zo, "MODELS", registry.MODELS)
  monkeypatch.setattr(flags, "MODELS", registry.MODELS)
  monkeypatch.setitem(flags.DECLARED, "model", registry.MODELS)
  monkeypatch.setattr(signal, "signal", lambda *a: None)  # zo.main's Ctrl-C handler would outlive the run in this process
  return tmp_path

def commands(model:str, method:str) -> list[list[str]]:
  return [c for c in COMMANDS if c[c.index("--model") + 1] == model and c[c.index("--method") + 1] == method]

def run(folder:Path, argv:list[str], out:str) -> list[dict]:
  """The page's command, its --plugin the learner's file: the logged steps."""
  argv = [str(folder / a) if a.endswith(".py") else a for a in argv]
  zo.main([*argv, "--out", str(folder / out)])
  return [json.loads(line) for line in open(folder / out / "metrics.jsonl")]

def refused(folder:Path, argv:list[str], capsys) -> str:
  with pytest.raises(SystemExit) as e: run(folder, argv, "refused")
  err = capsys.readouterr().err
  assert e.value.code == 2 and len(err.strip().splitlines()) == 1 and err.startswith("zo: error: "), err
  assert not (folder / "refused").exists(), "a refused run wrote its folder"
  return err

def test_page_has_its_examples():
  # three files, and the commands the sections describe: a wrong regex or a dropped command would silently test less
  assert list(BLOCKS) == ["binary.py", "counter.py", "gelu.py"]
  assert [len(commands(m, e)) for m, e in (("binary", "mezo"), ("binary", "es"), ("binary", "backprop"), ("counter", "es"),
                                           ("counter", "dust"), ("gelu", "dust"))] == [1] * 6

@pytest.mark.parametrize("model, method", [("binary", "mezo"), ("binary", "es"), ("counter", "es"), ("gelu", "dust")])
def test_page_trains(learner, model:str, method:str):
  # an estimator that stops training the learner's model (a model option that doesn't reach it, a perturbation that doesn't
  # reach its losses, plain tensors handed to a model that takes no population in the wrong order) leaves the val loss where it
  # was. The val batches are fixed, so the fall is no sampling noise; the margins are a quarter of what the page's runs fell
  # (binary 0.052 nats by mezo and 0.030 by es, counter 0.23 of its error rate, gelu 0.55 nats)
  (argv,) = commands(model, method)
  val = [r["val_loss"] for r in run(learner, argv, model) if "val_loss" in r]
  fall = {("binary", "mezo"): 0.013, ("binary", "es"): 0.0075, ("counter", "es"): 0.058, ("gelu", "dust"): 0.14}[model, method]
  assert val[0] - val[-1] > fall, f"{model} by {method}: val {val}"

def test_page_refusals(learner, capsys):
  # backprop refuses the binary GPT and the counter, naming a parameter that has no gradient; Dust refuses the counter, which has
  # no sites. Each before anything is written
  (binary,), (counter,), (dust,) = commands("binary", "backprop"), commands("counter", "es"), commands("counter", "dust")
  err = refused(learner, binary, capsys)
  assert "BinaryGPT" in err and "transformer.h.0.mlp.c_fc.weight" in err, err
  err = refused(learner, [*counter[:counter.index("--method")], "--method", "backprop"], capsys)
  assert "Counter" in err and "no gradient for embed and 3 more" in err, err
  assert "no sites" in refused(learner, dust, capsys)

def test_binary_backprop_gradient_is_zero(learner, monkeypatch):
  # backprop's refusal is no guess: tinygrad's autograd, as --method backprop computes it, gives c_fc a gradient of zeros in every
  # entry, and every other parameter (attention, c_proj, embeddings, head, scalars) a nonzero one
  flags.plugins(["--plugin", str(learner / "binary.py")])
  model = registry.MODELS["binary"].make(vocab=64, seed=0, dtype=dtypes.float32, layers=1, width=16, context=16)
  rng = np.random.default_rng(0)
  x, y = [Tensor(rng.integers(0, 64, (2, 16)).astype(np.int32)).realize() for _ in range(2)]
  g = {n: t.numpy() for n, t in estimators.estimate(model, x, y, "backprop", 1, 0).items()}
  assert not g["transformer.h.0.mlp.c_fc.weight"].any()
  assert all(np.abs(v).sum() > 0 for n, v in g.items() if n != "transformer.h.0.mlp.c_fc.weight"), \
    {n: float(np.abs(v).sum()) for n, v in g.items()}

def test_model_options_are_flags(learner, capsys):
  # a model's options reach it as flags, are listed under it by --help, and are refused for a model that doesn't take them
  with pytest.raises(SystemExit): zo.parse(["--plugin", str(learner / "binary.py"), "--help"])
  assert "--model binary" in (out := capsys.readouterr().out) and "--layers" in out and "--context" in out, out
  args = zo.parse(["--plugin", str(learner / "binary.py"), "--model", "binary", "--width", "8"])
  assert (args.layers, args.width, args.context) == (2, 8, 64)
  with pytest.raises(SystemExit) as e: zo.parse(["--plugin", str(learner / "binary.py"), "--model", "tiny", "--width", "8"])
  assert e.value.code == 2 and "--model tiny does not take --width" in capsys.readouterr().err

def test_one_member_a_forward(learner):
  # a model that takes no population gets plain tensors, one member a forward: MeZO's coefficients on the counter must be those
  # of the losses at θ ± εz_k computed here, z_k for parameter i the Gaussian of fold(key, k, i), as the batched forward draws it
  # (a direction drawn from another key, a member given the wrong sign or no perturbation at all, breaks the equality)
  flags.plugins(["--plugin", str(learner / "counter.py")])
  model = registry.MODELS["counter"].make(vocab=None, seed=0, width=8)
  x = Tensor(np.random.default_rng(0).integers(0, 2, (32, 4)).astype(np.int32)).realize()  # the page's batch
  y = x.cumsum(1).mod(2).realize()
  K, eps, seed = 4, 0.1, 3  # the page's σ: its perturbed weights' kernels compiled already
  g, _ = estimators.run(model, x, y, "mezo", K, seed, eps=eps)
  def loss(k:int, s:int) -> float:
    keys = fold(root_key(seed), Tensor([k]))
    return model.losses(x, y, {n: p + s * eps * gaussian(fold(keys, i), p.shape)[0] for i, (n, p) in enumerate(model.params.items())}) \
      .mean().item()
  want = [(loss(k, 1) - loss(k, -1)) / (2 * eps * K) for k in range(K)]
  np.testing.assert_allclose(g.coef.numpy(), want, rtol=0, atol=1e-6)
  assert any(want), "no direction moved the error count: the test would see nothing"

def test_contract_refusals(learner):
  # what every estimator needs (registry.lacks) and what Dust needs beyond it (dust.lacks), each named
  class NoParams: losses = lambda self, x, y, params=None: x
  class NoParamsArg:
    params, cfg = {"w": Tensor.zeros(2).contiguous().realize()}, SimpleNamespace(vocab=2, seq_len=4)
    def losses(self, x, y): return x
  class Half(NoParamsArg): params = {"w": Tensor.zeros(2, dtype=dtypes.half).contiguous().realize()}
  assert "params" in registry.lacks(NoParams()) and "losses(x, y, params=None)" in registry.lacks(NoParamsArg())
  assert "float32" in registry.lacks(Half())
  class Biased(GPT):  # a parameter at no site: Dust would leave it without an estimate
    def __init__(self, *a):
      super().__init__(*a)
      self.params["transformer.h.0.mlp.bias"] = Tensor.zeros(4 * self.cfg.n_embd).contiguous().realize()
  cfg = GPTConfig(vocab=16, seq_len=4, n_layer=1, n_head=2, n_embd=8)
  assert dust.lacks(GPT(cfg)) is None and "transformer.h.0.mlp.bias" in dust.lacks(Biased(cfg))
  flags.plugins(["--plugin", str(learner / "counter.py")])
  assert "sites" in dust.lacks(registry.MODELS["counter"].make(vocab=None, seed=0))
