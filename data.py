"""Data sources: a spec string -> a Source whose batch(split, i, B, T) is a pure function of (seed, split, i, B, T)."""
import io, itertools, os
import numpy as np

SPLITS = {"train": 0, "val": 1}
BIN_MAGIC, BIN_HEADER = 20240520, 4 * 256  # llm.c / modded-nanogpt shard: 256 int32 header (magic, version, n), then n uint16 tokens
FORMS = "synthetic, synthetic:parity, synthetic:s5, or a path ending in .txt, .bin or .npy"

class DataError(Exception): pass

class Source:
  def __init__(self, name:str, vocab:int, floor:float|None, seed:int):
    self.name, self.vocab, self.floor, self.seed = name, vocab, floor, seed

  def batch(self, split:str, i:int, B:int, T:int) -> tuple[np.ndarray, np.ndarray]:
    """(x, y) int32 [B, T] for batch i of split ("train" or "val"): the same arguments give the same arrays, so a resumed run sees
    the same batches."""
    x, y = self.sample(np.random.default_rng((self.seed, SPLITS[split], i)), split, B, T)
    return x.astype(np.int32), y.astype(np.int32)

  def sample(self, rng:np.random.Generator, split:str, B:int, T:int) -> tuple[np.ndarray, np.ndarray]: raise NotImplementedError

class Markov(Source):
  """A seeded random order-1 Markov chain over vocab states. State s moves to one of k = min(8, vocab) distinct successors with
  Dirichlet(1) probabilities: s itself (a self loop: aperiodic), s+1 mod vocab (a cycle through all states: irreducible) and k-2 more
  at random offsets. So the stationary distribution pi is unique, and floor is the entropy rate sum_s pi_s H(P[s]) in nats."""
  def __init__(self, vocab:int, seed:int):
    rng, k = np.random.default_rng((seed, len(SPLITS))), min(8, vocab)  # a stream apart from those of the train and val batches
    # offsets 0, 1, then cumulative gaps in [1, (vocab-2)//(k-2)]: strictly increasing and at most vocab-1, so the successors are distinct
    gaps = rng.integers(1, (vocab - 2) // max(k - 2, 1) + 1, (vocab, k - 2))
    self.succ = (np.arange(vocab)[:, None] + np.cumsum(np.concatenate([np.tile([0, 1], (vocab, 1)), gaps], 1), 1)) % vocab
    self.P = rng.dirichlet(np.ones(k), vocab)
    self.cdf = np.cumsum(self.P, 1)
    self.cdf[:, -1] = 1.0  # so every u in [0, 1) picks a successor despite rounding
    self.pi = self.stationary()
    super().__init__("synthetic", vocab, float(self.pi @ -(self.P * np.log(self.P)).sum(1)), seed)

  def stationary(self) -> np.ndarray:
    pi = np.full(len(self.P), 1 / len(self.P))
    for _ in range(10_000):  # power iteration pi <- pi P, with P stored sparse as (succ, P)
      pi, prev = np.bincount(self.succ.ravel(), (pi[:, None] * self.P).ravel(), len(pi)), pi
      if np.abs(pi - prev).sum() < 1e-14: break
    return pi

  def sample(self, rng:np.random.Generator, split:str, B:int, T:int) -> tuple[np.ndarray, np.ndarray]:
    row, u = np.empty((B, T + 1), np.int64), rng.random((B, T))
    row[:, 0] = rng.choice(len(self.pi), B, p=self.pi)
    for t in range(T):
      s = row[:, t]
      row[:, t + 1] = self.succ[s, (u[:, t, None] >= self.cdf[s]).sum(1)]
    return row[:, :-1], row[:, 1:]

class Parity(Source):
  """x: random bits; y[t] = x[0] xor ... xor x[t]. One bit of state carried over the whole sequence."""
  def __init__(self, seed:int): super().__init__("synthetic:parity", 2, 0.0, seed)

  def sample(self, rng:np.random.Generator, split:str, B:int, T:int) -> tuple[np.ndarray, np.ndarray]:
    x = rng.integers(0, 2, (B, T))
    return x, np.cumsum(x, 1) % 2

class S5(Source):
  """x[t]: id of a uniformly random permutation g_t of 5 elements (ids: order of itertools.permutations); y[t]: id of g_0 ∘ g_1 ∘ ... ∘ g_t,
  where (a ∘ b)[i] = a[b[i]]. The word problem of S5 is NC1-complete: a fixed-depth model can't track it over long sequences."""
  def __init__(self, seed:int):
    perms = list(itertools.permutations(range(5)))
    ids = {p: i for i, p in enumerate(perms)}
    self.compose = np.array([[ids[tuple(a[j] for j in b)] for b in perms] for a in perms])  # compose[a, b] = id of a ∘ b
    super().__init__("synthetic:s5", len(perms), 0.0, seed)

  def sample(self, rng:np.random.Generator, split:str, B:int, T:int) -> tuple[np.ndarray, np.ndarray]:
    x = rng.integers(0, self.vocab, (B, T))
    y = x.copy()
    for t in range(1, T): y[:, t] = self.compose[y[:, t - 1], x[:, t]]
    return x, y

class Tokens(Source):
  """A token stream whose last 10% is val. A row is a window of T+1 tokens at a random offset inside the split."""
  def __init__(self, name:str, vocab:int, ids:np.ndarray, seed:int):
    super().__init__(name, vocab, None, seed)
    n = len(ids) - len(ids) // 10
    self.parts = {"train": ids[:n], "val": ids[n:]}

  def sample(self, rng:np.random.Generator, split:str, B:int, T:int) -> tuple[np.ndarray, np.ndarray]:
    part = self.parts[split]
    row = part[rng.integers(0, len(part) - T, B)[:, None] + np.arange(T + 1)]
    return row[:, :-1], row[:, 1:]

# ***** reading files *****

def read(path:str) -> bytes:
  try:
    with open(path, "rb") as f: data = f.read()
  except FileNotFoundError: raise DataError(f"{path}: no such file") from None
  except OSError as e: raise DataError(f"{path}: can't read it: {e.strerror or e}") from None
  if not data: raise DataError(f"{path}: the file is empty")
  return data

def read_txt(path:str, data:bytes) -> np.ndarray: return np.frombuffer(data, np.uint8)

def read_bin(path:str, data:bytes) -> np.ndarray:
  if len(data) < BIN_HEADER: raise DataError(f"{path}: {len(data)} bytes, shorter than the {BIN_HEADER}-byte header of a .bin shard")
  magic, version, n = np.frombuffer(data, "<i4", 3).tolist()
  if magic != BIN_MAGIC: raise DataError(f"{path}: bad magic {magic} in the header, expected {BIN_MAGIC} (llm.c / modded-nanogpt .bin shard)")
  if version != 1: raise DataError(f"{path}: unsupported .bin version {version}, expected 1")
  if len(data) != BIN_HEADER + 2 * n:
    raise DataError(f"{path}: the header says {n} tokens but the file holds {(len(data) - BIN_HEADER) // 2}: truncated or corrupt")
  return np.frombuffer(data, "<u2", offset=BIN_HEADER)

def read_npy(path:str, data:bytes) -> np.ndarray:
  try: ids = np.load(io.BytesIO(data), allow_pickle=False)
  except (ValueError, EOFError) as e: raise DataError(f"{path}: not a valid .npy file: {e}") from None
  if not isinstance(ids, np.ndarray): raise DataError(f"{path}: an .npz archive, expected one .npy array of token ids")
  if not np.issubdtype(ids.dtype, np.integer): raise DataError(f"{path}: holds {ids.dtype} values, token ids must be integers")
  if ids.size and ids.min() < 0: raise DataError(f"{path}: holds negative token ids (min {ids.min()})")
  return ids.ravel()

READERS = {".txt": read_txt, ".bin": read_bin, ".npy": read_npy}
TASKS = {"synthetic:parity": Parity, "synthetic:s5": S5}

def check_vocab(name:str, top:int, vocab:int):
  if top >= vocab: raise DataError(f"{name}: token ids go up to {top} but the model's vocab is {vocab}: use --vocab {top + 1}")

def load_tokens(path:str, vocab:int, seq_len:int, seed:int) -> Tokens:
  ext = os.path.splitext(path)[1]
  ids = READERS[ext](path, read(path))
  if len(ids) // 10 < seq_len + 1:
    raise DataError(f"{path}: too short for one batch of seq_len {seq_len}: {len(ids)} tokens, need {10 * (seq_len + 1)} "
                    f"(the last 10% is val, and each split needs seq_len+1)")
  check_vocab(path, top := int(ids.max()), vocab)
  return Tokens(path, 256 if ext == ".txt" else top + 1, ids, seed)

def load(spec:str, vocab:int, seq_len:int, seed:int=0) -> Source:
  if vocab < 2 or seq_len < 1: raise DataError(f"{spec}: needs vocab >= 2 and seq_len >= 1, got vocab {vocab} and seq_len {seq_len}")
  if spec == "synthetic": return Markov(vocab, seed)
  if spec in TASKS:
    check_vocab(spec, (src := TASKS[spec](seed)).vocab - 1, vocab)
    return src
  if os.path.splitext(spec)[1] in READERS: return load_tokens(spec, vocab, seq_len, seed)
  raise DataError(f"unknown data spec {spec!r}: use {FORMS}")
