"""Parsers of model output, pure text in and text out, each with a streaming form: tool calls in
each model's own format (tool_calls.py: registry, detection from a chat template, incremental
ToolCallStream), forklm's generic call formats behind the same CallStream protocol (generic.py)
and reasoning split from content (reasoning.py)."""
