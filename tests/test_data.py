"""Tests of data.py: determinism, shapes, the Markov source's entropy rate, the tasks' targets, file formats and their errors."""
import itertools, math, os, pathlib
import numpy as np
import pytest
from data import DataError, load

SHAKESPEARE = pathlib.Path("/work/shared/data/tinyshakespeare.txt")

def write_bin(path:pathlib.Path, tokens:np.ndarray, magic:int=20240520, version:int=1, n:int|None=None):
  header = np.zeros(256, "<i4")
  header[:3] = magic, version, len(tokens) if n is None else n
  path.write_bytes(header.tobytes() + tokens.astype("<u2").tobytes())

def raises(spec:str, *words:str, vocab:int=256, seq_len:int=8) -> str:
  with pytest.raises(DataError) as e: load(spec, vocab, seq_len)
  msg = str(e.value)
  assert "\n" not in msg and all(w in msg for w in words), msg
  return msg

def check_batches(src, B:int, T:int, stream:bool):
  x, y = src.batch("train", 0, B, T)
  assert x.shape == y.shape == (B, T) and x.dtype == y.dtype == np.int32
  assert 0 <= min(x.min(), y.min()) and max(x.max(), y.max()) < src.vocab
  if stream: np.testing.assert_array_equal(x[:, 1:], y[:, :-1])
  assert np.array_equal(x, src.batch("train", 0, B, T)[0])
  assert not np.array_equal(x, src.batch("train", 1, B, T)[0]) and not np.array_equal(x, src.batch("val", 0, B, T)[0])

# ***** synthetic *****

def test_markov_batches():
  src = load("synthetic", 64, 32, seed=3)
  assert src.name == "synthetic" and src.vocab == 64
  check_batches(src, 4, 32, stream=True)
  # a pure function of (seed, split, i, B, T): a fresh source (a resumed run) gives the same batch, another seed another one
  np.testing.assert_array_equal(load("synthetic", 64, 32, seed=3).batch("val", 5, 4, 32)[0], src.batch("val", 5, 4, 32)[0])
  assert not np.array_equal(load("synthetic", 64, 32, seed=4).batch("val", 5, 4, 32)[0], src.batch("val", 5, 4, 32)[0])

def test_markov_entropy_rate():
  src = load("synthetic", 64, 1024, seed=1)
  assert 0 < src.floor < math.log(64) and src.floor == pytest.approx(src.pi @ -(src.P * np.log(src.P)).sum(1))
  np.testing.assert_allclose(np.bincount(src.succ.ravel(), (src.pi[:, None] * src.P).ravel(), 64), src.pi, atol=1e-12)  # pi P = pi
  x, y = src.batch("train", 0, 256, 1024)
  hit = src.succ[x] == y[..., None]
  assert (hit.sum(-1) == 1).all(), "every transition goes to one listed successor"
  nll = -np.log((src.P[x] * hit).sum(-1)).ravel()
  # 8 sigma: consecutive tokens are a little correlated, so the effective sample is smaller than nll.size
  assert abs(nll.mean() - src.floor) < 8 * nll.std() / math.sqrt(nll.size), (nll.mean(), src.floor)
  # the states visited follow pi, which is far from uniform (so a floor weighted by a uniform pi would be wrong)
  tol = 10 * math.sqrt(src.pi.max() / x.size)
  np.testing.assert_allclose(np.bincount(x.ravel(), minlength=64) / x.size, src.pi, atol=tol)
  assert np.abs(src.pi - 1 / 64).max() > 3 * tol
  x0 = src.batch("val", 0, 1 << 16, 1)[0][:, 0]  # the start states are drawn from pi too
  np.testing.assert_allclose(np.bincount(x0, minlength=64) / x0.size, src.pi, atol=6 * math.sqrt(src.pi.max() / x0.size))

def test_markov_small_vocab():
  for vocab in (2, 3, 9):
    src = load("synthetic", vocab, 16)
    assert 0 < src.floor < math.log(vocab)
    check_batches(src, 8, 16, stream=True)

def test_parity():
  src = load("synthetic:parity", 2, 64)
  assert (src.name, src.vocab, src.floor) == ("synthetic:parity", 2, 0.0)
  check_batches(src, 16, 64, stream=False)
  x, y = src.batch("val", 7, 16, 64)
  assert set(np.unique(x)) == {0, 1}
  np.testing.assert_array_equal(y, np.bitwise_xor.accumulate(x, axis=1))

def test_s5():
  src = load("synthetic:s5", 128, 32)
  assert (src.name, src.vocab, src.floor) == ("synthetic:s5", 120, 0.0)
  check_batches(src, 4, 32, stream=False)
  perms = list(itertools.permutations(range(5)))
  x, y = src.batch("train", 2, 4, 32)
  for xb, yb in zip(x.tolist(), y.tolist()):
    acc = tuple(range(5))
    for g, target in zip(xb, yb):
      acc = tuple(acc[perms[g][i]] for i in range(5))  # acc ∘ g: apply g first
      assert perms[target] == acc

def test_task_needs_vocab():
  raises("synthetic:s5", "synthetic:s5", "--vocab 120", vocab=100)
  raises("synthetic", "vocab", vocab=1)

# ***** files *****

def test_txt(tmp_path:pathlib.Path):
  text = "héllo, world: to be or not to be\n" * 20
  (p := tmp_path / "a.txt").write_text(text, encoding="utf-8")
  src = load(str(p), 256, 8)
  assert src.name == str(p) and src.vocab == 256 and src.floor is None
  assert np.concatenate([src.parts["train"], src.parts["val"]]).tobytes() == text.encode()
  check_batches(src, 4, 8, stream=True)

def test_shakespeare():
  if not SHAKESPEARE.exists(): pytest.skip(f"{SHAKESPEARE} not present")
  src = load(str(SHAKESPEARE), 256, 256)
  assert np.concatenate([src.parts["train"], src.parts["val"]]).tobytes() == SHAKESPEARE.read_bytes()
  x, _ = src.batch("train", 0, 4, 256)
  assert all(bytes(row.astype(np.uint8)) in SHAKESPEARE.read_bytes() for row in x)

def test_bin(tmp_path:pathlib.Path):
  tokens = np.random.default_rng(0).integers(0, 50257, 1000)
  tokens[3] = 50256
  write_bin(p := tmp_path / "shard.bin", tokens)
  src = load(str(p), 50304, 16)
  assert src.vocab == 50257
  np.testing.assert_array_equal(np.concatenate([src.parts["train"], src.parts["val"]]), tokens)
  check_batches(src, 4, 16, stream=True)

def test_bin_errors(tmp_path:pathlib.Path):
  tokens = np.arange(1000)
  write_bin(p := tmp_path / "magic.bin", tokens, magic=20240521)
  raises(str(p), str(p), "magic", vocab=1000)
  write_bin(p := tmp_path / "version.bin", tokens, version=2)
  raises(str(p), str(p), "version", vocab=1000)
  write_bin(p := tmp_path / "truncated.bin", tokens, n=1001)
  raises(str(p), str(p), "truncated", vocab=1000)
  (p := tmp_path / "header.bin").write_bytes(b"\0" * 100)
  raises(str(p), str(p), "header", vocab=1000)

def test_npy(tmp_path:pathlib.Path):
  ids = np.random.default_rng(0).integers(0, 300, (10, 50), dtype=np.int16)
  np.save(p := tmp_path / "ids.npy", ids)
  src = load(str(p), 300, 8)
  assert src.vocab == ids.max() + 1
  np.testing.assert_array_equal(np.concatenate([src.parts["train"], src.parts["val"]]), ids.ravel())
  check_batches(src, 4, 8, stream=True)
  assert f"--vocab {ids.max() + 1}" in raises(str(p), str(p), str(ids.max()), vocab=int(ids.max()))

def test_npy_errors(tmp_path:pathlib.Path):
  np.save(p := tmp_path / "float.npy", np.ones(1000))
  raises(str(p), str(p), "float64")
  np.save(p := tmp_path / "negative.npy", -np.ones(1000, np.int32))
  raises(str(p), str(p), "negative")
  (p := tmp_path / "garbage.npy").write_bytes(b"not an array")
  raises(str(p), str(p), ".npy")

def test_file_errors(tmp_path:pathlib.Path):
  raises(str(tmp_path / "missing.txt"), "missing.txt", "no such file")
  (p := tmp_path / "empty.txt").write_bytes(b"")
  raises(str(p), "empty.txt", "empty")
  (p := tmp_path / "dir.txt").mkdir()
  raises(str(p), "dir.txt")
  (p := tmp_path / "short.txt").write_bytes(b"x" * 89)  # 8 val tokens: seq_len 8 needs 9
  raises(str(p), "short.txt", "too short for one batch of seq_len 8: 89 tokens")
  (p := tmp_path / "data.csv").write_bytes(b"1,2,3")
  raises(str(p), "data.csv", ".npy")
  raises("synthetic:nope", "synthetic:nope", "synthetic:parity")

@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root reads any file")
def test_unreadable(tmp_path:pathlib.Path):
  (p := tmp_path / "locked.txt").write_bytes(b"x" * 1000)
  p.chmod(0)
  raises(str(p), "locked.txt", "read")

def test_split(tmp_path:pathlib.Path):
  np.save(p := tmp_path / "split.npy", np.array([1] * 90 + [2] * 10))  # the last 10% is val
  src = load(str(p), 3, 9)
  for i in range(20):
    assert (np.concatenate(src.batch("train", i, 8, 9)) == 1).all() and (np.concatenate(src.batch("val", i, 8, 9)) == 2).all()

def test_windows_without_replacement(tmp_path:pathlib.Path):
  """Token files are read in windows without replacement: an epoch's rows are distinct, non-overlapping windows of the split, all
  of them once, and the next epoch's start elsewhere. With ids 0..N-1 every token is its own position, so a repeat shows."""
  np.save(p := tmp_path / "ids.npy", np.arange(10_000, dtype=np.int32))
  src, B, T = load(str(p), 10_000, 15, seed=7), 2, 15
  W = len(src.parts["train"]) // (T + 1)  # 9,000 tokens: 562 windows, 8 tokens to spare for the epoch's offset
  def rows(i0:int, n:int) -> np.ndarray:  # batches i0.. i0+n-1, each row's T+1 tokens
    x, y = zip(*[src.batch("train", i, B, T) for i in range(i0, i0 + n)])
    return np.concatenate([np.concatenate(x), np.concatenate(y)[:, -1:]], 1)
  first = rows(0, W // B)
  assert (np.diff(first, axis=1) == 1).all()  # each row one window of consecutive tokens
  assert len(np.unique(first)) == first.size == W * (T + 1)  # the epoch reads every window once, no token twice
  assert len(np.unique(first[:, 0] % (T + 1))) == 1  # on one grid
  np.testing.assert_array_equal(load(str(p), 10_000, 15, seed=7).batch("train", 3, B, T)[0], src.batch("train", 3, B, T)[0])
  offsets = {rows(k * W // B, 1)[0, 0] % (T + 1) for k in range(9)}  # the grid of epochs 0..8
  assert len(offsets) > 1  # it moves between epochs (nine equal offsets out of nine: chance 9^-8)

def test_stdlib():
  """--data stdlib: the standard library's sources without its tests, named by Python version and sha256, read as bytes."""
  import hashlib
  from data import stdlib
  corpus, which = stdlib()
  src = load("stdlib", 256, 64)
  assert src.vocab == 256 and which in src.name and hashlib.sha256(corpus).hexdigest() in src.name
  assert np.concatenate([src.parts["train"], src.parts["val"]]).tobytes() == corpus
  x, _ = src.batch("train", 0, 4, 64)
  assert all(bytes(row.astype(np.uint8)) in corpus for row in x)
