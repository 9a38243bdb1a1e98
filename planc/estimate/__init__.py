"""Estimates before anything runs: the alpha-beta cost model of compute and collectives,
the kernels' rates on known GPUs, and memory per device (ZeRO, activations)."""
