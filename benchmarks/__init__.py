"""forklm benchmarks (the full suite is issue 3; engine_speed.py measures the engine alone)."""
