"""Checkpoints without torch: their format, manifest, files and the training record they
keep, read as untrusted input before any rank starts."""
