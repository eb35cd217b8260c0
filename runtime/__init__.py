"""forklm's engine: config, model, paged KV pool, radix cache, scheduler, sampling, detokenizer."""
