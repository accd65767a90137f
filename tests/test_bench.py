"""The benchmark's harness (tests/bench.py --quick, the tiny model on the CPU), run as a user runs it, so that it never rots: every
row of its tables must be printed with a positive time and memory. Speed itself is never asserted (CI machines differ)."""
import json, os, re, subprocess, sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

def test_bench_quick():
  r = subprocess.run([sys.executable, "tests/bench.py", "--quick"], cwd=ROOT, env={**os.environ, "DEV": "CPU"}, capture_output=True,
                     text=True, timeout=1200)
  assert r.returncode == 0, r.stderr[-2000:]
  out = r.stdout
  ratio = float(re.search(r"ratio ([\d.]+)", out).group(1))
  assert 0 < ratio < 2, out  # the jittered forward runs and takes about as long as a clean one
  # the noise's rate: the generator alone, a dense update and a seed replay, each in noise values a second
  rates = re.search(r"noise values/s: generator (\S+) \| dense update of 8 directions (\S+) .*\| seed replay of 64 steps of them (\S+) ", out)
  assert rates and all(float(v) > 0 for v in rates.groups()), out
  # a row per method: seconds a step, forward-equivalents, the forwards it needs, overhead, peak, peak over the clean forward's, first step
  for method, pop, rank, needs in (("mezo", 1, "-", 2), ("es", 8, "-", 8), ("es", 8, "1", 8), ("backprop", 1, "-", 3)):
    cells = re.search(rf"^ *{method} +{pop} +{re.escape(rank)} +(.*)$", out, re.M).group(1).split()
    s, fe, need, over, peak, ratio, first = map(float, cells)
    assert s > 0 and peak > 0 and ratio > 0 and first > 0 and need == needs and abs(over - fe / need) < 0.01 * over + 0.01, (method, cells)
  # the dust row's split by chunk kind, from a step of its own: every kind of draw is timed, and the parts sum to less than that step
  assert re.search(r"^ *dust +64 +- +[\d.]+", out, re.M), out
  step, kinds = re.search(r"by chunk kind, in a step of ([\d.]+) s with the syncs: (.*)", out).groups()
  parts = dict((k, float(v)) for k, v in re.findall(r"(\w+(?::\w+)?) ([\d.]+) s", kinds))
  assert {"direct", "head", "scalar", "local:q", "local:k", "local:v"} <= set(parts) and all(v > 0 for v in parts.values()), parts
  assert sum(parts.values()) <= float(step), (parts, step)
  row = re.search(r"^ +2 +(.*)$", out, re.M).group(1)  # the looped table's row at 2 loops: time and memory for mezo, es, dust, backprop
  assert len(re.findall(r"[\d.]+ s +[\d.]+ MiB", row)) == 4, row

# a JIT of two kernels, replayed as a row's step is: what --profile and --census are tried on, in a process of their own
TWICE = """
import json, sys
import numpy as np
sys.path.insert(0, "tests")
from bench import by_op, census, kernel_times
from tinygrad import Tensor
import engine
def twice(t:Tensor) -> Tensor: return (t.sum() + t).contiguous() * 2
a, step = Tensor(np.arange(1000, dtype=np.float32)).realize(), engine.jit(twice)
for _ in range(3): step(a)  # run, capture, replay
"""

KERNELS = TWICE + """
print(json.dumps(kernel_times(lambda: step(a))))
# made-up kernels grouped by op at peaks of 1 PFLOP/s and 1 TB/s: (name, seconds, launches, FLOPs, bytes)
made_up = [("wgmma_131072_2048_512", 2e-3, 4, 1e12, 1e9), ("wgmma_131072_2048_512_x2", 2e-3, 4, 1e12, 1e9), ("E_4096_32_4", 1e-3, 10, 0, 1e9),
           ("flash_64_2048_1024", 5e-3, 8, 5e11, 1e8), ("mystery", 0.0, 1, 0, 0)]
print(json.dumps(by_op(made_up, (1e15, 1e12))))
"""

def test_kernel_times():
  # --profile's parse of tinygrad's DEBUG=2 lines, in a JIT's replay as a row's step is, in --profile's environment, on the NULL device
  # (which batches a JIT's kernels into a graph, as CUDA does): its two kernels (a sum, then an elementwise op on its result), each
  # --profile's environment from bench.py in a process of its own: importing bench patches tinygrad's Buffer.allocate in its process
  env = subprocess.run([sys.executable, "-c", "import json, sys; sys.path.insert(0, 'tests'); from bench import profiled; "
                        "print(json.dumps(profiled(5)))"], cwd=ROOT, capture_output=True, text=True, timeout=300, check=True)
  r = subprocess.run([sys.executable, "-c", KERNELS], cwd=ROOT, env={**os.environ, "DEV": "NULL", **json.loads(env.stdout.splitlines()[-1])},
                     capture_output=True, text=True, timeout=300)
  assert r.returncode == 0, r.stderr[-2000:]
  kernels, ops = (json.loads(line) for line in r.stdout.splitlines()[-2:])
  # named and counted once, not one graph, and traced to the JIT's function
  assert len(kernels) == 2 and all(n == 1 and t > 0 and k.startswith(("r_", "E_")) and where == "twice"
                                   for k, t, n, _, _, where in kernels), kernels

  # the grouping: kernels of one op summed (two GEMMs of one shape), each op's share of the total, its rates from the sums, and the
  # roofline fraction as the larger of FLOPs / peak and bytes / peak over its time: a GEMM at half the FLOP peak is 50%, an elementwise
  # kernel at the bandwidth 100%, flash at a tenth 10%; a kernel of no time is left out
  rows = {op: rest for op, *rest in ops}
  assert set(rows) == {"GEMM 131072x2048x512", "elementwise (tinygrad)", "attention (flash)"}, ops
  share, t, n, flops, nbytes, frac = rows["GEMM 131072x2048x512"]
  assert (round(share, 12), t, n) == (0.4, 4e-3, 8) and abs(flops - 5e14) < 1 and abs(nbytes - 5e11) < 1 and abs(frac - 0.5) < 1e-12, ops
  assert abs(rows["elementwise (tinygrad)"][5] - 1.0) < 1e-12 and abs(rows["attention (flash)"][5] - 0.1) < 1e-12, ops

CENSUS = TWICE + """
print(json.dumps(census(lambda: step(a))))
print(json.dumps(census(lambda: [step(a) for _ in range(3)])))
"""

def test_census():
  # --census's count, launched one by one (JIT=2) on the NULL device, where nothing runs: t.sum() + t reads 1,000 floats and writes 1,000
  # (4,000 bytes each way), and so does the doubling after it, each traced to the JIT's function; three calls count three times
  r = subprocess.run([sys.executable, "-c", CENSUS], cwd=ROOT, env={**os.environ, "DEV": "NULL", "JIT": "2"}, capture_output=True, text=True,
                     timeout=300)
  assert r.returncode == 0, r.stderr[-2000:]
  once, thrice = (json.loads(line) for line in r.stdout.splitlines()[-2:])
  kinds = {k[:2]: (n, nbytes, where) for k, n, _, nbytes, where in once}
  assert set(kinds) == {"r_", "E_"} and all(n == 1 and where == "twice" for n, _, where in kinds.values()), once
  assert all(8000 <= nbytes < 8100 for _, nbytes, _ in kinds.values()), once
  assert [(k, 3 * n, 3 * f, 3 * b) for k, n, f, b, _ in once] == [(k, n, f, b) for k, n, f, b, _ in thrice], (once, thrice)

def test_jit_name():
  # a chunk JIT is named by the function it sums and the kind of local draws it runs, as --profile's kernels are traced
  sys.path.insert(0, str(ROOT / "tests"))
  from bench import jit_name
  import dust, engine
  from devices import keyed
  assert jit_name(engine.jit(engine.adding, None, fn=keyed, draws=dust.local_chunk, per_call=2, kind="k")) == "adding(local_chunk:k)"
  assert jit_name(engine.jit(engine.stacked, None, fn=dust.head_chunk, per_call=2)) == "stacked(head_chunk)"
  assert jit_name(engine.jit(dust.gradients, None, sites=())) == "gradients"
