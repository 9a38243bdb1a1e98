"""The ranks' checkpoint I/O: writing and resuming checkpoints, loading a Hugging Face
initialisation, and exporting tensors for transformers."""
