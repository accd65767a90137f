"""The contracts: everything the command line, the training loop and the optimizer know of an estimator, or of a model,
is what it declares here, where it is defined.

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
anything is written (a model it can't train among them: Dust's needs sites, backprop a gradient), `forwards(run)`, the
network forwards a step's arithmetic needs (what tests/bench.py and the fine-tuning race count a step's cost in), and
`memory(run)`, the bytes of activations and draws a step holds at once (what the command line's memory check adds to
the parameters; `activations` counts a forward's).

  @model("tiny")
  def tiny(vocab:int|None, seed:int, dtype:DType) -> GPT: ...

A model is what a function registered with @model returns (`--model NAME`), its keyword arguments declared as Options
its flags, as an estimator's are. The function may name the run's values vocab (--vocab; None: the model's own), seed
(--seed), dtype (the compute dtype: float32 on the CPU, half on a GPU, for a model that computes in it) and loops
(--loops). What every estimator needs of the model it returns (`lacks` checks it when the model is made;
docs/model.md):

  params     a dict[str, Tensor] of float32 tensors, realized: the parameters by name, which the optimizer updates in
             place
  losses(x, y, params=None) -> Tensor
             the per-token losses [B, T] (float32) of int32 token ids x and targets y [B, T], under `params` (a dict
             like model.params) or, for None, model.params. Any function of the parameters: MeZO and ES need no
             gradient of it
  cfg        its vocab (cfg.vocab) and context (cfg.seq_len)

A model whose losses() also takes a population, each params value a kernels.perturb.Population and member m the batch
rows [mB, (m+1)B), says so with `population = True` (model.GPT does): MeZO and ES then evaluate many members in one
forward instead of one a forward. Dust needs the sites of model.GPT (a subclass keeps them; dust.py's `lacks`), and
backprop a gradient for every parameter (estimators.py's `differentiable`).
"""
from __future__ import annotations
import functools, inspect, math
from dataclasses import dataclass, field
from typing import Any, Callable
from tinygrad import Tensor, dtypes

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
class Declared:
  """A function registered with its options: an estimator (Entry) or a model (ModelEntry)."""
  name:str
  fn:Callable
  options:dict[str, Option]

  @functools.cached_property  # read at every step, by the loop
  def takes(self) -> set[str]: return set(inspect.signature(self.fn).parameters)  # the names the function takes
  def default(self, option:str) -> Any: return inspect.signature(self.fn).parameters[option].default

def declare(kind:str, name:str, fn:Callable, options:dict[str, Option], values:tuple[str, ...]):
  """Refuse an option that is no keyword argument of fn with a default, or that is one of the run's values."""
  params = inspect.signature(fn).parameters
  for o in options:
    if o not in params or params[o].default is inspect.Parameter.empty:
      raise TypeError(f"{kind} {name}: option {o!r} must be a keyword argument of {fn.__name__} with a default")
    if o in values: raise TypeError(f"{kind} {name}: {o!r} is a run value, not an option")

@dataclass(frozen=True)
class Entry(Declared):
  defaults:dict[str, Defaults]|Callable[[Run], Defaults]
  check:Callable[[Run], None]|None
  keyed:bool  # False: fn draws no noise, and gets no key
  forwards:Callable[[Run], float]|None  # the forwards a step's arithmetic needs; None: not declared
  memory:Callable[[Run], float|None]|None  # the bytes a step holds at once beside the parameters; None: one forward's

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
    declare("estimator", name, fn, options, RUN_VALUES)
    ESTIMATORS[name] = Entry(name, fn, options, defaults, check, keyed, forwards, memory)
    return fn
  return register

# ***** models *****

MODEL_VALUES = ("vocab", "seed", "dtype", "loops")

class ModelEntry(Declared):
  def make(self, **values) -> Any:
    """The model, of the run's values that fn names and its options (given, or fn's defaults)."""
    return self.fn(**{k: v for k, v in values.items() if k in self.takes})

MODELS:dict[str, ModelEntry] = {}

def model(name:str, **options:Option) -> Callable[[Callable], Callable]:
  """Register fn as `--model name`, with its options (each a keyword argument of fn with a default, a flag)."""
  def register(fn:Callable) -> Callable:
    declare("model", name, fn, options, MODEL_VALUES)
    MODELS[name] = ModelEntry(name, fn, options)
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
  return tokens * (per_token + c.vocab) * itemsize(model)

def itemsize(net) -> int: return getattr(net, "dtype", dtypes.float32).itemsize  # compute dtype bytes (none: float32)

def size(net) -> int: return sum(p.numel() for p in net.params.values())  # D, a model's number of parameters

def lacks(net) -> str|None:
  """What of every estimator's contract (the docstring above) a model lacks, in words; None where it has it all."""
  params = getattr(net, "params", None)
  if not isinstance(params, dict) or not params: return "params, a dict of its parameters by name"
  if bad := next((n for n, p in params.items() if not isinstance(p, Tensor) or p.dtype != dtypes.float32), None):
    what = getattr(params[bad], "dtype", type(params[bad]).__name__)
    return f"float32 tensors in params: params[{bad!r}] is a {what}"
  if "params" not in inspect.signature(getattr(net, "losses", lambda: None)).parameters:
    return "losses(x, y, params=None), the per-token losses under given parameters"
  cfg = getattr(net, "cfg", None)
  if not all(isinstance(getattr(cfg, a, None), int) for a in ("vocab", "seq_len")):
    return "cfg.vocab and cfg.seq_len, its vocabulary and context"
  return None
