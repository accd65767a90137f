#!/usr/bin/env python3
"""zo: train a network with forward passes only. The command line and the training loop, with its evaluation.

The estimators are in estimators.py (MeZO, ES) and dust.py (Dust), each declared with its flags and defaults
(registry.py), the optimizer in optim.py, the models in model.py; README has the math. The run folder (config.json,
checkpoints, the lock, --resume, --init) is rundir.py; the flags made from the registry and their checks flags.py;
--sample is sampling.py, --cosine cosine.py. How zo runs fast on tinygrad is in engine.py, and which kernels run where
in kernels/__init__.py.
"""
from __future__ import annotations
import argparse, math, os, signal, sys, time
import numpy as np
from tqdm import tqdm
from tinygrad import Device, Tensor, dtypes
from data import BPE
# estimators.py registers MeZO, ES, backprop and (dust.py) Dust; zoo.py, built on estimators.py, the zoo (as a plugin)
from estimators import Compact, Flat, at_step, carried, run, step_key, values
from optim import Optimizer, learning_rates
from registry import ESTIMATORS, MODELS, Run, lacks, size
from rundir import (IDENTITY, UsageError, append, check_memory, init_from, load_checkpoint, on_signals, prepare,
                    read_config, same_run, save, text_tokenizer)
import cosine, engine, flags, kernels, rundir, sampling, zoo  # noqa: F401
import model as models  # noqa: F401  model.py registers the presets as --model

# ***** training: evaluation, the loop *****

def mean_loss(model, x:Tensor, y:Tensor, **kw) -> Tensor: return model.losses(x, y, **kw).mean().realize()

def val_loss(model, data, args, batches:int=4) -> float:
  """The mean loss over the first validation batches, as a JIT, whose memory plan lives in the arena every JIT shares
  (engine.Scratch): an eager forward keeps every materialized activation until its schedule ends (the dust preset at
  8x2048 tokens: 5.3 GiB eagerly, 0.4 GiB in a JIT)."""
  kw = {"loops": args.eval_loops} if args.model == "looped" and args.eval_loops else {}
  jit = engine.jit(mean_loss, model, **kw)
  return float(np.mean([jit(*map(Tensor, data.batch("val", i, args.batch, args.seq))).item() for i in range(batches)]))

# half precision (float32 accumulation, float32 master weights) on accelerators; float32 on the CPU
def compute_dtype():
  return dtypes.float32 if Device.DEFAULT == "CPU" else dtypes.half

def make_model(args):
  """--model's model, made of the run's values it names and its options (registry.py); one that lacks what every
  estimator needs is refused in one line."""
  if args.model not in MODELS:  # a run's config.json names a model of a --plugin not given
    raise UsageError(f"--model {args.model}: no such model here ({', '.join(MODELS)}); a model of your own comes with "
                     "its --plugin")
  entry = MODELS[args.model]
  try:
    model = entry.make(vocab=args.vocab, seed=args.seed, dtype=compute_dtype(), loops=args.loops,
                       **{o: getattr(args, o, entry.default(o)) for o in entry.options})
  except AssertionError as e:  # a size the model can't take (GPT's head width must be even)
    raise UsageError(f"--model {args.model}: {e}") from None
  if what := lacks(model):
    raise UsageError(f"--model {args.model}: its {type(model).__name__} has no {what} (docs/model.md)")
  args.seq = args.seq or model.cfg.seq_len
  return model

def plan(args, model) -> Run:
  """The run as its estimator's defaults and checks see it."""
  steps = args.steps or max(1, args.tokens // (args.batch * args.seq))
  entry = ESTIMATORS[args.method]
  return Run(model, args.pop, args.optim, steps * args.batch * args.seq, steps, args.devices,
             {o: getattr(args, o) for o in entry.options})

def train(args):
  from data import digest, load
  # resumed, a run is the one its config.json records (rundir.IDENTITY), on its own tokenizer, whatever the text is now
  record = read_config(args.out, "--resume") if args.resume else None
  tok = text_tokenizer(args, "--resume", record["tokenizer_sha256"]) if record else text_tokenizer(args)
  model = make_model(args)
  args.data_sha256, args.tokenizer_sha256 = digest(args.data), tok.sha if isinstance(tok, BPE) else None
  if record: same_run("--resume", args, record, (*IDENTITY, *ESTIMATORS[args.method].options))
  if args.seq > model.cfg.seq_len:
    raise UsageError(f"--seq {args.seq} is longer than the model's context of {model.cfg.seq_len}")
  data = load(args.data, model.cfg.vocab, args.seq, args.seed, tok)
  entry, job = ESTIMATORS[args.method], plan(args, model)
  if entry.check: entry.check(job)  # a run the estimator can't do (sizes its kernels can't index included) stops here
  steps, d = job.steps, entry.defaults_for(job)
  opt = Optimizer(model.params, learning_rates(model.params, d, args.lr), args.optim,
                  d.momentum if args.momentum is None else args.momentum, args.replay)
  warmdown = d.warmdown if args.warmdown is None else args.warmdown
  config = {k: v for k, v in vars(args).items()
            if k not in ("resume", "force", "cosine", "sample", "prompt", "temperature", "top_k")}
  # a step's cost in network forwards, as its estimator declares (registry.py): the x-axis of compute-fair comparisons
  config["forwards_per_step"] = entry.forwards(job) if entry.forwards else None
  check_memory(args, entry, job)
  init_from(args, model)
  # what the estimator keeps from step to step (registry.py): its own at the first step, or --resume's
  state:dict[str, Tensor] = {}
  # the step to start at, the seconds its steps took before a --resume, and the best val so far (--patience)
  start, trained, best = prepare(args, config, steps, model, opt, state)
  if isinstance(tok, BPE) and not args.resume: tok.save(os.path.join(args.out, "tokenizer.json"))
  what = args.method if args.method == "backprop" else f"{args.method} pop {args.pop}"  # backprop has no population
  path = kernels.path(Device.DEFAULT)
  print(path)  # which kernels run here
  print(f"{what} on {type(model).__name__} ({size(model):,} params), {data.name}, {steps} steps of "
        f"{args.batch}x{args.seq} tokens" +
        (f"; the loss floor of this data is {data.floor:.3f}" if data.floor is not None else ""))
  # Ctrl-C (SIGINT) or a scheduler's SIGTERM: the step in flight finishes and saves; a second one quits at once
  stop:list[int] = []
  def kept() -> str: return rundir.kept(os.path.join(args.out, "model.safetensors"))  # what a stopped run keeps
  def patient() -> str|None:  # --patience N: N evaluations in a row without a new best val stop the run
    return (f"--patience {args.patience}: {best.since} evaluations without a val loss below {best.val:.4f} (step "
            f"{best.step}): stopped after step {step}") if args.patience and best.since >= args.patience else None
  step = start - 1
  if patient():  # a run its patience stopped stays stopped
    print(patient())
    return
  # a resumed run's seconds go on from its parts' sum (its compiling counted again)
  val, t0 = None, time.perf_counter() - trained
  print("the first step and the first evaluation compile their kernels (tinygrad caches them for the next run)")
  opts = values(entry, job)
  def estimate(x:Tensor, y:Tensor, step:int, state:dict[str, Tensor]=state):
    return run(model, x, y, args.method, args.pop, step_key(args.seed, step), **opts, **at_step(entry, step),
               **carried(entry, state))
  # the work a step does, for the cache of which kernels it compiled (engine.compile_ahead)
  work = repr((args.method, args.pop, opts, model.cfg, args.batch, args.seq, path))
  with on_signals(stop, kept), open(os.path.join(args.out, "metrics.jsonl"), "ab", buffering=0) as log, \
       tqdm(initial=start, total=steps, dynamic_ncols=True, desc="compiling") as bar:
    for step in range(start, steps):
      x, y = map(Tensor, data.batch("train", step, args.batch, args.seq))
      ts = time.perf_counter()
      # all of the step's kernels at once, then the step. The dry run's JITs are traced, not run: what they would write
      # into the state is never written, and a pending write left on a tensor runs at the next capture, so the dry run
      # gets a copy of the state
      if step == start:
        engine.compile_ahead(lambda: estimate(x, y, step, {k: t.clone() for k, t in state.items()}), work)
      g, loss = estimate(x, y, step)
      opt.scale = min(1.0, (steps - step) / (warmdown * steps)) if warmdown else 1.0
      # queued before the check's read, which waits for it: a bad step stops the run before anything saves its weights
      opt.step(g)
      loss = checked(model, loss, g, step, kept())
      dt = time.perf_counter() - ts
      rec = {"step": step, "tokens": (step + 1) * args.batch * args.seq, "train_loss": loss,
             "seconds": round(time.perf_counter() - t0, 3)}
      if step % args.eval_every == 0 or step == steps - 1:
        bar.set_description_str("evaluating")
        rec["val_loss"] = val = val_loss(model, data, args)
        if not math.isfinite(val): raise UsageError(f"step {step}: the validation loss is {val}: diverged; {kept()}")
        if best.seen(step, val) and args.keep_best: rundir.keep_best(args.out, model, best)
      bar.set_description_str("")
      append(log, rec, kept())
      bar.set_postfix(loss=f"{loss:.3f}", val=f"{val:.3f}" if val is not None else "-",
                      tok_s=f"{args.batch * args.seq / dt:,.0f}",
                      **({"draws_s": f"{args.pop / dt:,.0f}"} if entry.keyed else {}))  # backprop draws nothing
      bar.update()  # counted when the step is done (iterating the bar would count it when the next one begins)
      if step == start: engine.freeze_compiled()  # what compiling left, out of the garbage collector's walks
      if (step + 1) % args.ckpt_every == 0 or step == steps - 1 or stop or patient():
        save(args.out, model, opt, step + 1, state, best)
      if patient():
        bar.write(patient())
        return
      if stop:
        bar.write(f"{signal.Signals(stop[0]).name}: interrupted after {step + 1} steps: checkpoint saved in "
                  f"{args.out}; continue with --resume",
                  file=sys.stderr)  # a line of its own, not one the bar redraws over
        sys.exit(128 + stop[0])  # the shell's code for a process ended by that signal: 130 for SIGINT, 143 for SIGTERM

def squares(loss:Tensor, named:dict[str, Tensor]) -> Tensor:
  return Tensor.cat(loss.float().reshape(1), engine.squares(list(named.values()))).contiguous()

def checked(model, loss:Tensor, g:Compact|Flat|dict[str, Tensor], step:int, kept:str) -> float:
  """The step's loss, once it and the estimate are seen to be finite (else the run stops, saying what is `kept`): one
  JIT and one read from the device (built
  eagerly at every step, the sums' graph took longer than a small model's whole step); backprop's JIT makes the sums
  with its gradient. A Flat is summed whole (one sum a parameter was 42 kernels at the small preset), and only a
  non-finite one is searched for the parameter."""
  if isinstance(g, Flat):
    named, vals = {"the gradient": g.buf}, engine.read(g.sums)
  else:
    named = {"coefficients": g.coef} if isinstance(g, Compact) else g
    vals = engine.read(engine.jit(squares)(loss, named))
  if not math.isfinite(vals[0]):
    raise UsageError(f"step {step}: the training loss is {vals[0]}: diverged; {kept}")
  if bad := [n for n, v in zip(named, vals[1:]) if not math.isfinite(v)]:
    if isinstance(g, Flat): bad = [n for n, t in g.dense(model.params).items() if not t.isfinite().all().item()] or bad
    raise UsageError(f"step {step}: the estimate of {bad[0]} is not finite: diverged; {kept}")
  return float(vals[0])

# ***** --cosine and --sample *****

def cosine_table(args):  # --cosine (cosine.py)
  from data import digest
  flag = "--cosine --resume" if args.resume else None
  record = read_config(args.out, flag) if flag else None
  tok = text_tokenizer(args, flag, record and record["tokenizer_sha256"])
  model = make_model(args)
  if record:
    args.data_sha256 = digest(args.data)
    same_run(flag, args, record, ("model", "vocab", "loops", "tokenizer", "data", "seed"))
  cosine.table(args, flag, model, tok, plan(args, model))

def sample(args):
  """--sample N: N tokens after --prompt from the checkpoint in --out, printed as text (sampling.py)."""
  record = argparse.Namespace(**read_config(args.out, "--sample") | {"out": args.out})
  tok = text_tokenizer(record, "--sample", record.tokenizer_sha256)
  model = make_model(record)
  load_checkpoint(args.out, model, "--sample", keep="param.", name=rundir.BEST if args.best else "model.safetensors")
  sampling.sample(model, tok, args)

# ***** the command line *****

def parse(argv:list[str]|None=None) -> argparse.Namespace:
  flags.plugins(argv)
  p = argparse.ArgumentParser(description="Train a GPT with forward passes only (zeroth-order estimators).",
                              formatter_class=flags.DefaultOnce)
  p.add_argument("--method", default="dust", choices=tuple(ESTIMATORS),
                 help="gradient estimator (estimators.py); backprop is the reference baseline")
  p.add_argument("--pop", type=int, nargs="+", default=[1024], help="population: the draws of a step (the method's "
                 "directions, members or recipe's population; backprop draws none); several values only with --cosine "
                 "(default: 1024)")
  p.add_argument("--model", default=None, choices=tuple(MODELS), help="default: tiny on the CPU, small on a GPU; "
                 "a model of your own comes with its --plugin (docs/model.md)")
  p.add_argument("--vocab", type=int, default=None, help="override the preset's vocabulary size (default: the "
                 "preset's; on the CPU with --data synthetic, 32)")
  p.add_argument("--loops", type=int, default=None, help="loop count of the looped model (training depth)")
  p.add_argument("--eval-loops", type=int, default=None, help="loop count for evaluation (default: --loops)")
  p.add_argument("--data", default="synthetic", help="synthetic | synthetic:parity | synthetic:s5 | stdlib (this "
                 "Python's standard library sources, as bytes) | FILE.txt | FILE.bin | FILE.npy")
  p.add_argument("--tokenizer", default="bytes", help="for a .txt file: bytes (vocab 256), or bpe:N, a byte-level BPE "
                 "of N tokens trained on the text's training split (saved as OUT/tokenizer.json; the tokens are cached "
                 "beside the text)")
  p.add_argument("--steps", type=int, default=None, help="optimizer steps (default: from --tokens)")
  p.add_argument("--tokens", type=int, default=None, help="training budget in tokens, when --steps is not given "
                 "(default: 500,000 on a GPU, 20,000 on the CPU)")
  p.add_argument("--batch", type=int, default=8, help="sequences per batch")
  p.add_argument("--seq", type=int, default=None,
                 help="training sequence length, at most the model's context (default: the context)")
  p.add_argument("--lr", type=float, default=None, help="base learning rate (default: the method's recipe)")
  p.add_argument("--optim", default="sgd", choices=("sgd", "adamw"), help="the optimizer")
  p.add_argument("--momentum", type=float, default=None, help="SGD momentum or AdamW beta1 (default: the recipe's)")
  p.add_argument("--warmdown", type=float, default=None, help="fraction of the steps at the end over which the lr "
                 "falls linearly to 0 (default: the method's)")
  p.add_argument("--replay", type=int, default=0, help="mezo/es under SGD: 0 keeps a momentum buffer; W > 0 keeps no "
                 "buffer but the last W steps' seeds, and replays the momentum from them (default: 0)")
  p.add_argument("--seed", type=int, default=0, help="the seed of the weights, the data and the noise")
  p.add_argument("--eval-every", type=int, default=10, help="steps between validation losses")
  p.add_argument("--ckpt-every", type=int, default=50, help="steps between checkpoints")
  p.add_argument("--out", default="runs/zo", help="output directory: config.json, metrics.jsonl, model.safetensors")
  p.add_argument("--init", default=None, metavar="RUN", help="start from the weights of the run in folder RUN (its "
                 "model flags must be this run's), with a fresh optimizer at step 0, on any --data")
  p.add_argument("--resume", action="store_true", help="continue the run in --out from its checkpoint, exactly: its "
                 "flags must be the run's, but for " + ", ".join(f"--{f}".replace("_", "-") for f in rundir.FREE) +
                 " (--steps at least the run's step; without --steps or --tokens, the run's); with --cosine: measure "
                 "at its weights")
  p.add_argument("--force", action="store_true", help="overwrite a run already in --out")
  p.add_argument("--patience", type=int, default=None, metavar="N", help="stop (exit 0) once N evaluations in a row "
                 "bring no new best val loss (default: never)")
  p.add_argument("--keep-best", action="store_true", help="keep the weights of the best val loss so far beside the "
                 "checkpoint, in OUT/best.safetensors (its step and val in its metadata)")
  p.add_argument("--best", action="store_true", help="--sample, --init RUN: the run's kept best weights "
                 "(best.safetensors, --keep-best), not its last checkpoint")
  p.add_argument("--cosine", action="store_true", help="print the per-layer-type cosine of the estimate to backprop "
                 "for each --pop, at initialisation or (with --resume) at the checkpoint in --out, then exit")
  p.add_argument("--devices", type=int, default=1, help="devices of the default backend to split the population over")
  p.add_argument("--sample", type=int, default=None, metavar="N",
                 help="print N tokens sampled from the checkpoint in --out, then exit")
  p.add_argument("--prompt", default="\n", help="--sample: the text to continue (default: %(default)r)")
  p.add_argument("--temperature", type=float, default=1.0, help="--sample: divides the logits before the softmax")
  p.add_argument("--top-k", type=int, default=None,
                 help="--sample: draw from the k likeliest tokens only (default: from all)")
  p.add_argument("--plugin", action="append", default=[], metavar="FILE.py|MODULE", help="a file or module of your "
                 "own estimators or models, imported before the flags are read, so that its methods, models and their "
                 "flags are there (docs/estimator.md, docs/model.md)")
  flags.option_flags(p)
  args = p.parse_args(argv)
  args.pops, args.pop = args.pop, args.pop[0]
  return flags.allowed(p, args)

def device_defaults(args, device:str):
  """The default run of each kind of device (README): on a GPU the small model and 500,000 tokens; on the CPU the tiny
  model on a synthetic chain of 32 states (a 256-token vocab's head is the step's largest cost there) for 20,000 tokens,
  so that the run takes minutes (docs/performance.md: "The CPU's step: sums of exps written out")."""
  cpu = device == "CPU"
  args.model = args.model or ("tiny" if cpu else "small")
  if args.tokens is None and not args.resume: args.tokens = 20_000 if cpu else 500_000  # a resumed run has its own
  if cpu and args.data == "synthetic" and args.vocab is None: args.vocab = 32

def main(argv:list[str]|None=None):
  from data import DataError
  args = parse(argv)
  try:
    device_defaults(args, flags.default_device())
    flags.check_devices(args)
    sample(args) if args.sample else cosine_table(args) if args.cosine else train(args)
  except (UsageError, DataError, ValueError) as e:
    print(f"zo: error: {e}", file=sys.stderr)
    sys.exit(2)
  except KeyboardInterrupt:  # Ctrl-C before training started: nothing to save
    sys.exit(130)

if __name__ == "__main__": main()
