"""Data parallelism: N `forklm serve` replicas behind one router that picks a replica per request
(round robin, shortest queue, or cache-aware over an approximate prefix tree per replica)."""
