"""What ranks tell each other outside training: JSON text and flat tensors, never pickles.

torch.distributed's ``*_object`` collectives pickle what a rank sends and unpickle what
it receives, so whoever can send to a rank (a peer, or anyone who can write the run's
store and so stand in for one) can run code in it; torch's documentation of each says to
call it only with data you trust. planc's ranks send JSON text, as a uint8 tensor, and
tensors of numbers; what arrives is checked against the form the caller expects, and
anything else stops the rank with one line (:class:`PeerDataError`). A hostile peer can
make a run fail or compute wrong numbers, but not run code in it through planc.

Each message travels the way torch's ``gather_object`` moves its pickles: the sizes
first, to every rank (so that every rank refuses an oversized message at once and none
waits for it), then the payloads padded to the largest. A size above the limit is refused
before anything is allocated for it.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Collection

import torch
import torch.distributed as dist

MAX_JSON_BYTES = 2**30  # one rank's message; a --trace of a long GPU run stays far below
Form = Callable[[object], bool]


class PeerDataError(SystemExit):
    """Another rank sent what planc does not expect: the rank stops with one line (a
    SystemExit whose code is the message, as planc's other refusals)."""

    def __init__(self, message: str):
        super().__init__(f"planc: error: {message}")


# --- the forms a message may take: each is a test of a decoded JSON value ---------------


def integer(value) -> bool:
    return type(value) is int  # JSON's true and false decode to bool, a subclass of int


def number(value) -> bool:
    return type(value) in (int, float)


def text(value) -> bool:
    return type(value) is str


def boolean(value) -> bool:
    return type(value) is bool


def nothing(value) -> bool:
    return value is None


def either(*forms: Form) -> Form:
    return lambda value: any(form(value) for form in forms)


def one_of(allowed: Collection) -> Form:
    """A string among ``allowed`` (e.g. a node of the graph)."""
    allowed = frozenset(allowed)
    return lambda value: type(value) is str and value in allowed


def list_of(item: Form) -> Form:
    return lambda value: type(value) is list and all(item(x) for x in value)


def row(*items: Form) -> Form:
    """A list of exactly len(items) values, the i-th of form items[i]."""
    return lambda value: (type(value) is list and len(value) == len(items)
                          and all(form(x) for form, x in zip(items, value)))


def record(**fields: Form) -> Form:
    """An object with exactly these keys."""
    return lambda value: (type(value) is dict and value.keys() == fields.keys()
                          and all(form(value[key]) for key, form in fields.items()))


def map_of(item: Form, keys: Collection | None = None) -> Form:
    """An object whose values have form ``item`` and whose keys (strings, in JSON) are
    among ``keys``, or any keys without it."""
    return lambda value: (type(value) is dict and all(item(x) for x in value.values())
                          and (keys is None or all(key in keys for key in value)))


# --- collectives --------------------------------------------------------------------------


def gather_json(value, dst: int, form: Form, what: str, group=None) -> list | None:
    """Every rank's ``value`` (JSON-serialisable) on rank ``dst``, in the group's rank
    order, each checked against ``form``; None on the other ranks. ``what`` names the
    message in errors ("its trace events")."""
    gathered = gather_flat(_encode(value), dst, what, MAX_JSON_BYTES, group)
    if gathered is None:
        return None
    return [_decode(payload, form, _global_rank(group, r), what)
            for r, payload in enumerate(gathered)]


def all_gather_json(value, form: Form, what: str, group=None) -> list:
    """Every rank's ``value`` on every rank, in the group's rank order, each checked."""
    device = _device(group)
    payload = _encode(value).to(device)
    sizes = _sizes(payload.numel(), group, device, what, MAX_JSON_BYTES)
    slots = [torch.empty(max(sizes), dtype=torch.uint8, device=device) for _ in sizes]
    dist.all_gather(slots, _padded(payload, max(sizes)), group=group)
    return [_decode(slot[:size].cpu(), form, _global_rank(group, r), what)
            for r, (slot, size) in enumerate(zip(slots, sizes))]


def broadcast_json(value, src: int, form: Form, what: str, group=None):
    """Rank ``src``'s ``value`` on every rank (checked on the others)."""
    device = _device(group)
    mine = dist.get_rank() == src
    payload = _encode(value).to(device) if mine else None
    size = torch.tensor([payload.numel() if mine else 0], dtype=torch.int64, device=device)
    dist.broadcast(size, src=src, group=group)
    count = int(size)
    if not 0 <= count <= MAX_JSON_BYTES:
        raise PeerDataError(_too_large(src, what, count, MAX_JSON_BYTES))
    buffer = payload if mine else torch.empty(count, dtype=torch.uint8, device=device)
    dist.broadcast(buffer, src=src, group=group)
    return value if mine else _decode(buffer.cpu(), form, src, what)


def gather_flat(tensor: torch.Tensor, dst: int, what: str, limit: int,
                group=None) -> list[torch.Tensor] | None:
    """Every rank's 1-D ``tensor`` (same dtype everywhere, at most ``limit`` elements, any
    length) on rank ``dst`` as CPU tensors in the group's rank order; None elsewhere."""
    device = _device(group)
    sizes = _sizes(tensor.numel(), group, device, what, limit)
    longest = max(max(sizes), 1)
    padded = _padded(tensor.to(device), longest)
    receiving = dist.get_rank() == dst
    slots = [torch.empty_like(padded) for _ in sizes] if receiving else None
    dist.gather(padded, slots, dst=dst, group=group)
    if not receiving:
        return None
    return [slot[:size].cpu() for slot, size in zip(slots, sizes)]


# --- helpers ------------------------------------------------------------------------------


def _device(group) -> torch.device:
    """Where the group's tensors must be: NCCL moves only CUDA tensors."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _global_rank(group, group_rank: int) -> int:
    return group_rank if group is None else dist.get_global_rank(group, group_rank)


def _sizes(count: int, group, device: torch.device, what: str, limit: int) -> list[int]:
    """Every rank's element count, on every rank; any count above ``limit`` stops every
    rank with the same error."""
    mine = torch.tensor([count], dtype=torch.int64, device=device)
    slots = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(slots, mine, group=group)
    sizes = [int(slot) for slot in slots]
    for r, size in enumerate(sizes):
        if not 0 <= size <= limit:
            raise PeerDataError(_too_large(_global_rank(group, r), what, size, limit))
    return sizes


def _too_large(rank: int, what: str, size: int, limit: int) -> str:
    return (f"rank {rank} announced {what} of {size} elements, where planc accepts 0 to "
            f"{limit}; the run was stopped")


def _padded(tensor: torch.Tensor, length: int) -> torch.Tensor:
    if tensor.numel() == length:
        return tensor.contiguous()
    out = torch.zeros(length, dtype=tensor.dtype, device=tensor.device)
    out[:tensor.numel()] = tensor
    return out


def _encode(value) -> torch.Tensor:
    data = json.dumps(value, separators=(",", ":")).encode()
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def _decode(payload: torch.Tensor, form: Form, rank: int, what: str):
    """The JSON value in ``payload`` if it has ``form``; otherwise PeerDataError."""
    try:
        value = json.loads(payload.numpy().tobytes().decode("utf-8"))
    except UnicodeDecodeError:
        reason = "not UTF-8 text"
    except (ValueError, RecursionError) as exc:  # RecursionError: nesting too deep
        reason = f"not JSON: {str(exc) or type(exc).__name__}"
    else:
        if form(value):
            return value
        reason = "JSON of another form"
    raise PeerDataError(f"rank {rank} sent {what} in a form planc does not expect "
                        f"({reason}); the run was stopped")
