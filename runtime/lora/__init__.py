"""LoRA adapters: PEFT folders read onto the decoder's modules, applied per batch row."""
