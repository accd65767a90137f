"""Lazy tensors that share a step's graph. tinygrad hash-conses UOps, so a user's lazy forward (or its autograd gradient) on the same
batch and weights is made of the very UOps that a step's JITs realize, and realizing rewrites every live tensor that contains them
to read the new buffers. Buffers that a JIT owns are written again by its next replay and freed by `Function.release` (engine.py), so a lazy tensor
built before a step and realized after it must not have been pointed at them: it must equal the same tensor realized before.

Each case builds the loss and its gradient lazily twice (once before the first call, which captures the JITs, once between it and a
second call on another batch, which replays them), realizes both after the second call, and compares them with the same tensors
realized first: nothing a step does may touch those graphs, so they run the same kernels on the same inputs and must give the same
bits. Half precision on the CPU, as on a GPU, where the weights' half copies are nodes that every forward shares whatever batch it
reads (`zo.val_loss` reads batches of its own). On today's CPU path Dust and backprop broke this (the gradient garbage, or the
second batch's), mezo, es and val_loss did not.

A pending assign, on the other hand, is the user's write: a JIT that captured it would do it again at every replay."""
import argparse
import numpy as np
import pytest
from tinygrad import Context, Tensor, dtypes
from model import GPT, GPTConfig, Looped, LoopedConfig
import data
import estimators, zo

B, T, V = 2, 16, 64
POP = {"mezo": 2, "es": 4, "dust": 64, "backprop": 1}

@pytest.fixture(scope="module", autouse=True)
def fast_compile():
  with Context(NOOPT=1): yield

def make(net:str):
  if net == "gpt": return GPT(GPTConfig(vocab=V, seq_len=T, n_layer=1, n_head=2, n_embd=16), seed=0, dtype=dtypes.half)
  return Looped(LoopedConfig(vocab=V, seq_len=T, n_head=2, n_embd=16, loops=2), seed=0, dtype=dtypes.half)

def lazy(model, x:Tensor, y:Tensor) -> list[Tensor]:
  """The mean loss, its per-token losses and its gradient, none realized."""
  losses = model.losses(x, y)
  mean = losses.float().mean()
  return [mean, losses, *mean.gradient(*model.params.values())]

@pytest.mark.parametrize("net", ["gpt", "looped"])
@pytest.mark.parametrize("method", ["mezo", "es", "dust", "backprop", "val_loss"])
def test_lazy_tensors_survive_a_step(method:str, net:str):
  # a JIT that left a live tensor reading its buffers (rewritten at capture, then freed by release or overwritten by a replay) fails this
  model, src = make(net), data.load("synthetic", V, T, 0)
  args = argparse.Namespace(model=net, eval_loops=None, batch=B, seq=T)
  x, y = map(Tensor, src.batch("val", 0, B, T))  # val_loss's first batch: a forward of its own reads the same values
  x2, y2 = map(Tensor, src.batch("train", 1, B, T))
  def call(x:Tensor, y:Tensor):
    if method == "val_loss": zo.val_loss(model, src, args)
    else: estimators.estimate(model, x, y, method, POP[method], 7, **({"rank": 1} if method == "es" else {}))
  ref = [t.numpy() for t in lazy(model, x, y)]
  before = lazy(model, x, y)
  call(x, y)                    # captures every JIT of the step
  between = lazy(model, x, y)
  call(x2, y2)                  # replays them on another batch
  for when, ts in (("before", before), ("between", between)):
    for i, (t, r) in enumerate(zip(ts, ref)):
      np.testing.assert_array_equal(t.numpy(), r, err_msg=f"{method} on {net}: tensor {i} built {when} the calls")

@pytest.mark.parametrize("method", ["mezo", "es", "val_loss"])  # the JITs that read the weights without taking them as inputs
def test_pending_assign_is_done_once(method:str):
  # a capture that recorded the write (the weight then grew by 1 at every forward: 12 after three val_loss calls) fails this
  model, src = make("gpt"), data.load("synthetic", V, T, 0)
  args = argparse.Namespace(model="gpt", eval_loops=None, batch=B, seq=T)
  x, y = map(Tensor, src.batch("train", 0, B, T))
  w = model.params["lm_head.weight"]
  w0 = w.numpy()
  w.assign(w + 1)
  for _ in range(2):
    if method == "val_loss": zo.val_loss(model, src, args)
    else: estimators.estimate(model, x, y, method, POP[method], 7)
  np.testing.assert_array_equal(w.numpy(), w0 + 1)
