"""Which token file a run reads: the file as it was checked before any rank started.

A token file changed under a running job (truncated, rewritten, replaced by a rename)
would feed the following steps other data than the run was checked for, or wrap around
a shorter file without a word. So ``planc run`` records the file's identity when it
checks it (device, inode, size, modification time), hands it to every rank, and each
batch read compares the file with it (planc.runtime.engine.data.batch_tokens). No torch here:
the token file's reader (planc.data.tokens) and the ranks share it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from planc.plan.data_source import paths_of
from planc.data.megatron import stream_path


@dataclass(frozen=True)
class Identity:
    """A file as it was: the same path naming another file, or this file with another
    size or modification time, is a file changed since. Written
    ``DEVICE:INODE:SIZE:MTIME_NS`` for the workers' command line."""

    device: int
    inode: int
    size: int
    mtime_ns: int

    @classmethod
    def of(cls, info: os.stat_result) -> Identity:
        return cls(info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns)

    @classmethod
    def parse(cls, text: str) -> Identity:
        parts = text.split(":")
        if len(parts) != 4:
            raise ValueError(f"expected DEVICE:INODE:SIZE:MTIME_NS, not {text!r}")
        return cls(*(int(part) for part in parts))

    def __str__(self) -> str:
        return f"{self.device}:{self.inode}:{self.size}:{self.mtime_ns}"


def how_changed(path: str, identity: Identity, info: os.stat_result | None = None
                ) -> str | None:
    """How ``path`` (or ``info``, what fstat said of the file opened there) differs from
    the file ``identity`` describes, in a few words; None if it does not (or if the path
    cannot be examined for another reason, which reading it will report)."""
    if info is None:
        try:
            info = os.stat(stream_path(path))
        except FileNotFoundError:
            return "removed"
        except OSError:
            return None
    now = Identity.of(info)
    if (now.device, now.inode) != (identity.device, identity.inode):
        return "replaced by another file"
    if now.size != identity.size:
        return f"{identity.size} bytes when the run began, {now.size}"
    if now.mtime_ns != identity.mtime_ns:
        return "rewritten in place"
    return None


def parse_identities(text: str) -> "Identity | tuple[Identity, ...]":
    """One identity (``DEVICE:INODE:SIZE:MTIME_NS``), or a mixture's, comma-separated."""
    parts = text.split(",")
    return Identity.parse(text) if len(parts) == 1 else tuple(map(Identity.parse, parts))


def identities_text(identity: "Identity | tuple[Identity, ...]") -> str:
    return ",".join(map(str, identity)) if isinstance(identity, tuple) else str(identity)


def identity_now(path: str) -> "Identity | tuple[Identity, ...] | None":
    """The identity of the data file ``path`` now, for a rank that was given none (under
    torchrun, no planc run checked the file first: each rank pins the file it finds when
    it starts); None for synthetic data, or a file that cannot be found (its first batch
    says why)."""
    if path == "synthetic":
        return None
    try:
        found = tuple(Identity.of(os.stat(stream_path(p))) for p in paths_of(path))
    except OSError:
        return None
    return found if len(found) > 1 else found[0]
