"""The command line's machinery: a flag for every estimator's option (registry.py) and the --plugin files that add
methods, --help's defaults, and the checks of the flags, each refusal one line: numbers out of range, flags that would
do nothing in the run, DEV and --devices."""
from __future__ import annotations
import argparse, importlib, importlib.util, math, os, typing
from typing import Any, Callable
from tinygrad import Device
from devices import names
from estimators import Compact
from registry import ESTIMATORS, MODELS, Declared, Entry
from rundir import UsageError, typed
import engine

def allowed(p:argparse.ArgumentParser, args:argparse.Namespace) -> argparse.Namespace:
  """args, once every flag is seen to be allowed: the numbers in range, the method's options (its defaults where not
  given, and no other method's), and no flag that would do nothing."""
  for flag, value, ok, need in checks(args):
    # one line
    if value is not None and not ok(value): p.exit(2, f"zo: error: --{typed(flag)} {value}: must be {need}\n")
  if len(args.pops) > 1 and not args.cosine: p.error("several --pop values only make sense with --cosine")
  for flag, given, why in idle(chosen_options(p, args), p):
    if not given: continue
    v = getattr(args, "pops" if flag == "pop" else flag)
    shown = " ".join(map(str, v)) if isinstance(v, list) else "" if v is True else repr(v) if isinstance(v, str) else v
    p.exit(2, f"zo: error: --{typed(flag)} {shown}".rstrip() + f": {why}\n")
  return args

class DefaultOnce(argparse.HelpFormatter):
  """--help with each flag's default once: argparse's, where the help doesn't say it and there is one to say."""
  def _get_help_string(self, action:argparse.Action) -> str:
    if "default:" in action.help or action.default in (None, False, [], argparse.SUPPRESS): return action.help
    return f"{action.help} (default: %(default)s)"

def idle(args:argparse.Namespace, p:argparse.ArgumentParser) -> list[tuple[str, bool, str]]:
  """The flags that would do nothing in this run, each (flag, whether it is given, why it does nothing)."""
  entry = ESTIMATORS[args.method]
  loopless = not args.model or "loops" not in MODELS[args.model].takes  # no --model: a GPT preset
  which = f"--model {args.model}" if args.model else "the default model, a GPT,"
  return [*[(f, loopless and getattr(args, f) is not None, f"{which} has no loops (--model looped has)")
            for f in ("loops", "eval_loops")],
          ("pop", not entry.keyed and args.pops != p.get_default("pop"),
           f"--method {args.method} draws nothing: its step is one gradient"),
          ("replay", args.replay > 0 and args.optim != "sgd", "only SGD's momentum is replayed, not AdamW's moments"),
          ("replay", args.replay > 0 and not replayable(entry),
           f"an estimate of --method {args.method} is not a list of seeds to replay: keep its momentum (--replay 0)"),
          ("force", args.force and args.resume, "--resume overwrites nothing"),
          ("best", args.best and not (args.sample or args.init), "only --sample and --init read the kept best weights"),
          *[(f, not args.sample and getattr(args, f) != p.get_default(f), "only --sample uses it")
            for f in ("prompt", "temperature", "top_k")]]

def replayable(entry:Entry) -> bool:
  """Whether the method's estimate is a Compact (a key and a coefficient a direction), whose momentum --replay rebuilds
  from its seeds: as its function's return annotation says; where it says nothing, the optimizer tells at the first
  step."""
  try: kind = typing.get_args(typing.get_type_hints(entry.fn).get("return"))[:1]
  except NameError: return True
  return kind in ((), (Compact,))

DECLARED = {"method": ESTIMATORS, "model": MODELS}  # what declares options, by the flag that chooses it

def option_flags(p:argparse.ArgumentParser):
  """A flag for every option of every estimator and every model, in a group per method, and per model that has options
  (--help). An option that several methods (or several models) declare is one flag, in the first one's group; a model's
  options are its own. No default here: the method's (the model's) own fills in a flag not given, and a given flag it
  doesn't take is refused (chosen_options)."""
  declared:dict[str, list[tuple[str, Declared]]] = {}
  groups = {}
  for kind, entries in DECLARED.items():
    for name, e in entries.items():
      for o in e.options: declared.setdefault(o, []).append((kind, e))
      if kind == "method" or e.options:
        doc = " ".join((e.fn.__doc__ or "").split()).split(". ")[0].rstrip(".")  # the docstring's first sentence
        takes = ", ".join(f"--{typed(o)}" for o in e.options) or "no options"
        groups[kind, name] = p.add_argument_group(f"--{kind} {name}", f"{doc}. Takes {takes}.")
  for o, es in declared.items():
    (kind, first), opt = es[0], es[0][1].options[o]
    if len({k for k, _ in es}) > 1:  # by a method and a model
      p.error(f"--{typed(o)} is declared by {' and '.join(f'--{k} {e.name}' for k, e in es)}: a model's options are "
              "its own, so name it otherwise")
    helps = [f"{e.name}: {e.options[o].help} (default: {e.default(o)})" for _, e in es]
    try:
      groups[kind, first.name].add_argument(f"--{typed(o)}", dest=o, type=type(first.default(o)), choices=opt.choices,
                                            default=argparse.SUPPRESS, help="; ".join(helps))
    except argparse.ArgumentError:
      p.error(f"--{kind} {first.name} declares the option --{typed(o)}, a flag of zo's own: name it otherwise")

def chosen_options(p:argparse.ArgumentParser, args:argparse.Namespace) -> argparse.Namespace:
  """args with the options of the method and of the model (given, or their defaults) and no other's; a flag the method
  or the model doesn't take is refused in one line, with what it takes. No --model: the device's preset, which takes
  none."""
  for kind, entries in DECLARED.items():
    name = getattr(args, kind)
    options = entries[name].options if name else {}
    declared = {o for e in entries.values() for o in e.options}
    for o in sorted(declared & vars(args).keys() - options.keys()):
      takes = ", ".join(f"--{typed(t)}" for t in options) or "no options"
      which = f"--{kind} {name}" if name else f"the default {kind}"
      p.exit(2, f"zo: error: --{typed(o)} {getattr(args, o)}: {which} does not take --{typed(o)} (it takes {takes})\n")
    for o, opt in options.items():
      if o not in args: setattr(args, o, entries[name].default(o))
      elif opt.check and not opt.check[0](getattr(args, o)):
        p.exit(2, f"zo: error: --{typed(o)} {getattr(args, o)}: must be {opt.check[1]}\n")
  return args

def plugins(argv:list[str]|None) -> None:
  """Import each --plugin before the parser is made: its @estimator and @model declarations add methods, models and
  flags."""
  pre = argparse.ArgumentParser(add_help=False)
  pre.add_argument("--plugin", action="append", default=[])
  for spec in pre.parse_known_args(argv)[0].plugin:
    if spec.endswith(".py"):
      if not os.path.isfile(spec): pre.exit(2, f"zo: error: --plugin {spec}: no such file\n")
      found = importlib.util.spec_from_file_location(os.path.splitext(os.path.basename(spec))[0], spec)
      found.loader.exec_module(importlib.util.module_from_spec(found))
    else:
      try: importlib.import_module(spec)
      except ModuleNotFoundError as e: pre.exit(2, f"zo: error: --plugin {spec}: {e}\n")

def checks(args:argparse.Namespace) -> list[tuple[str, Any, Callable[[Any], bool], str]]:
  """Every numeric flag of the run, its value (None: not given) and what it must be; the estimators' own are checked by
  their Options."""
  counts = [(f, getattr(args, f), lambda v: v >= 1, "at least 1")
            for f in ("batch", "eval_every", "ckpt_every", "steps", "tokens", "seq", "loops", "eval_loops", "devices",
                      "sample", "top_k", "patience")]
  return [("pop", min(args.pops), lambda v: v >= 1, "at least 1"), *counts,
          ("vocab", args.vocab, lambda v: v >= 2, "at least 2"),
          ("replay", args.replay, lambda v: v >= 0, "0 (a momentum buffer) or a number of steps"),
          *[(f, getattr(args, f), lambda v: math.isfinite(v) and v > 0, "positive and finite")
            for f in ("lr", "temperature")],
          ("momentum", args.momentum, lambda v: 0 <= v < 1, "in [0, 1)"),
          ("warmdown", args.warmdown, lambda v: 0 <= v <= 1, "in [0, 1]")]

def default_device() -> str:
  """The device tinygrad picks, opened: DEV names one (DEV=CUDA), or tinygrad tries each of its backends."""
  try: device = Device.DEFAULT
  except Exception: raise UsageError("tinygrad found no usable device: install clang for the CPU backend "
                                     "(apt-get install clang), or run on a GPU with DEV=CUDA / DEV=AMD / "
                                     "DEV=METAL") from None
  try: Device[device]
  except Exception as e:
    raise UsageError(f"DEV={os.environ.get('DEV', device)}: tinygrad cannot open device {device} "
                     f"({type(e).__name__}: {e}); its backends are {', '.join(engine.backends())}") from None
  return device

def check_devices(args:argparse.Namespace):
  """--devices N: N devices of the default backend (DEV, DEV:1, ...), for a method that names `devices` (its check says
  how many its population can use)."""
  n = args.devices
  if n == 1: return
  if "devices" not in ESTIMATORS[args.method].takes:
    raise UsageError(f"--devices {n}: {args.method} runs on one device")
  for d in names(Device.DEFAULT, n):
    try: Device[d]
    except Exception as e: raise UsageError(f"--devices {n}: {d} does not open ({type(e).__name__}: {e})") from None
