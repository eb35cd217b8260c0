"""Scheduling: which waiting requests join the running batch each step (radix-cache prefix
matching, KV admission, chunked prefill, retraction under memory pressure, policies)."""
