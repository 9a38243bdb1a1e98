"""Helpers run with ``python -m planc.tools.<name>``: not part of the planc command."""
