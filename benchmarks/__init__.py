"""forklm benchmarks: workloads, runners against forklm and peer servers, the report;
engine_speed.py measures the engine alone."""
