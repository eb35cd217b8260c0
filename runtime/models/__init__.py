"""Model definitions written against the paged KV pool."""
