import os, sys, pathlib
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
# On the CPU most of a test's time is tinygrad generating and compiling kernels. NOOPT skips the kernel optimizer (same results,
# ~3x less compile time). PARALLEL=0 compiles in the process: under xdist each worker's pool has one compile process, restarted
# every 16 kernels, and the kernels' round trips cost more than the pool wins (tests/test_zo.py::test_no_autograd_in_zo_paths on 2
# cores: 81 s with the pool, 49 s without). Set before tinygrad is imported, so its ContextVars and every subprocess see them.
os.environ.setdefault("NOOPT", "1")
os.environ.setdefault("PARALLEL", "0")
