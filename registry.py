"""The estimator contract: everything the command line, the training loop and the optimizer know of an estimator is what
it declares here, where it is defined.

  @estimator("mezo", eps=Option("the perturbation scale ε", check=POSITIVE))
  def mezo(model, x:Tensor, y:Tensor, pop:int, key:Tensor, eps:float=1e-3) -> tuple[Compact, Tensor]: ...

An estimator is a function (model, x, y, pop, key, ...) -> (estimate, mean loss). Each keyword argument it declares as
an Option becomes a flag (--eps) with the signature's default, the Option's help, choices and check; a flag the method
doesn't take is refused. Besides its options, it may name any of the run's values, which the loop passes by name:

  step       this step's number, a float32 scalar tensor: a schedule computed from it runs in the kernels, so a new step
             compiles nothing
  steps      the run's number of steps (an int)
  tokens     the run's training tokens (an int)
  optimizer  "sgd" or "adamw"
  devices    how many devices to split the population over (a method that doesn't name it runs on one)
  state      a dict[str, Tensor] the loop keeps for the run, empty at the first step, which the estimator fills and
             updates in place (a momentum, a curvature estimate): the checkpoint saves each entry and --resume
             restores it

It also declares what it asks of the optimizer when the command line doesn't say (`defaults`: a Defaults per optimizer,
or a function of the Run that gives one), `check(run)`, which raises ValueError for a run it can't do, before
anything is written, `forwards(run)`, the network forwards a step's arithmetic needs (what tests/bench.py and the
fine-tuning race count a step's cost in), and `memory(run)`, the bytes of activations and draws a step holds at once
(what the command line's memory check adds to the parameters; `activations` counts a forward's).
"""
from __future__ import annotations
import functools, inspect, math
from dataclasses import dataclass, field
from typing import Any, Callable

RUN_VALUES = ("step", "steps", "tokens", "optimizer", "devices", "state")

@dataclass(frozen=True)
class Option:
  """A flag of an estimator; its name and default are the keyword argument's."""
  help:str
  choices:tuple[str, ...]|None = None
  check:tuple[Callable[[Any], bool], str]|None = None  # (whether a value is allowed, what the value must be)

POSITIVE = (lambda v: math.isfinite(v) and v > 0, "positive and finite")
NONNEGATIVE = (lambda v: v >= 0, "0 or more")

@dataclass(frozen=True)
class Defaults:
  """What an estimator asks of the optimizer where the command line doesn't say."""
  lr:float                # the base learning rate
  momentum:float          # SGD's momentum, or AdamW's beta1
  groups:dict[str, float] = field(default_factory=dict)  # parameter-name prefix -> its lr as a multiple of the base lr
  warmdown:float = 0.0    # the fraction of the steps at the end over which the lr falls linearly to 0

  def lr_of(self, name:str, base:float) -> float:
    return base * next((m for p, m in self.groups.items() if name.startswith(p)), 1.0)

# Under AdamW, whose step is about lr in every coordinate, the embeddings (whose rows are read once a token) and the
# residual-mix scalars (one number a block) take larger steps than the matrices.
ADAMW_GROUPS = {"transformer.wte": 300.0, "value_embeds": 300.0, "resid_lambdas": 100.0, "x0_lambdas": 100.0}
STANDARD = {"sgd": Defaults(lr=2e-3, momentum=0.9), "adamw": Defaults(lr=2e-3, momentum=0.8, groups=ADAMW_GROUPS)}

@dataclass(frozen=True)
class Run:
  """What an estimator's defaults and checks may ask of the run."""
  model:Any
  pop:int
  optimizer:str
  tokens:int
  steps:int
  devices:int
  options:dict[str, Any]  # the method's options, as the run gives them

@dataclass(frozen=True)
class Entry:
  name:str
  fn:Callable
  options:dict[str, Option]
  defaults:dict[str, Defaults]|Callable[[Run], Defaults]
  check:Callable[[Run], None]|None
  keyed:bool  # False: fn draws no noise, and gets no key
  forwards:Callable[[Run], float]|None  # the forwards a step's arithmetic needs; None: not declared
  memory:Callable[[Run], float|None]|None  # the bytes a step holds at once beside the parameters; None: one forward's

  @functools.cached_property  # read at every step, by the loop
  def takes(self) -> set[str]: return set(inspect.signature(self.fn).parameters)  # the names the function takes
  def default(self, option:str) -> Any: return inspect.signature(self.fn).parameters[option].default
  def defaults_for(self, run:Run) -> Defaults:
    return self.defaults(run) if callable(self.defaults) else self.defaults[run.optimizer]
  def run(self, model, pop:int, optimizer:str="sgd", tokens:int=10**6, steps:int=1, devices:int=1, **options) -> Run:
    """A Run of this method with its default options but those given: for callers other than the command line (tests,
    benchmarks)."""
    return Run(model, pop, optimizer, tokens, steps, devices,
               {o: options.get(o, self.default(o)) for o in self.options})

ESTIMATORS:dict[str, Entry] = {}

def estimator(name:str, *, defaults:dict[str, Defaults]|Callable[[Run], Defaults]=STANDARD,
              check:Callable[[Run], None]|None=None, keyed:bool=True,
              forwards:Callable[[Run], float]|None=None, memory:Callable[[Run], float|None]|None=None,
              **options:Option) -> Callable[[Callable], Callable]:
  """Register fn as `--method name`, with its options (each a keyword argument of fn with a default), the optimizer's
  defaults, a check of the run, the forwards a step needs and the memory it holds."""
  def register(fn:Callable) -> Callable:
    params = inspect.signature(fn).parameters
    for o in options:
      if o not in params or params[o].default is inspect.Parameter.empty:
        raise TypeError(f"estimator {name}: option {o!r} must be a keyword argument of {fn.__name__} with a default")
      if o in RUN_VALUES: raise TypeError(f"estimator {name}: {o!r} is a run value, not an option")
    ESTIMATORS[name] = Entry(name, fn, options, defaults, check, keyed, forwards, memory)
    return fn
  return register

def activations(model, tokens:float, kept:bool=False) -> float|None:
  """The bytes of activations a forward of `tokens` tokens holds at once, in the model's compute dtype, for the GPT and
  the looped model (None for a model of other shapes): per token the logits, and a block's widest moment, its
  attention's scores over the context beside two widths, or its MLP's input and hidden layer (five widths). `kept`:
  every block's (or loop's) activations at once, as backprop's graph and Dust's capture keep them: its scores and their
  softmax, and 16 widths (q, k, v, the attention's output, the MLP's hidden layer before and after its activation, the
  norms' and the residual's). Measured against tinygrad's allocations on the CPU (tests/test_robust.py)."""
  c = model.cfg
  if not all(hasattr(c, a) for a in ("n_embd", "n_head", "seq_len", "vocab")): return None
  blocks, scores = getattr(c, "n_layer", getattr(c, "loops", 1)), c.n_head * c.seq_len
  per_token = blocks * (2 * scores + 16 * c.n_embd) if kept else max(scores + 2 * c.n_embd, 5 * c.n_embd)
  return tokens * (per_token + c.vocab) * model.dtype.itemsize
