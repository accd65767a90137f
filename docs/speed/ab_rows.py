# The rows of [speed]'s A/B in one tree (run from its root): the clean forward at a preset and the given rows, each in a process of its
# own (bench.run_row), printed as bench.py's table prints them; `torch` adds the PyTorch reference's forward.
#   python3 docs/speed/ab_rows.py PRESET ROW... [torch]     (from the root of the tree to measure)
import sys
sys.path.insert(0, "tests"); sys.path.insert(0, ".")
import bench
preset, rows = sys.argv[1], [r for r in sys.argv[2:] if r != "torch"]
f = bench.run_row(preset, "forward", False)
print(f"{preset}: clean forward {f['clean_s'] * 1e3:.3f} ms, jittered {f['jittered_s'] * 1e3:.3f} ms", flush=True)
if "torch" in sys.argv:
  model, x, y = bench.setup(preset, False)
  print("  " + bench.torch_reference(model, x, y), flush=True)
for spec in rows:
  r = bench.run_row(preset, spec, False)
  print(f"  {spec:>12} {r['s']:.4f} s/step = {r['s'] / f['clean_s']:.1f} forwards (needs {r['needs']:.0f}), peak {r['peak'] / 2**20:.0f} MiB, "
        f"first {r['first_s']:.1f} s" + (f" | split {r['split_s']:.3f} s: " + ", ".join(f"{k} {v:.3f}" for k, v in r["split"].items())
                                          if "split" in r else ""), flush=True)
