#!/usr/bin/env python3
"""Pictures of zo's runs and benchmarks, as PNG files.

  python plot.py runs/dust runs/backprop --out docs/loss.png      val loss against tokens and against seconds, a curve
                                                                  per run (each run's metrics.jsonl; its label is the
                                                                  folder's name)
  python plot.py docs/race/*/ --reach docs/race/dust-adamw --out docs/race/race.png
                                                                  the same, and a table: each run's final val loss,
                                                                  seconds, and the seconds it took to reach the --reach
                                                                  run's final loss
  python plot.py docs/finetune/*-*/ --best --out docs/finetune/race.png
                                                                  each method's run of lowest val loss (of its lrs;
                                                                  config.json's method), val loss against seconds and
                                                                  against network forwards, and their table
  python plot.py --bench bench.json --reference docs/reference.json --out docs/dust_time.png
                                                                  a Dust update's seconds against the population, zo
                                                                  beside the PyTorch reference (bench.json from
                                                                  `tests/bench.py --json`)
"""
import argparse, json, math, os, re
from collections import defaultdict
from typing import Callable
try:
  import matplotlib
  matplotlib.use("Agg")  # files only: no screen needed
  import matplotlib.pyplot as plt
except ImportError: plt = None  # the tables need only the standard library

def metrics(run:str) -> list[dict]:
  with open(os.path.join(run, "metrics.jsonl")) as f: return [r for r in map(json.loads, f) if "val_loss" in r]

def val_plots(lines:list[tuple[list[dict], Callable, Callable, dict]], left:dict, right:dict, out:str, **legend):
  """Two plots of val loss side by side, a curve per (evaluations, its x on the left, its x on the right, its style);
  left and right: each plot's axis settings."""
  fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
  for evals, *xs, style in lines:
    for ax, x in zip(axes, xs): ax.plot([x(r) for r in evals], [r["val_loss"] for r in evals], **style)
  axes[0].set(ylabel="val loss (nats)", **left)
  axes[1].set(**right)
  for ax in axes: ax.grid(alpha=0.3)
  axes[0].legend(**legend)
  fig.tight_layout()
  fig.savefig(out, dpi=120)

def loss_curves(runs:list[str], out:str, highlight:str|None=None):
  """A curve per run, against tokens and seconds; the `highlight` run (--reach's) in black, over the others."""
  def style(i:int, run:str) -> dict:
    shown = (dict(color="black", linewidth=2, zorder=3)
             if highlight and os.path.abspath(run) == os.path.abspath(highlight) else
             dict(color=plt.cm.tab20(i % 20)))  # the default cycle repeats after 10
    return dict(label=os.path.basename(os.path.normpath(run)), **shown)
  val_plots([(metrics(run), lambda r: r["tokens"], lambda r: r["seconds"], style(i, run))
             for i, run in enumerate(runs)], dict(xlabel="tokens"),
            dict(xlabel="seconds (log scale: runs differ by orders of magnitude)", xscale="log"), out)

def reach_table(runs:list[str], target_run:str) -> str:
  """A markdown table: each run's final val loss and seconds, and the seconds and tokens of its first evaluation at or
  below the target run's final val loss (evaluations come every --eval-every steps, so the run got there at most that
  many steps sooner)."""
  target = metrics(target_run)[-1]["val_loss"]
  rows = [f"| run | final val loss | seconds | reaches {target:.3f} after: seconds | tokens |", "|---|---|---|---|---|"]
  for run, m in sorted(((run, metrics(run)) for run in runs), key=lambda rm: rm[1][-1]["val_loss"]):
    hit = next((f"{r['seconds']:,.1f} | {r['tokens']:,}" for r in m if r["val_loss"] <= target), "never | never")
    rows.append(f"| {os.path.basename(os.path.normpath(run))} | {m[-1]['val_loss']:.3f} | "
                f"{m[-1]['seconds']:,.1f} | {hit} |")
  return "\n".join(rows)

def best_runs(runs:list[str]) -> dict[str, list[tuple[str, dict, list[dict]]]]:
  """method -> its runs as (folder, config, evaluations), the best first: the run of lowest val loss along the way (the
  fine-tuning race keeps each run's best weights, --keep-best, and stops it when its val loss stops improving, docs/finetune)."""
  by = defaultdict(list)
  for run in runs:
    with open(os.path.join(run, "config.json")) as f: config = json.load(f)
    by[config["method"]].append((run, config, metrics(run)))
  return {m: sorted(rs, key=lambda r: lowest(r[2])["val_loss"]) for m, rs in by.items()}

def lowest(evals:list[dict]) -> dict:  # a run's best evaluation; a run stopped before its first has val loss inf
  return min(evals, key=lambda r: r["val_loss"], default={"val_loss": math.inf, "seconds": math.nan, "step": math.nan})

def shown(v:float|None, fmt:str="{:.3f}") -> str: return "-" if v is None or not math.isfinite(v) else fmt.format(v)

def val_at(evals:list[dict], seconds:float) -> float|None:  # the val loss of the last evaluation by then (None: none yet)
  return next((r["val_loss"] for r in reversed(evals) if r["seconds"] <= seconds), None)

def ended(run:str) -> str:
  """How a run ended, by docs/device_run.sh's log.txt: zo exits 0 when --patience stops it (or at its last step), 130 when the
  race's budget of seconds stops it (SIGINT), 2 on a non-finite loss."""
  if not os.path.exists(log := os.path.join(run, "log.txt")): return "?"
  with open(log) as f: codes = re.findall(r": exit (\d+) after", f.read())
  return {"0": "patience", "130": "budget"}.get(codes[-1], f"failed (exit {codes[-1]})") if codes else "?"

def forwards(config:dict, r:dict) -> float:
  """The network forwards of steps 0..r's step, as the run's estimator declared a step's (evaluations not counted)."""
  return (r["step"] + 1) * config["forwards_per_step"]

def best_curves(by:dict, out:str):
  """Each method's best run: val loss against seconds and against forwards."""
  val_plots([(evals, lambda r: r["seconds"], lambda r, c=config: forwards(c, r),
              dict(label=f"{method} (lr {config['lr']:g})", color=plt.cm.tab10(i)))
             for i, (method, ((_, config, evals), *_)) in enumerate(sorted(by.items())) if evals],
            dict(xlabel="seconds (compiling from the cache included)"), dict(xlabel="network forwards (log scale)", xscale="log"),
            out, fontsize=8)

MARKS = (10, 20, 40)  # the seconds at which best_table gives each method's val loss

def best_table(by:dict) -> str:
  """A markdown table, the best method first: a row per method, its best lr (of every lr tried, each with its lowest val loss), that
  run's lowest val loss with the seconds and network forwards it took to get there, its val loss at the MARKS seconds, and how it
  ended. A run stopped before its first evaluation has none ("-")."""
  rows = ["| method | lr | lrs tried: lowest val | lowest val | seconds to it | forwards to it | "
          + " | ".join(f"val at {t} s" for t in MARKS) + " | ended by |", "|---" * (7 + len(MARKS)) + "|"]
  for method, rs in sorted(by.items(), key=lambda kv: lowest(kv[1][0][2])["val_loss"]):
    run, config, evals = rs[0]
    tried = ", ".join(f"{c['lr']:g}: {shown(lowest(e)['val_loss'])}" for _, c, e in sorted(rs, key=lambda r: r[1]["lr"]))
    low = lowest(evals)
    marks = " | ".join(shown(val_at(evals, t)) for t in MARKS)
    rows.append(f"| {method} | {config['lr']:g} | {tried} | {shown(low['val_loss'])} | {shown(low['seconds'], '{:,.1f}')} | "
                f"{shown(forwards(config, low), '{:,.0f}')} | {marks} | {ended(run)} |")
  return "\n".join(rows)

def dust_times(bench:str, reference:str, out:str):
  rows = [r for r in json.load(open(bench)) if r["method"] == "dust" and r["devices"] == 1]
  ref = json.load(open(reference))
  fig, ax = plt.subplots(figsize=(6, 4))
  for preset in sorted({r["preset"] for r in rows}):
    mine = sorted((r["pop"], r["s"]) for r in rows if r["preset"] == preset)
    ax.plot(*zip(*mine), "o-", label=f"zo ({preset})")
  ax.plot(ref["pop"], ref["seconds"], "s--", label=ref["label"])
  ax.set(xscale="log", yscale="log", xlabel="population (draws)", ylabel="seconds per update", title=ref["title"])
  ax.minorticks_off()
  ax.set_xticks(ref["pop"], [str(p) for p in ref["pop"]])
  ax.grid(alpha=0.3)
  ax.legend()
  fig.tight_layout()
  fig.savefig(out, dpi=120)

if __name__ == "__main__":
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("runs", nargs="*", help="run folders, each with a metrics.jsonl")
  p.add_argument("--bench", help="tests/bench.py --json output")
  p.add_argument("--reference", help="the reference's measured seconds per population (docs/reference.json)")
  p.add_argument("--reach", help="a run folder: also print a table of each run's seconds and tokens "
                 "to reach the final val loss of this run")
  p.add_argument("--best", action="store_true", help="each method's best run (of its lrs): against seconds and "
                 "forwards, and a table")
  p.add_argument("--out", required=True, help="the PNG to write")
  args = p.parse_args()
  if args.bench: dust_times(args.bench, args.reference, args.out)
  elif args.runs:
    # a race's run may end before its first evaluation (--best tables it as such); a curve needs one
    if unevaluated := [r for r in args.runs * (not args.best) + [args.reach] * bool(args.reach) if not metrics(r)]:
      p.error(f"no val loss in {', '.join(unevaluated)}: each run needs at least one evaluation (zo.py --eval-every)")
    if args.best:
      by = best_runs(args.runs)
      runs = [(r, c) for rs in by.values() for r, c, _ in rs]
      if unknown := [r for r, c in runs if c.get("lr") is None or c.get("forwards_per_step") is None]:
        p.error(f"--best needs each run's --lr and its forwards a step in config.json, which {', '.join(unknown)} lack")
      best_curves(by, args.out)
      print(best_table(by))
    else: loss_curves(args.runs, args.out, args.reach)
    if args.reach: print(reach_table(args.runs, args.reach))
  else: p.error("give run folders, or --bench with --reference")
