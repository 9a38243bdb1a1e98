"""Hugging Face checkpoints: reading a transformers directory without torch, initialising a
run from one, and exporting a planc checkpoint as one."""
