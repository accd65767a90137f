"""The benchmark's harness (tests/bench.py --quick, the tiny model on the CPU), run as a user runs it, so that it never rots: every
row of its tables must be printed with a positive time and memory. Speed itself is never asserted (CI machines differ)."""
import os, re, subprocess, sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

def test_bench_quick():
  r = subprocess.run([sys.executable, "tests/bench.py", "--quick"], cwd=ROOT, env={**os.environ, "DEV": "CPU"}, capture_output=True,
                     text=True, timeout=1200)
  assert r.returncode == 0, r.stderr[-2000:]
  out = r.stdout
  ratio = float(re.search(r"ratio ([\d.]+)", out).group(1))
  assert 0 < ratio < 2, out  # the jittered forward runs and takes about as long as a clean one
  for method in ("backprop pop 1", "mezo pop 1", "dust pop 64"):
    t, mib = map(float, re.search(method + r" step +([\d.]+) s +peak +([\d.]+) MiB", out).groups())
    assert t > 0 and mib > 0, out
  # the dust row's split by chunk kind, from a step of its own: every kind of draw is timed, and the parts sum to less than that step
  step, kinds = re.search(r"by chunk kind, in a step of ([\d.]+) s with the syncs: (.*)", out).groups()
  parts = dict((k, float(v)) for k, v in re.findall(r"(\w+(?::\w+)?) ([\d.]+) s", kinds))
  assert {"direct", "head", "scalar", "local:q", "local:k", "local:v"} <= set(parts) and all(v > 0 for v in parts.values()), parts
  assert sum(parts.values()) <= float(step), (parts, step)
  for loops in (2, 8):  # the looped table: a row per depth, time and memory for mezo, es, dust, backprop
    row = re.search(rf"^ +{loops} +(.*)$", out, re.M).group(1)
    assert len(re.findall(r"[\d.]+ s +[\d.]+ MiB", row)) == 4, row
