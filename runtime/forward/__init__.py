"""Running the model: the ModelRunner turns a scheduled batch into a ForwardBatch and calls the
model; CUDA graphs and torch.compile wrap those forwards."""
