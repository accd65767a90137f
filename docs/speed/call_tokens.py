# Dust pop 1024 at the small preset with devices.CALL_TOKENS set: seconds a step on the device (synced), median of 10 after 3
#   python3 docs/speed/call_tokens.py 131072
import sys, time
sys.path.insert(0, "tests"); sys.path.insert(0, ".")
import devices
devices.CALL_TOKENS = int(sys.argv[1])
import bench, estimators, engine
model, x, y = bench.setup("small", False)
st = time.perf_counter()
for i in range(3): estimators.run(model, x, y, "dust", 1024, i)
bench.sync(); first = time.perf_counter() - st
engine.freeze_compiled()
ts = []
for i in range(10):
  st = time.perf_counter(); estimators.run(model, x, y, "dust", 1024, 10 + i); bench.sync(); ts.append(time.perf_counter() - st)
ts.sort()
print(f"CALL_TOKENS {sys.argv[1]:>7}: {ts[5] * 1e3:.1f} ms a step (median of 10; min {ts[0] * 1e3:.1f}), first three {first:.1f} s", flush=True)
