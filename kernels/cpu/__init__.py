"""CPU kernels in C: the sources beside this file (one shared header), compiled with the
system's cc on first use, and their ctypes bindings (bindings.py); each kernel names its torch
twin, which the tests compare it with."""
