"""The verifier: proves, without running anything, that a build's rank programs cannot
deadlock or mix up data."""
