"""Parsers of model output, pure text in and text out, each with a streaming form: tool calls in
each model's own format (calls.py: the shared types and the CallStream protocol; tool_calls.py:
JSON-object formats, the registry and detection from a chat template; tagged_json.py,
harmony.py, xml_calls.py, pythonic.py: the other formats, markup.py their marker reading),
forklm's generic call formats (generic.py) and reasoning split from content (reasoning.py)."""
