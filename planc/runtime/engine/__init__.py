"""One rank's engine: runs the build's programs on torch.distributed, instruction by
instruction, with its parameters, data, kernels and transfers."""
