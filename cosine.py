"""--cosine: how close each estimate is to the backprop gradient, per layer type."""
from __future__ import annotations
from dataclasses import replace
import numpy as np
from tinygrad import Device, Tensor
from data import BPE, Bytes, load
from estimators import at_step, carried, estimate, step_key, values
from registry import ESTIMATORS, Run
from rundir import load_checkpoint, lock
import kernels

LAYER_TYPES = (("mlp in", "mlp.c_fc"), ("mlp out", "mlp.c_proj"), ("attn out", "attn.c_proj"), ("q", "c_q"),
               ("k", "c_k"), ("v", "c_v"), ("gate", "ve_gate"), ("ve", "value_embeds"), ("wte", "wte"),
               ("head", "lm_head"), ("scalars", "lambdas"))
def layer_type(name:str) -> str: return next(t for t, pat in LAYER_TYPES if pat in name)

def cosines(g:dict[str, Tensor], ref:dict[str, Tensor]) -> dict[str, float]:
  """cos(g, ref) per layer type, over the concatenation of that type's tensors."""
  out = {}
  for t in dict.fromkeys(layer_type(n) for n in ref):
    names = [n for n in ref if layer_type(n) == t]
    a, b = (np.concatenate([d[n].float().numpy().ravel() for n in names]) for d in (g, ref))
    out[t] = float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b) + 1e-30))
  return out

def table(args, flag:str|None, model, tok:Bytes|BPE, job:Run):
  """--cosine: for each --pop, the cosine of the estimate to the backprop gradient per layer type, on the first training
  batch; at initialisation, or with --resume (`flag`) at the weights of the checkpoint in --out, where estimators differ
  more than at initialisation and two settings of one can be compared on the same trained weights. The run's model and
  data must be the flags' (--model, --vocab, --loops, --tokenizer, --data, --seed); the estimator's flags, --batch and
  --seq are free (zo.cosine_table checks the run's). `model` and `tok` are the flags', `job` the run as the estimator
  sees it."""
  where = "initialisation"
  if flag:
    lock(args.out)  # no training run writes the checkpoint while it is read
    where = f"the checkpoint of step {load_checkpoint(args.out, model, flag, keep='param.')[1]['step']} in {args.out}"
  entry = ESTIMATORS[args.method]
  for pop in args.pops:  # a run the estimator can't do stops before any work
    if entry.check: entry.check(replace(job, pop=pop))
  x, y = map(Tensor, load(args.data, model.cfg.vocab, args.seq, args.seed, tok).batch("train", 0, args.batch, args.seq))
  print(kernels.path(Device.DEFAULT))
  ref = estimate(model, x, y, "backprop", 1, 0)
  rows = {pop: cosines(estimate(model, x, y, args.method, pop, step_key(args.seed, 0),
                                **values(entry, replace(job, pop=pop)),
                                **at_step(entry, 0), **carried(entry, {})), ref) for pop in args.pops}
  types = list(next(iter(rows.values())))
  print(f"cosine of {args.method} to the backprop gradient, one batch of {args.batch}x{args.seq}, at {where}\n" +
        f"{'pop':>7} " + " ".join(f"{t:>8}" for t in types))
  for pop, r in rows.items(): print(f"{pop:>7} " + " ".join(f"{r[t]:>8.3f}" for t in types))
