"""Where the ranks of a run on this machine meet: a store that only this user can open.

``planc run`` and ``planc calibrate`` start every rank on this machine. The ranks find
each other through a store, a small key-value table; torch's launchers serve a TCPStore,
which has no secret, so any local user who connects to its port reads and writes every
key and can stand in for a rank. Here the store is a torch FileStore in a fresh
directory that only this user may enter (0700), and gloo's sockets are bound to the
loopback interface, so nothing of the run listens on another one (docs/launching.md).

The parent calls :func:`private_store` and gives each rank :func:`rank_environment`;
each rank joins with :func:`joined_store`. Only :func:`joined_store` needs torch.
"""

from __future__ import annotations

import os
import shutil
import socket
from datetime import timedelta

STORE_VARIABLE = "PLANC_STORE"  # the store file's path, in every rank's environment
STORE_DIRECTORY = "rendezvous"


def private_store(parent: str) -> str:
    """The path of a new store file in ``parent/rendezvous/``, a directory created here
    with mode 0700 (never one that exists: it could be someone else's)."""
    directory = os.path.join(parent, STORE_DIRECTORY)
    try:
        os.makedirs(parent, exist_ok=True)
        os.mkdir(directory, 0o700)
        os.chmod(directory, 0o700)  # whatever the umask took away, this user may enter it
    except OSError as exc:
        raise SystemExit(f"planc: error: cannot create the run's store in {directory}: "
                         f"{exc.strerror}") from None
    return os.path.join(directory, "store")


def remove_store(path: str) -> None:
    """The store's file and its directory, once no rank is left to use them."""
    shutil.rmtree(os.path.dirname(path), ignore_errors=True)


def rank_environment(store: str) -> dict[str, str]:
    """What every rank needs in its environment to join: the store, and the loopback
    interface for gloo, which otherwise listens on the address this machine's hostname
    resolves to (torch's ProcessGroupGloo.create_default_device), any interface."""
    names = {name for _, name in socket.if_nameindex()}
    loopback = next((name for name in ("lo", "lo0") if name in names), None)
    return {STORE_VARIABLE: store, **({"GLOO_SOCKET_IFNAME": loopback} if loopback else {})}


LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def launched_rank() -> tuple[int, int] | str:
    """(rank, world size) from the environment a launcher gives each rank (torchrun's
    RANK and WORLD_SIZE, with MASTER_ADDR and MASTER_PORT naming its store, or planc's
    own store), or why this process was not started as a rank."""
    needed = LAUNCHER_VARIABLES if STORE_VARIABLE not in os.environ else \
        LAUNCHER_VARIABLES[:2]
    missing = [name for name in needed if not os.environ.get(name)]
    if missing:
        names = missing[0] if len(missing) == 1 else \
            f"{', '.join(missing[:-1])} and {missing[-1]}"
        return (f"{names} {'is' if len(missing) == 1 else 'are'} not set: "
                f"this is one rank of a run, to be started by torchrun (torchrun "
                f"--nproc-per-node N -m ...); planc run and planc calibrate start their own "
                f"ranks (docs/launching.md)")
    try:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    except ValueError:
        return (f"RANK ({os.environ['RANK']!r}) and WORLD_SIZE "
                f"({os.environ['WORLD_SIZE']!r}) must be whole numbers")
    if not 0 <= rank < world:
        return f"RANK ({rank}) must be at least 0 and below WORLD_SIZE ({world})"
    return rank, world


def joined_store(world: int, timeout: timedelta):
    """The store named by the environment, joined (None without one: under torchrun the
    environment names a TCPStore of torch's, joined by init_process_group itself)."""
    path = os.environ.get(STORE_VARIABLE)
    if not path:
        return None
    import torch.distributed as dist

    store = dist.FileStore(path, world)
    store.set_timeout(timeout)
    return store
