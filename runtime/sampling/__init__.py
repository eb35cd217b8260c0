"""Sampling: request parameters and their checks, the sampler, grammar constraints (xgrammar) and
their pool, stop regexes, and n-gram draft proposals for speculative decoding."""
