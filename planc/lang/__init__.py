"""The front end: .plan file to validated Plan (parse, check, estimate memory).

The names below live in :mod:`planc.lang.front` and load on first use: the model
families declare their keys with :mod:`planc.vocabulary.kinds`, and a package that imported
its checker (which reads the families) up front could not be imported by them.
"""

from __future__ import annotations

from typing import Any

__all__ = ["MAX_FILE_BYTES", "Loaded", "Override", "OverrideError", "load_file",
           "load_text", "memory_warnings"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from planc.lang import front

        return getattr(front, name)
    raise AttributeError(f"module 'planc.lang' has no attribute {name!r}")
