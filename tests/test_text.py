"""Tests of text in, text out: the byte-level BPE (exact round trips, trained on the training split only), its token cache beside the
text (reused, and never stale), the run's tokenizer kept by train and --resume, and the sampler: its distribution against the model's
own logits, temperature, top-k, the fixed-shape window, determinism for a seed, and the CLI's --sample and its errors.

Cost: one tiny GPT at vocab 300, whose forward compiles at one shape, [1, context], for the sampler's JIT and the references alike;
the CLI runs start in the background when the module starts, and all but one fail before any kernel is compiled."""
import hashlib, json, os, pathlib, subprocess, sys
from concurrent.futures import ThreadPoolExecutor
import numpy as np
import pytest
from safetensors.numpy import save_file
from tinygrad import Tensor
from model import GPT, GPTConfig
import data
import rundir, sampling, zo

ROOT = pathlib.Path(__file__).resolve().parent.parent
SHAKESPEARE = ROOT.parent / "shared" / "data" / "tinyshakespeare.txt"
if not SHAKESPEARE.exists(): pytest.skip(f"{SHAKESPEARE} not present", allow_module_level=True)
ENV = {**os.environ, "DEV": "CPU"}
N = 300  # the BPE's size: 44 merges, enough to compress the text
# the training split opens with non-ASCII text, so that some merges are of multi-byte characters, and the validation split holds
# characters the BPE never saw
TEXT = "Ünïcödé naïve café 日本語 — " * 20 + SHAKESPEARE.read_text()[:20_000] + "🙂 ∮ E⋅da = Q, Ωμέγα\n" * 5
CHANGED = TEXT.replace("Citizen", "Burgher")
PROMPT = "ROMEO:"

def softmax(z:np.ndarray) -> np.ndarray:
  e = np.exp(z.astype(np.float64) - z.max())
  return e / e.sum()

def cli(*args:str) -> subprocess.CompletedProcess:
  """zo.py's output as UTF-8 text, byte for byte: text=True would turn a sampled \\r into \\n."""
  r = subprocess.run([sys.executable, "zo.py", *args], cwd=ROOT, env=ENV, capture_output=True, timeout=600)
  return subprocess.CompletedProcess(r.args, r.returncode, r.stdout.decode(), r.stderr.decode())

@pytest.fixture(scope="module")
def text(tmp_path_factory) -> pathlib.Path:
  (p := tmp_path_factory.mktemp("text") / "text.txt").write_text(TEXT, encoding="utf-8")
  return p

@pytest.fixture(scope="module")
def bpe(text:pathlib.Path) -> data.BPE: return data.tokenizer(f"bpe:{N}", str(text))

@pytest.fixture(scope="module")
def model() -> GPT:
  """The tiny GPT at vocab N with its head scaled up 300x, so that the next-token distribution is far from uniform (at init the
  head's std of 0.001 leaves every logit within ~0.01 of 0, where any distribution looks like a softmax)."""
  m = GPT(GPTConfig.preset("tiny", vocab=N), seed=0)
  m.params["lm_head.weight"].assign(m.params["lm_head.weight"] * 300).realize()
  return m

def write_run(out:pathlib.Path, m:GPT, *flags:str):
  """A run directory as train leaves it: config.json from the flags, and a checkpoint of m's parameters."""
  out.mkdir(parents=True)
  json.dump(vars(zo.parse(["--model", "tiny", "--seq", "64", "--out", str(out), *flags])), open(out / "config.json", "w"))
  save_file({f"param.{n}": p.numpy() for n, p in m.params.items()}, str(out / "model.safetensors"), metadata={"step": "1"})

@pytest.fixture(scope="module", autouse=True)
def runs(request, tmp_path_factory, text:pathlib.Path, bpe:data.BPE, model:GPT):
  """Run directories, and the CLI runs on them, started when the module starts if a CLI test is selected, so that they use the
  core that the in-process tests leave idle: a sample from a BPE run, and the errors."""
  if not {getattr(item, "originalname", item.name) for item in request.session.items} & {"test_cli_sample", "test_cli_errors"}:
    yield None
    return
  root = tmp_path_factory.mktemp("runs")
  write_run(root / "bpe", model, "--data", str(text), "--tokenizer", f"bpe:{N}", "--vocab", str(N))
  bpe.save(str(root / "bpe" / "tokenizer.json"))
  write_run(root / "bytes64", GPT(GPTConfig.preset("tiny", vocab=64), seed=0), "--vocab", "64")  # a synthetic-data run
  (root / "empty").mkdir()
  (root / "nockpt").mkdir()
  (root / "nockpt" / "config.json").write_text((root / "bytes64" / "config.json").read_text())
  runs = {"sample": ("--sample", "12", "--out", str(root / "bpe"), "--prompt", PROMPT, "--temperature", "0.8", "--top-k", "50", "--seed", "3"),
          "empty": ("--sample", "5", "--out", str(root / "empty")),
          "nockpt": ("--sample", "5", "--out", str(root / "nockpt")),
          "byte": ("--sample", "5", "--out", str(root / "bytes64"), "--prompt", "0ab"),
          "spec": ("--tokenizer", "bpe:256", "--data", str(text), "--out", str(root / "x")),
          "notext": ("--tokenizer", f"bpe:{N}", "--data", "synthetic", "--out", str(root / "x")),
          "vocab": ("--tokenizer", f"bpe:{N}", "--data", str(text), "--vocab", "512", "--out", str(root / "x")),
          "resume": ("--tokenizer", f"bpe:{N}", "--data", str(text), "--resume", "--out", str(root / "bytes64"))}
  with ThreadPoolExecutor(2) as pool:
    yield root, {k: pool.submit(cli, *a) for k, a in runs.items()}

# ***** the BPE *****

def test_bpe_round_trip(bpe:data.BPE):
  # a BPE with a prefix space, a normalizer, or without all 256 bytes in its alphabet changes or drops some of these
  ids = bpe.encode(TEXT)
  assert ids.max() < N and len(ids) < 0.8 * len(TEXT.encode()), "the merges shorten the text"
  for s in (TEXT, "", " a leading space", "tabs\tand\r\nCRLF  ", "unseen: ∀x ∈ ℝ, 🙂🙃, \x00\x7f\u200b"):
    assert bpe.decode(bpe.encode(s).tolist()) == s, repr(s)
  again = data.BPE.train(TEXT[:len(TEXT) - len(TEXT) // 10], N)
  assert again.sha == bpe.sha and again.tok.to_str() == bpe.tok.to_str(), "the same text and size give the same tokenizer"

def test_bpe_trains_on_the_training_split(tmp_path:pathlib.Path):
  # the last 10% of the text is validation: a BPE trained on all of it learns its words, here "zq"
  text = SHAKESPEARE.read_text()[:9_000] + "zq" * 500
  (p := tmp_path / "split.txt").write_text(text)
  assert len(data.tokenizer("bpe:300", str(p)).encode("zqzq")) == 4
  assert len(data.BPE.train(text, 300).encode("zqzq")) < 4  # so the test can see it

def test_tokenizer_specs(tmp_path:pathlib.Path, text:pathlib.Path):
  assert isinstance(data.tokenizer("bytes", "synthetic"), data.Bytes) and data.bpe_size("bpe:65536") == 65536
  for spec in ("bpe:256", "bpe:65537", "bpe:", "bpe:x", "bpe:-300", "BPE:300", "wordpiece", ""):
    with pytest.raises(data.DataError, match="--tokenizer"): data.bpe_size(spec)
  with pytest.raises(data.DataError, match=r"--tokenizer bpe:300 is for text: --data synthetic is not a \.txt"):
    data.tokenizer("bpe:300", "synthetic")
  (p := tmp_path / "latin1.txt").write_bytes("café".encode("latin-1") * 100)
  with pytest.raises(data.DataError, match="latin1.txt: not UTF-8"): data.tokenizer("bpe:300", str(p))

# ***** the token cache *****

def test_cache_reused_and_never_stale(tmp_path:pathlib.Path, bpe:data.BPE, monkeypatch):
  # a cache keyed by the file's name alone (or its mtime), or not keyed by the tokenizer, serves the old ids after a change
  assert CHANGED != TEXT
  (p := tmp_path / "t.txt").write_text(TEXT)
  def ids(src) -> np.ndarray: return np.concatenate([src.parts["train"], src.parts["val"]])
  first = ids(src := data.load(str(p), N, 16, tok=bpe))
  assert src.vocab == N and bpe.decode(first.tolist()) == TEXT
  cache = tmp_path / f"t.txt.{hashlib.sha256(TEXT.encode()).hexdigest()[:16]}.{bpe.sha[:16]}.bin"
  assert [q.name for q in tmp_path.glob("t.txt.*")] == [cache.name]
  np.testing.assert_array_equal(data.read_bin(str(cache), cache.read_bytes()), first)
  mtime = cache.stat().st_mtime_ns
  def refuse(self, text): raise AssertionError("tokenized again")
  with monkeypatch.context() as m:
    m.setattr(data.BPE, "encode", refuse)
    np.testing.assert_array_equal(ids(data.load(str(p), N, 16, tok=bpe)), first)  # read from the cache
    p.write_text(CHANGED)
    with pytest.raises(AssertionError, match="tokenized again"): data.load(str(p), N, 16, tok=bpe)
  assert cache.stat().st_mtime_ns == mtime
  assert bpe.decode(ids(data.load(str(p), N, 16, tok=bpe)).tolist()) == CHANGED
  other = data.BPE.train(TEXT, N + 10)
  assert bpe.sha != other.sha and other.decode(ids(data.load(str(p), N + 10, 16, tok=other)).tolist()) == CHANGED
  assert len(list(tmp_path.glob("t.txt.*.bin"))) == 3 and not list(tmp_path.glob("*.tmp"))
  with pytest.raises(data.DataError, match=r"--tokenizer bpe:300 is for text: --data synthetic"): data.load("synthetic", N, 16, tok=bpe)

# ***** the run's tokenizer: train saves it, --resume and --sample read it *****

def test_train_keeps_the_tokenizer(tmp_path:pathlib.Path, bpe:data.BPE, monkeypatch):
  # a run keeps its BPE, recorded with the text by their sha256: --resume reads it back (a BPE retrained on a changed text would
  # tokenize it with another vocabulary than the checkpoint's), and refuses a text that changed since
  (p := tmp_path / "t.txt").write_text(TEXT)
  out = tmp_path / "run"
  class Started(Exception): pass
  def started(*a, **k): raise Started  # the first step: everything before it is set up, and no kernel has been compiled
  monkeypatch.setattr(zo, "run", started)
  monkeypatch.setattr(rundir.signal, "signal", lambda *a: None)  # train's Ctrl-C handler would outlive it in this process
  flags = ["--model", "tiny", "--data", str(p), "--tokenizer", f"bpe:{N}", "--steps", "1", "--out", str(out)]
  with pytest.raises(Started): zo.train(zo.parse(flags))
  assert data.BPE.read(str(out / "tokenizer.json"), N).sha == bpe.sha
  cfg = json.load(open(out / "config.json"))
  assert cfg["tokenizer"] == f"bpe:{N}" and cfg["vocab"] == N
  assert cfg["tokenizer_sha256"] == bpe.sha and cfg["data_sha256"] == hashlib.sha256(TEXT.encode()).hexdigest()
  with pytest.raises(zo.UsageError, match="--resume: no checkpoint"): zo.train(zo.parse(flags + ["--resume"]))  # Started never saved one
  p.write_text(CHANGED * 2)  # a changed text is another run's data
  with pytest.raises(zo.UsageError, match=rf"--resume: --data {p} is not the run's data"): zo.train(zo.parse(flags + ["--resume"]))
  assert rundir.text_tokenizer(zo.parse(flags)).sha != bpe.sha  # while a fresh run trains on the text as it is now

# ***** the sampler *****

def test_logits_are_the_models(model:GPT):
  # logits that are not the forward's (no softcap, shifted by a position, the head skipped) give other losses
  T = model.cfg.seq_len
  x, y = np.random.default_rng(0).integers(0, N, (2, 1, T))
  z = model.logits(Tensor(x)).numpy()[0]
  lse = np.log(np.exp(z.astype(np.float64)).sum(-1))
  np.testing.assert_allclose(lse - z[np.arange(T), y[0]], model.losses(Tensor(x), Tensor(y)).numpy()[0], atol=1e-4)
  assert np.abs(z).max() < model.cfg.softcap and z.std() > 1, "softcapped, and far from uniform"

def test_first_token_distribution(model:GPT, bpe:data.BPE, monkeypatch):
  # the sampler's vector at temperature 1 is the softmax of the model's logits at the prompt's last token: reading another position
  # of the padded window, a window that isn't causal, a temperature or top-k applied by default all break the first assertion
  ids = bpe.encode(PROMPT).tolist()
  tail = np.random.default_rng(2).integers(0, N, model.cfg.seq_len - len(ids)).tolist()  # other padding, which a causal model ignores
  z = model.logits(Tensor([ids + tail])).numpy()[0, len(ids) - 1]
  logits = sampling.next_logits(model, ids)
  p = sampling.next_probs(logits, 1.0, None)
  np.testing.assert_allclose(p, softmax(z), rtol=1e-4, atol=1e-7)
  assert p.max() < 0.5 and (p > 1e-3).sum() > 10, "a spread-out distribution, so the draws test something"
  # the draws follow p: each token's frequency within 5 standard errors sqrt(q(1-q)/n) of its probability q (the tokens with fewer
  # than 10 expected draws pooled into one bucket, where the normal approximation holds); n = 20,000, a fixed seed
  n = 20_000
  monkeypatch.setattr(sampling, "next_logits", lambda m, ids: logits)
  draws = np.array(sampling.generate(model, ids[:1], n, 1.0, None, seed=0)[1:])
  big = n * p >= 10
  q = np.append(p[big], p[~big].sum())
  freq = np.append(np.bincount(draws, minlength=N)[big], np.isin(draws, np.flatnonzero(~big)).sum()) / n
  assert (np.abs(freq - q) <= 5 * np.sqrt(q * (1 - q) / n)).all(), np.abs(freq - q) / np.sqrt(q * (1 - q) / n)
  skewed = softmax(logits / 0.8)[big]  # and a sampler at another temperature fails the same test
  assert not (np.abs(freq[:-1] - skewed) <= 5 * np.sqrt(skewed * (1 - skewed) / n)).all()

def test_temperature_and_top_k(monkeypatch):
  z = np.random.default_rng(0).normal(0, 3, N)
  np.testing.assert_allclose(sampling.next_probs(z, 0.5, None), softmax(2 * z), rtol=1e-9)
  for k in (1, 5, 50, N - 1, N, N + 5):
    p = sampling.next_probs(z, 0.8, k)
    keep = np.argsort(z)[-k:]
    assert (p > 0).sum() == min(k, N) and (p[keep] > 0).all(), k
    np.testing.assert_allclose(p[keep], softmax(z[keep] / 0.8), rtol=1e-9)
  assert (sampling.next_probs(np.zeros(10, np.float32), 1.0, 3) > 0).sum() == 3, "ties: still exactly k"
  monkeypatch.setattr(sampling, "next_logits", lambda m, ids: z)
  assert set(sampling.generate(None, [0], 2_000, 1.0, 5, seed=0)[1:]) == set(np.argsort(z)[-5:].tolist())

def test_window_slides(model:GPT):
  # past the context, the window holds the last seq_len tokens, at positions 0.. as in training
  ids = np.random.default_rng(1).integers(0, N, 100).tolist()
  ref = model.logits(Tensor([ids[-model.cfg.seq_len:]])).numpy()[0, -1]
  np.testing.assert_allclose(sampling.next_logits(model, ids), ref, atol=1e-5)
  assert not np.allclose(sampling.next_logits(model, ids[:-1]), ref, atol=1e-3)

def test_sampling_deterministic(model:GPT, bpe:data.BPE):
  ids = bpe.encode(PROMPT).tolist()
  a = sampling.generate(model, ids, 12, 1.0, None, seed=0)
  assert len(a) == len(ids) + 12 and a[:len(ids)] == ids and max(a) < N
  assert sampling.generate(model, ids, 12, 1.0, None, seed=0) == a and sampling.generate(model, ids, 12, 1.0, None, seed=1) != a

# ***** the command line *****

def test_cli_sample(runs, model:GPT, bpe:data.BPE):
  # stdout is the text and nothing else, the same as the sampler's for that seed, with the run's own tokenizer
  r = runs[1]["sample"].result()
  assert r.returncode == 0, r.stderr[-2000:]
  ids = sampling.generate(model, bpe.encode(PROMPT).tolist(), 12, 0.8, 50, seed=3)
  assert r.stdout == bpe.decode(ids) + "\n" and r.stdout.startswith(PROMPT)
  assert "12 tokens at" in r.stderr and "tokens/s" in r.stderr, r.stderr

@pytest.mark.parametrize("run, says", [("empty", "--sample: no run in"), ("nockpt", "--sample: no checkpoint at"),
                                       ("byte", "--prompt: 'a' is token 97, outside the model's vocab of 64"),
                                       ("spec", "--tokenizer bpe:256: use bytes or bpe:N with 256 < N <= 65536"),
                                       ("notext", "--tokenizer bpe:300 is for text: --data synthetic is not a .txt file"),
                                       ("vocab", "--vocab 512: --tokenizer bpe:300 sets the vocab to 300"),
                                       ("resume", "has no tokenizer.json: it is not a run of --tokenizer bpe:300")])
def test_cli_errors(runs, run:str, says:str):
  r = runs[1][run].result()
  lines = r.stderr.strip().splitlines()
  assert r.returncode == 2 and r.stdout == "" and len(lines) == 1 and lines[0].startswith("zo: error: ") and says in lines[0], r.stderr
