"""Quantized weights kept in their packed form: GGUF block formats and the linear layers that
multiply with them."""
