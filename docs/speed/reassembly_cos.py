# Dust's estimate at the dust preset, pop 1024: the reassembly and credit on the tensor cores against float32 (tinygrad's matmul),
# in one process, and each one's cosine to backprop's gradient per layer type
#   python3 docs/speed/reassembly_cos.py
import sys, time
sys.path.insert(0, "."); sys.path.insert(0, "tests")
import bench, dust, engine, estimators
from cosine import cosines
model, x, y = bench.setup("dust", False)
st = time.perf_counter()
tc = estimators.estimate(model, x, y, "dust", 1024, 7)
print(f"estimate {time.perf_counter() - st:.1f} s", flush=True)
g = estimators.estimate(model, x, y, "backprop", 1, 0)
dust.outer_sum, dust.mix_rows = (lambda a, b: a.float().T @ b.float()), (lambda c, s: (c @ s).contiguous())
engine._jits.clear()
ref = estimators.estimate(model, x, y, "dust", 1024, 7)
a, b, r = cosines(tc, g), cosines(ref, g), cosines(tc, ref)
for t in a: print(f"{t:9} to backprop: tensor cores {a[t]:.4f}, float32 {b[t]:.4f}; to each other {r[t]:.6f}", flush=True)
