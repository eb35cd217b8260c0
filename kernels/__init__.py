"""Triton kernels, each beside a torch reference twin (see issue 7)."""
