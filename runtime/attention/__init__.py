"""Attention backends over the paged KV pool (torch, native C, Triton, batch-invariant), chosen
by name through registry.py."""
