"""--sample: text from a checkpoint, drawn token by token on the host."""
from __future__ import annotations
import sys, time
import numpy as np
from tinygrad import Device, Tensor, dtypes
from data import BPE, Bytes
from rundir import UsageError
import engine, kernels

def last_logits(model, window:Tensor, last:Tensor) -> Tensor: return model.logits(window)[0, last]

def next_logits(model, ids:list[int]) -> np.ndarray:
  """The logits [V] that follow ids, at one shape, [1, context], so one TinyJit serves every step: the last `context`
  ids left-aligned in the window and padded with 0s, which the causal model does not see from the positions before
  them."""
  T = model.cfg.seq_len
  ctx = ids[-T:]  # the window slides once the text is longer than the context
  window = np.zeros((1, T), np.int32)
  window[0, :len(ctx)] = ctx
  return engine.jit(last_logits, model)(Tensor(window), Tensor([len(ctx) - 1], dtype=dtypes.int32)).numpy()[0]

def next_probs(logits:np.ndarray, temperature:float, top_k:int|None) -> np.ndarray:
  """softmax(logits / temperature) over the top_k largest logits (all of them for None), 0 elsewhere; in float64."""
  z = logits.astype(np.float64) / temperature
  # a tie goes to the later index: k stay
  if top_k is not None and top_k < len(z): z[np.argsort(z, kind="stable")[:-top_k]] = -np.inf
  p = np.exp(z - z.max())
  return p / p.sum()

def generate(model, ids:list[int], n:int, temperature:float, top_k:int|None, seed:int) -> list[int]:
  """ids and n tokens after them, each drawn from next_probs by NumPy on the host: the same seed gives the same text on
  every backend."""
  rng, ids = np.random.default_rng(seed), list(ids)
  for _ in range(n):
    p = next_probs(next_logits(model, ids), temperature, top_k)
    ids.append(int(rng.choice(len(p), p=p)))
  return ids

def prompt_ids(tok:Bytes|BPE, prompt:str, vocab:int) -> list[int]:
  if not prompt: raise UsageError("--prompt is empty: the model needs a token to start from")
  if bad := next((c for c in prompt if tok.encode(c).max() >= vocab), None):
    raise UsageError(f"--prompt: {bad!r} is token {tok.encode(bad).max()}, outside the model's vocab of {vocab}")
  return tok.encode(prompt).tolist()

def sample(model, tok:Bytes|BPE, args):
  """--sample N: N tokens after --prompt from the model (its checkpoint's weights), printed as text; the rate goes to
  stderr, so stdout is the text."""
  ids = prompt_ids(tok, args.prompt, model.cfg.vocab)
  print(kernels.path(Device.DEFAULT), file=sys.stderr)  # stdout is the text
  t0 = time.perf_counter()
  next_logits(model, ids)  # compiles and captures the JIT, which the rate leaves out
  t1 = time.perf_counter()
  ids = generate(model, ids, args.sample, args.temperature, args.top_k, args.seed)
  t2 = time.perf_counter()
  print(tok.decode(ids))
  print(f"{args.sample} tokens at {args.sample / (t2 - t1):,.1f} tokens/s "
        f"({t1 - t0:.1f} s to compile the forward first)", file=sys.stderr)
