"""The compiled CPU backend (backend.py): C++ kernels built with the system's compiler
(build.py) and loaded with ctypes. Importing this package loads nothing (build.py runs without
torch)."""
