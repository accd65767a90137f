"""The command line's machinery: a flag for every estimator's option (registry.py) and the --plugin files that add
methods, --help's defaults, and the checks of the flags, each refusal one line: numbers out of range, flags that would
do nothing in the run, DEV and --devices."""
from __future__ import annotations
import argparse, importlib, importlib.util, math, os, typing
from typing import Any, Callable
from tinygrad import Device
from devices import names
from estimators import Compact
from registry import ESTIMATORS, Entry
from rundir import UsageError, typed
import engine

def allowed(p:argparse.ArgumentParser, args:argparse.Namespace) -> argparse.Namespace:
  """args, once every flag is seen to be allowed: the numbers in range, the method's options (its defaults where not
  given, and no other method's), and no flag that would do nothing."""
  for flag, value, ok, need in checks(args):
    # one line
    if value is not None and not ok(value): p.exit(2, f"zo: error: --{typed(flag)} {value}: must be {need}\n")
  if len(args.pops) > 1 and not args.cosine: p.error("several --pop values only make sense with --cosine")
  for flag, given, why in idle(method_options(p, args), p):
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
  entry, gpt = ESTIMATORS[args.method], args.model != "looped"
  return [*[(f, gpt and getattr(args, f) is not None, "a GPT has no loops (--model looped has)")
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

def option_flags(p:argparse.ArgumentParser):
  """A flag for every option of every estimator, in a group per method (--help). An option that several methods declare
  is one flag, in the first one's group. No default here: the method's own fills in a flag not given, and a given flag
  the method doesn't take is refused (method_options)."""
  declared:dict[str, list[Entry]] = {}
  for e in ESTIMATORS.values():
    for o in e.options: declared.setdefault(o, []).append(e)
  groups = {}
  for name, e in ESTIMATORS.items():
    doc = " ".join((e.fn.__doc__ or "").split()).split(". ")[0].rstrip(".")  # the docstring's first sentence
    takes = ", ".join(f"--{typed(o)}" for o in e.options) or "no options"
    groups[name] = p.add_argument_group(f"--method {name}", f"{doc}. Takes {takes}.")
  for o, es in declared.items():
    first, opt = es[0], es[0].options[o]
    helps = [f"{e.name}: {e.options[o].help} (default: {e.default(o)})" for e in es]
    groups[first.name].add_argument(f"--{typed(o)}", dest=o, type=type(first.default(o)), choices=opt.choices,
                                    default=argparse.SUPPRESS,
                                    help="; ".join(helps))

def method_options(p:argparse.ArgumentParser, args:argparse.Namespace) -> argparse.Namespace:
  """args with the method's options (given, or the method's defaults) and no other method's; a flag the method doesn't
  take is refused in one line, with what it takes."""
  entry = ESTIMATORS[args.method]
  declared = {o for e in ESTIMATORS.values() for o in e.options}
  for o in sorted(declared & vars(args).keys() - entry.options.keys()):
    takes = ", ".join(f"--{typed(t)}" for t in entry.options) or "no options"
    p.exit(2, f"zo: error: --{typed(o)} {getattr(args, o)}: --method {args.method} does not take --{typed(o)} "
           f"(it takes {takes})\n")
  for o, opt in entry.options.items():
    if o not in args: setattr(args, o, entry.default(o))
    elif opt.check and not opt.check[0](getattr(args, o)):
      p.exit(2, f"zo: error: --{typed(o)} {getattr(args, o)}: must be {opt.check[1]}\n")
  return args

def plugins(argv:list[str]|None) -> None:
  """Import each --plugin before the parser is made: its @estimator declarations add methods and flags."""
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
