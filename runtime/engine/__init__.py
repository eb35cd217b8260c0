"""The engine: its facade (Engine), the loop that steps it, request intake, the per-step output
processing (sampling, finishing, streaming), detokenizing, typed results, and the builder that
makes its parts from an EngineConfig."""
