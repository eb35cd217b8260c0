"""Image inputs of vision-language models: decoding with bounds, the vision stage."""
