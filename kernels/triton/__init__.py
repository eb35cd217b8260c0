"""Triton kernels, each beside a torch reference twin (`<op>_ref`, same signature).

Importing this package does not import Triton: the kernel modules import it themselves (guarded,
so their `_ref` twins work where Triton is missing), and the engine imports them only when the
Triton attention backend is chosen.
"""
