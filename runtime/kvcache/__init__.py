"""The KV cache: the paged pool, the radix tree over its slots, the manager that allocates and
frees them per request, session pins, and the pool's sizing."""
