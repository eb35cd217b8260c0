"""Parsers of model output, pure text in and text out, each with a streaming form: tool calls in
each model's own format (tool_calls.py) and reasoning split from content (reasoning.py)."""
