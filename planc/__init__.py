"""planc: a declarative parallel-plan compiler for training large transformer models."""

__version__ = "0.1.0"
