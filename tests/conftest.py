import os, sys, pathlib
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
# on the CPU most of a test's time is tinygrad generating and compiling kernels; NOOPT skips the kernel optimizer (same results,
# ~3x less compile time). Set before tinygrad is imported, so its ContextVar and every subprocess see it.
os.environ.setdefault("NOOPT", "1")
