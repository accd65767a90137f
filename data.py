"""Data sources: a spec string -> a Source whose batch(split, i, B, T) is a pure function of (seed, split, i, B, T). A
tokenizer turns a .txt file into token ids: its UTF-8 bytes, or a byte-level BPE whose tokenization is cached beside the
text."""
from __future__ import annotations
import functools, hashlib, io, itertools, os, pathlib, sys, sysconfig
import numpy as np
import tokenizers

SPLITS = {"train": 0, "val": 1}
# llm.c / modded-nanogpt shard: 256 int32 header (magic, version, n), then n uint16 tokens
BIN_MAGIC, BIN_HEADER = 20240520, 4 * 256
FORMS = "synthetic, synthetic:parity, synthetic:s5, stdlib, or a path ending in .txt, .bin or .npy"

class DataError(Exception): pass

class Source:
  def __init__(self, name:str, vocab:int, floor:float|None, seed:int):
    self.name, self.vocab, self.floor, self.seed = name, vocab, floor, seed

  def batch(self, split:str, i:int, B:int, T:int) -> tuple[np.ndarray, np.ndarray]:
    """(x, y) int32 [B, T] for batch i of split ("train" or "val"): the same arguments give the same arrays, so a
    resumed run sees the same batches."""
    x, y = self.sample(np.random.default_rng((self.seed, SPLITS[split], i)), split, B, T)
    return x.astype(np.int32), y.astype(np.int32)

  def sample(self, rng:np.random.Generator, split:str, B:int, T:int) -> tuple[np.ndarray, np.ndarray]:
    raise NotImplementedError

class Markov(Source):
  """A seeded random order-1 Markov chain over vocab states. State s moves to one of k = min(8, vocab) distinct
  successors with Dirichlet(1) probabilities: s itself (a self loop: aperiodic), s+1 mod vocab (a cycle through all
  states: irreducible) and k-2 more at random offsets. So the stationary distribution pi is unique, and floor is the
  entropy rate sum_s pi_s H(P[s]) in nats."""
  def __init__(self, vocab:int, seed:int):
    # a stream apart from those of the train and val batches
    rng, k = np.random.default_rng((seed, len(SPLITS))), min(8, vocab)
    # offsets 0, 1, then cumulative gaps in [1, (vocab-2)//(k-2)]: strictly increasing and at most vocab-1, so the
    # successors are distinct
    gaps = rng.integers(1, (vocab - 2) // max(k - 2, 1) + 1, (vocab, k - 2))
    self.succ = (np.arange(vocab)[:, None] +
                 np.cumsum(np.concatenate([np.tile([0, 1], (vocab, 1)), gaps], 1), 1)) % vocab
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
  """x[t]: id of a uniformly random permutation g_t of 5 elements (ids: order of itertools.permutations); y[t]: id of
  g_0 ∘ g_1 ∘ ... ∘ g_t, where (a ∘ b)[i] = a[b[i]]. The word problem of S5 is NC1-complete: a fixed-depth model can't
  track it over long sequences."""
  def __init__(self, seed:int):
    perms = list(itertools.permutations(range(5)))
    ids = {p: i for i, p in enumerate(perms)}
    # compose[a, b] = id of a ∘ b
    self.compose = np.array([[ids[tuple(a[j] for j in b)] for b in perms] for a in perms])
    super().__init__("synthetic:s5", len(perms), 0.0, seed)

  def sample(self, rng:np.random.Generator, split:str, B:int, T:int) -> tuple[np.ndarray, np.ndarray]:
    x = rng.integers(0, self.vocab, (B, T))
    y = x.copy()
    for t in range(1, T): y[:, t] = self.compose[y[:, t - 1], x[:, t]]
    return x, y

class Tokens(Source):
  """A token stream whose last 10% is val, read without replacement: each epoch cuts a split into windows of T+1 tokens,
  from an offset drawn for the epoch, and visits them all once in a seeded random order. So no token is read twice
  before the whole split has been, and a later epoch's windows start elsewhere."""
  def __init__(self, name:str, vocab:int, ids:np.ndarray, seed:int):
    super().__init__(name, vocab, None, seed)
    n = len(ids) - len(ids) // 10
    self.parts = {"train": ids[:n], "val": ids[n:]}

  def batch(self, split:str, i:int, B:int, T:int) -> tuple[np.ndarray, np.ndarray]:
    W = len(self.parts[split]) // (T + 1)  # windows an epoch
    rows = np.arange(i * B, (i + 1) * B)
    starts = np.concatenate([self.epoch(split, int(e), T)[rows[rows // W == e] % W] for e in np.unique(rows // W)])
    row = self.parts[split][starts[:, None] + np.arange(T + 1)]
    return row[:, :-1].astype(np.int32), row[:, 1:].astype(np.int32)

  @functools.lru_cache(maxsize=4)
  def epoch(self, split:str, e:int, T:int) -> np.ndarray:
    """The window starts of epoch e, in the order it reads them: a pure function of (seed, split, e, T)."""
    part, rng = self.parts[split], np.random.default_rng((self.seed, SPLITS[split], e))
    W = len(part) // (T + 1)
    return rng.integers(0, len(part) - W * (T + 1) + 1) + rng.permutation(W) * (T + 1)

# ***** tokenizers: text <-> token ids *****

class Bytes:
  """Token i is byte i of the UTF-8 text: any text encodes, at vocab 256."""
  spec, vocab = "bytes", 256
  def encode(self, text:str) -> np.ndarray: return np.frombuffer(text.encode(), np.uint8)
  # a cut multi-byte character shows as �
  def decode(self, ids:list[int]) -> str: return bytes(ids).decode("utf-8", errors="replace")
BYTES = Bytes()

class BPE:
  """A byte-level BPE (Hugging Face tokenizers): the 256 bytes, then the merges learned from a text. Words are split as
  GPT-2 does, with no prefix space and no normalizer, so decode(encode(s)) == s for every string s. Its vocab is N, the
  size asked for, even when a short text gives fewer merges. `sha` is the sha256 of its JSON form, which keys the token
  cache."""
  def __init__(self, tok:tokenizers.Tokenizer, size:int):
    self.tok, self.vocab, self.spec = tok, size, f"bpe:{size}"
    self.sha = hashlib.sha256(tok.to_str().encode()).hexdigest()

  @staticmethod
  def train(text:str, size:int) -> BPE:  # deterministic: the same text and size give the same merges, in every process
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    alphabet = tokenizers.pre_tokenizers.ByteLevel.alphabet()  # all 256 bytes, seen or not, so that any text encodes
    tok.train_from_iterator([text], tokenizers.trainers.BpeTrainer(vocab_size=size, initial_alphabet=alphabet,
                                                                   show_progress=False))
    return BPE(tok, size)

  @staticmethod
  def read(path:str, size:int) -> BPE:
    text = read_text(path, read(path))
    try: return BPE(tokenizers.Tokenizer.from_str(text), size)
    # tokenizers raises a bare Exception
    except Exception as e: raise DataError(f"{path}: not a tokenizer's JSON ({e})") from None

  def save(self, path:str):
    with open(tmp := f"{path}.{os.getpid()}.tmp", "w") as f: f.write(self.tok.to_str())
    os.replace(tmp, path)

  # N <= 65536: uint16, as in a .bin
  def encode(self, text:str) -> np.ndarray: return np.array(self.tok.encode(text).ids, np.uint16)
  def decode(self, ids:list[int]) -> str: return self.tok.decode(ids)

def bpe_size(spec:str) -> int|None:
  """--tokenizer: None for bytes, N for bpe:N. 256 < N: more than the bytes it starts from; N <= 65536: ids fit a .bin's
  uint16."""
  if spec == "bytes": return None
  kind, _, n = spec.partition(":")
  if kind != "bpe" or not n.isdigit() or not 256 < int(n) <= 65536:
    raise DataError(f"--tokenizer {spec}: use bytes or bpe:N with 256 < N <= 65536")
  return int(n)

def needs_text(spec:str, data:str):
  if not data.endswith(".txt"): raise DataError(f"--tokenizer {spec} is for text: --data {data} is not a .txt file")

def tokenizer(spec:str, data:str, saved:str|None=None) -> Bytes|BPE:
  """--tokenizer SPEC for --data DATA: bytes, or a BPE of size N, read from `saved` (a run's own tokenizer.json) or else
  trained on the training split of the text (its first 90%), so that the validation text is unseen."""
  if (n := bpe_size(spec)) is None: return BYTES
  needs_text(spec, data)
  if saved: return BPE.read(saved, n)
  text = read_text(data, read(data))
  return BPE.train(text[:len(text) - len(text) // 10], n)

# ***** reading files *****

def read(path:str) -> bytes:
  try:
    with open(path, "rb") as f: data = f.read()
  except FileNotFoundError: raise DataError(f"{path}: no such file") from None
  except OSError as e: raise DataError(f"{path}: can't read it: {e.strerror or e}") from None
  if not data: raise DataError(f"{path}: the file is empty")
  return data

def read_txt(path:str, data:bytes) -> np.ndarray: return np.frombuffer(data, np.uint8)

def read_text(path:str, data:bytes) -> str:
  try: return data.decode("utf-8")
  except UnicodeDecodeError as e:
    raise DataError(f"{path}: not UTF-8 text (byte {e.start} is {data[e.start]:#x}); a BPE reads text") from None

def read_bin(path:str, data:bytes) -> np.ndarray:
  if len(data) < BIN_HEADER:
    raise DataError(f"{path}: {len(data)} bytes, shorter than the {BIN_HEADER}-byte header of a .bin shard")
  magic, version, n = np.frombuffer(data, "<i4", 3).tolist()
  if magic != BIN_MAGIC: raise DataError(f"{path}: bad magic {magic} in the header, expected {BIN_MAGIC} "
                                         "(llm.c / modded-nanogpt .bin shard)")
  if version != 1: raise DataError(f"{path}: unsupported .bin version {version}, expected 1")
  if len(data) != BIN_HEADER + 2 * n:
    raise DataError(f"{path}: the header says {n} tokens but the file holds {(len(data) - BIN_HEADER) // 2}: "
                    "truncated or corrupt")
  return np.frombuffer(data, "<u2", offset=BIN_HEADER)

def read_npy(path:str, data:bytes) -> np.ndarray:
  try: ids = np.load(io.BytesIO(data), allow_pickle=False)
  except (ValueError, EOFError) as e: raise DataError(f"{path}: not a valid .npy file: {e}") from None
  if not isinstance(ids, np.ndarray): raise DataError(f"{path}: an .npz archive, expected one .npy array of token ids")
  if not np.issubdtype(ids.dtype, np.integer):
    raise DataError(f"{path}: holds {ids.dtype} values, token ids must be integers")
  if ids.size and ids.min() < 0: raise DataError(f"{path}: holds negative token ids (min {ids.min()})")
  return ids.ravel()

def write_bin(path:str, ids:np.ndarray):
  """ids as a .bin shard, atomically: written to a temp file, then renamed, so that a crash mid-write leaves no
  truncated file."""
  header = np.zeros(BIN_HEADER // 4, "<i4")
  header[:3] = BIN_MAGIC, 1, len(ids)
  with open(tmp := f"{path}.{os.getpid()}.tmp", "wb") as f: f.write(header.tobytes() + ids.astype("<u2").tobytes())
  os.replace(tmp, path)

def encoded(path:str, data:bytes, tok:BPE) -> np.ndarray:
  """The text's token ids, cached beside it as PATH.<text sha256>.<tokenizer sha256>.bin (16 hex digits of each): a
  changed text or tokenizer has another cache, so a stale one is never read."""
  cache = f"{path}.{hashlib.sha256(data).hexdigest()[:16]}.{tok.sha[:16]}.bin"
  if os.path.exists(cache): return read_bin(cache, read(cache))
  ids = tok.encode(read_text(path, data))
  try: write_bin(cache, ids)
  except OSError as e: print(f"data: can't write the token cache {cache} ({e.strerror}): "
                             "the text is tokenized at every run", file=sys.stderr)
  return ids

SKIP = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}
def stdlib() -> tuple[bytes, str]:
  """The .py files of this Python's standard library, its tests left out, in path order: a real corpus that needs no
  download (Python 3.11.7: 734 files, 12,118,641 bytes), and the name of the Python it came from."""
  root, files = sysconfig.get_paths()["stdlib"], []
  for d, dirs, names in os.walk(root):
    dirs[:] = sorted(x for x in dirs if x not in SKIP)
    files += [os.path.join(d, f) for f in sorted(names) if f.endswith(".py")]
  if not files: raise DataError(f"stdlib: no .py files under {root}: this Python has no standard library sources")
  return b"".join(pathlib.Path(f).read_bytes() for f in files), f"Python {sys.version.split()[0]}, {len(files)} files"

READERS = {".txt": read_txt, ".bin": read_bin, ".npy": read_npy}
TASKS = {"synthetic:parity": Parity, "synthetic:s5": S5}

def check_vocab(name:str, top:int, vocab:int):
  if top >= vocab:
    raise DataError(f"{name}: token ids go up to {top} but the model's vocab is {vocab}: use --vocab {top + 1}")

def load_tokens(path:str, vocab:int, seq_len:int, seed:int, tok:Bytes|BPE) -> Tokens:
  ext = os.path.splitext(path)[1]
  data = read(path)
  ids = encoded(path, data, tok) if isinstance(tok, BPE) else READERS[ext](path, data)
  if len(ids) // 10 < seq_len + 1:
    raise DataError(f"{path}: too short for one batch of seq_len {seq_len}: {len(ids)} tokens, "
                    f"need {10 * (seq_len + 1)} (the last 10% is val, and each split needs seq_len+1)")
  check_vocab(path, top := int(ids.max()), vocab)
  return Tokens(path, tok.vocab if ext == ".txt" else top + 1, ids, seed)

def digest(spec:str) -> str|None:
  """The sha256 of the content of a data source that reads one (a file, the standard library's sources); None for the
  synthetic ones, which the spec and the seed make."""
  if spec == "stdlib": content = stdlib()[0]
  elif os.path.splitext(spec)[1] in READERS: content = read(spec)
  else: return None
  return hashlib.sha256(content).hexdigest()

def load(spec:str, vocab:int, seq_len:int, seed:int=0, tok:Bytes|BPE=BYTES) -> Source:
  """The source of `spec`; a .txt file is read as token ids by `tok` (from tokenizer(): bytes by default)."""
  if isinstance(tok, BPE): needs_text(tok.spec, spec)
  if vocab < 2 or seq_len < 1:
    raise DataError(f"{spec}: needs vocab >= 2 and seq_len >= 1, got vocab {vocab} and seq_len {seq_len}")
  if spec == "synthetic": return Markov(vocab, seed)
  if spec in TASKS:
    check_vocab(spec, (src := TASKS[spec](seed)).vocab - 1, vocab)
    return src
  if spec == "stdlib":  # read as bytes: a BPE needs a .txt file (above)
    data, which = stdlib()
    check_vocab(spec, int((ids := np.frombuffer(data, np.uint8)).max()), vocab)
    return Tokens(f"stdlib ({which}, {len(data):,} bytes, sha256 {hashlib.sha256(data).hexdigest()})", 256, ids, seed)
  if os.path.splitext(spec)[1] in READERS: return load_tokens(spec, vocab, seq_len, seed, tok)
  raise DataError(f"unknown data spec {spec!r}: use {FORMS}")
