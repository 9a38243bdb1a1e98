"""The runtime: runs a build's rank programs with torch.distributed (the only code that
imports torch)."""
