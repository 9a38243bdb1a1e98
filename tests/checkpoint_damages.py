"""The damage of tests/test_damaged_checkpoints.py: a checkpoint of a small gpt (tp 2 x
pp 2, AdamW) changed in one place, in every way that file's docstring lists. Each
:class:`Damage` edits a copy of the checkpoint directory; the ones that change a data
file also write its new size and sha256 into the manifest, as an attacker would, so that
the damage reaches the checks behind the hashes.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import load_file, save

from planc.checkpoint import format as fmt

PLAN = """plan damaged {{
  model gpt {{ layers = 2; hidden = 16; heads = 2; vocab = 32; seq = 8; batch = 4 }}
  mesh {{ {mesh} }}
  schedule {{ microbatches = 2 }}
  train {{ steps = {steps}; optimizer = adamw(lr = 0.01, weight_decay = 0.1); seed = 3 }}
}}
"""
STEPS = 3  # the resuming plan's: the checkpoint is at step 2
STEP, MANIFEST, LATEST, RNG = "step-000002", "manifest.json", "latest", "rng.safetensors"
MODEL0, MODEL1 = "model-00000-of-00002.safetensors", "model-00001-of-00002.safetensors"
OPT0, OPT1 = "optimizer-00000-of-00002.safetensors", "optimizer-00001-of-00002.safetensors"
HASHED = (MODEL0, MODEL1, OPT0, OPT1, RNG, fmt.MODEL_INDEX, fmt.OPTIMIZER_INDEX)
QKV = "layers.0.qkv.weight"
NAN, INF = float("nan"), float("inf")
# Values of the wrong type (or range) for a field: name -> value.
WRONG = {"string": "x", "number": 7, "list": [], "null": None, "object": {}, "true": True,
         "huge": 10**40, "negative": -1, "nan-string": "NaN", "nan": NAN, "infinity": INF}
DELETE = object()


@dataclass(frozen=True)
class Damage:
    name: str  # WHERE:what, such as manifest.json:optimizer.steps=nan
    kind: str
    names: tuple[str, ...]  # the refusal names one of these (the file, the field)
    apply: Callable[[Path], None]  # on a copy of the checkpoint directory
    cli: bool = False  # also through the real planc run --resume and planc export


# --- editing a checkpoint ------------------------------------------------------------------


def _path(root: Path, name: str) -> Path:
    return root / LATEST if name == LATEST else root / STEP / name


def manifest_of(root: Path) -> dict:
    return json.loads((root / STEP / MANIFEST).read_text())


def write_manifest(root: Path, data: dict) -> None:
    (root / STEP / MANIFEST).write_text(json.dumps(data, allow_nan=True))


def _resign(root: Path, name: str) -> None:
    """The manifest names the file's new size and sha256, as an attacker would write it."""
    data = (root / STEP / name).read_bytes()
    manifest = manifest_of(root)
    manifest["files"][name] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    write_manifest(root, manifest)


def _set(path: tuple, value=DELETE):
    def apply(root: Path) -> None:
        data = manifest_of(root)
        holder = data
        for key in path[:-1]:
            holder = holder[key]
        if value is DELETE:
            del holder[path[-1]]
        else:
            holder[path[-1]] = value
        write_manifest(root, data)

    return apply


def _bytes(name: str, data: bytes, resign: bool = False):
    def apply(root: Path) -> None:
        _path(root, name).write_bytes(data)
        if resign:
            _resign(root, name)

    return apply


def _replace(name: str, what: str):
    def apply(root: Path) -> None:
        path = _path(root, name)
        if what == "outside-link":  # an intact copy, elsewhere
            outside = root.parent / "outside" / name
            outside.parent.mkdir(exist_ok=True)
            shutil.copyfile(path, outside)
        path.unlink()
        if what == "directory":
            path.mkdir()
        elif what == "fifo":
            os.mkfifo(path)
        elif what == "dev-zero":
            path.symlink_to("/dev/zero")
        elif what == "outside-link":
            path.symlink_to(root.parent / "outside" / name)

    return apply


def label(path: tuple) -> str:
    """A field's path as the refusal writes it: optimizer.steps, parameters["x"].shape."""
    out = ""
    for key in path:
        if isinstance(key, int):
            out += f"[{key}]"
        elif key.isidentifier():
            out += f".{key}" if out else key
        else:
            out += f"[{json.dumps(key)}]"
    return out


def edit_tensors(file: str, edit):
    def apply(root: Path) -> None:
        path = root / STEP / file
        tensors = load_file(str(path))
        changed = edit(tensors)
        tensors = tensors if changed is None else changed
        path.write_bytes(save(tensors, {"format": "pt"}))
        _resign(root, file)

    return apply


def _edit_header(file: str, edit):
    """The safetensors header of ``file`` as ``edit`` leaves it: the dict changed in place,
    or the header's text, or (its text, the length the file gives it); the data as it
    was."""
    def apply(root: Path) -> None:
        path = root / STEP / file
        raw = path.read_bytes()
        (length,) = struct.unpack("<Q", raw[:8])
        header = json.loads(raw[8:8 + length])
        changed = edit(header)
        text, said = json.dumps(header).encode(), None
        if isinstance(changed, bytes):
            text = changed
        elif isinstance(changed, tuple):
            text, said = changed
        path.write_bytes(struct.pack("<Q", len(text) if said is None else said) + text
                         + raw[8 + length:])
        _resign(root, file)

    return apply


# --- the corpus -----------------------------------------------------------------------------


def _whole_file(name: str, raw: bytes) -> list[Damage]:
    forms = {"missing": None, "empty": b"", "cut-at-1": raw[:1], "cut-at-8": raw[:8],
             "cut-in-half": raw[:len(raw) // 2], "cut-last-byte": raw[:len(raw) - 2]}
    out = [Damage(f"{name}:{what}", "whole-file", (name,),
                  _replace(name, what) if data is None else _bytes(name, data))
           for what, data in forms.items() if not (name == LATEST and what == "missing")]
    out += [Damage(f"{name}:{what}", "whole-file", (name,), _replace(name, what))
            for what in ("directory", "fifo", "dev-zero", "outside-link")]
    if name in HASHED:
        out += [Damage(f"{name}:{what}-resigned", "resigned-file", (name,),
                       _bytes(name, data, resign=True))
                for what, data in forms.items() if data is not None]
    if name == MANIFEST:
        middle = len(raw) // 3
        out += [Damage(f"{name}:{what}", "whole-file", (name,), _bytes(name, data))
                for what, data in (("not-utf8", raw[:middle] + b"\xff\xfe" + raw[middle + 2:]),
                                   ("json-list", b"[]\n"), ("json-null", b"null\n"),
                                   ("json-nan", b"NaN\n"))]
    return out


def _fields(document: dict, path: tuple) -> list[Damage]:
    """Each field under ``path`` deleted, and given each wrong value but its own."""
    holder = document
    for key in path:
        holder = holder[key]
    out = []
    for key in holder:
        where = path + (key,)
        # the field; as the plan comparison names it ("lr = 7 in the checkpoint"); the
        # parameter or file whose entry it is
        names = (label(where), f"{key} = ", *path[1:2])
        out.append(Damage(f"manifest.json:{label(where)}-deleted", "field", names,
                          _set(where)))
        out += [Damage(f"manifest.json:{label(where)}={value}", "field", names,
                       _set(where, WRONG[value]))
                for value in WRONG if not (WRONG[value] == holder[key] and
                                           type(WRONG[value]) is type(holder[key]))]
    return out


def _items(document: dict) -> list[Damage]:
    out = []
    for path in (("optimizer", "betas", 0), ("parameters", QKV, "shape", 0),
                 ("optimizer", "state", 1), ("rng", "tensors", 0)):
        out += [Damage(f"manifest.json:{label(path)}={value}", "item",
                       (label(path), label(path[:-1]), *path[1:2]), _set(path, WRONG[value]))
                for value in WRONG]
    for path, names in ((("parameters", QKV), (QKV,)), (("files", MODEL0), (MODEL0,)),
                        (("history", 0), ("history",))):
        out.append(Damage(f"manifest.json:{label(path)}-deleted", "item", names, _set(path)))
        out += [Damage(f"manifest.json:{label(path)}={value}", "item", (label(path),),
                       _set(path, WRONG[value])) for value in WRONG]
    # another family: its parameters are not the model's (export once raised ValueError)
    out.append(Damage("manifest.json:model.family=llama", "item", ("family",),
                      _set(("model", "family"), "llama")))
    return out


SECTIONS = ((), ("model",), ("optimizer",), ("data",), ("rng",), ("layout",), ("history", 0),
            ("history", 0, "layout"), ("parameters", QKV), ("files", MODEL0))


def _grown(size: int):
    def apply(root: Path) -> None:  # zeros after the JSON, without writing them
        os.truncate(root / STEP / MANIFEST, size)
    return apply


def _manifest_text(raw: bytes) -> list[Damage]:
    deep = b"[" * 100_000 + b"]" * 100_000
    text = raw.decode()
    steps = '"steps": 2'
    assert steps in text
    return [Damage(f"manifest.json:{what}", "manifest-text", names, apply)
            for what, names, apply in (
                ("nested-100000-deep", (MANIFEST,), _bytes(MANIFEST, deep)),
                ("nested-100000-deep-in-a-field", (MANIFEST,), _bytes(
                    MANIFEST, text.replace(steps, '"steps": ' + deep.decode()).encode())),
                ("integer-of-5000-digits", (MANIFEST,), _bytes(
                    MANIFEST, text.replace(steps, '"steps": ' + "9" * 5000).encode())),
                ("key-twice", ('"steps"',), _bytes(
                    MANIFEST, text.replace(steps, steps + ', "steps": 1').encode())),
                ("65-MiB", (MANIFEST,), _grown(65 << 20)))]


def _names(manifest: dict) -> list[Damage]:
    """File names with a path in them (``..``, ``/``) or hidden: never opened."""
    def renamed(old: str, new: str):
        def apply(root: Path) -> None:
            data = manifest_of(root)
            data["files"][new] = data["files"].pop(old)
            for info in data["parameters"].values():
                for key in ("file", "optimizer_file"):
                    info[key] = new if info[key] == old else info[key]
            if data["rng"]["file"] == old:
                data["rng"]["file"] = new
            write_manifest(root, data)
        return apply

    return [Damage(f"manifest.json:{what}", "names", (name,), apply) for what, name, apply in (
        ("files-up", f"../{STEP}/{MODEL0}", renamed(MODEL0, f"../{STEP}/{MODEL0}")),
        ("files-absolute", "/dev/zero", renamed(RNG, "/dev/zero")),
        ("files-hidden", ".model.safetensors", renamed(MODEL0, ".model.safetensors")),
        ("files-subdirectory", f"sub/{MODEL0}", renamed(MODEL0, f"sub/{MODEL0}")),
        ("parameter-file-up", f"../outside/{MODEL0}",
         _set(("parameters", QKV, "file"), f"../outside/{MODEL0}")),
        ("optimizer-file-absolute", "/etc/passwd",
         _set(("parameters", QKV, "optimizer_file"), "/etc/passwd")),
        ("rng-file-up", "..", _set(("rng", "file"), "..")))]


def _latest() -> list[Damage]:
    return [Damage(f"latest:names-{what}", "latest", (LATEST,), _bytes(LATEST, text))
            for what, text in (("up", b"../x\n"), ("absolute", b"/tmp\n"),
                               ("through-the-step", f"{STEP}/../{STEP}\n".encode()),
                               ("with-more", f"{STEP}\n../x\n".encode()))]


def _step_directory() -> list[Damage]:
    def elsewhere(listed: bool):
        def apply(root: Path) -> None:
            outside = root.parent / "elsewhere" / STEP
            outside.parent.mkdir()
            (root / STEP).rename(outside)
            (root / STEP).symlink_to(outside)
            if listed:
                (root / LATEST).unlink()
        return apply

    def replaced(fifo: bool):
        def apply(root: Path) -> None:
            shutil.rmtree(root / STEP)
            if fifo:
                os.mkfifo(root / STEP)
            else:
                (root / STEP).write_text("{}")
        return apply

    return [Damage(f"{STEP}:{what}", "step-directory", (STEP,), apply) for what, apply in (
        ("outside-link", elsewhere(False)), ("outside-link-listed", elsewhere(True)),
        ("file", replaced(False)), ("fifo", replaced(True)))]


def set_value(tensor: str, index: tuple, value: float):
    def edit(tensors):
        tensors[tensor][index] = value
    return edit


VALUES = ((MODEL0, QKV, (3, 17), INF), (MODEL0, QKV, (3, 17), -INF),
          (MODEL1, "head.weight", (0, 5), NAN), (OPT0, f"{QKV}.exp_avg", (1, 2), INF),
          (OPT1, "layers.1.fc1.bias.exp_avg", (5,), NAN),
          (OPT0, f"{QKV}.exp_avg_sq", (3, 17), NAN), (OPT0, f"{QKV}.exp_avg_sq", (3, 17), -0.5),
          (OPT1, "final_ln.bias.exp_avg_sq", (7,), -1e-3))


def _values() -> list[Damage]:
    return [Damage(f"{file}:{tensor}{list(index)}={value}", "values", (tensor,),
                   edit_tensors(file, set_value(tensor, index, value)))
            for file, tensor, index, value in VALUES]


def _headers() -> list[Damage]:
    def entry(name: str, key: str, value):
        def edit(header):
            header[name][key] = value(header) if callable(value) else value
        return edit

    last = "position.weight"  # the last tensor of model-00000: offsets past the end
    ln = "layers.0.ln1"
    cases = {
        "offsets-overlap": entry(f"{ln}.bias", "data_offsets",
                                 lambda h: h[f"{ln}.weight"]["data_offsets"]),
        "offsets-past-end": entry(last, "data_offsets",
                                  lambda h: [o + 4 for o in h[last]["data_offsets"]]),
        "offsets-reversed": entry(QKV, "data_offsets", lambda h: h[QKV]["data_offsets"][::-1]),
        "offsets-negative": entry(QKV, "data_offsets",
                                  lambda h: [-o for o in h[QKV]["data_offsets"]]),
        "offsets-boolean": entry(f"{ln}.bias", "data_offsets", [False, True]),
        "dtype-f16": entry(QKV, "dtype", "F16"), "dtype-i32": entry(QKV, "dtype", "I32"),
        "dtype-unknown": entry(QKV, "dtype", "F33"),
        "shape-transposed": entry(QKV, "shape", [48, 16]),
        "shape-wrong-size": entry(QKV, "shape", [16, 47]),
        "shape-negative": entry(QKV, "shape", [-16, -48]),
        "shape-floats": entry(QKV, "shape", [16.0, 48.0]),
        "length-past-end": lambda h: (json.dumps(h).encode(), 1 << 30),
        "length-one-short": lambda h: (json.dumps(h).encode(), len(json.dumps(h)) - 1),
        "metadata-number": lambda h: h["__metadata__"].update(format=1),
        "tensor-twice": lambda h: (f'{{"{QKV}": {json.dumps(h[QKV])}, '
                                   + json.dumps(h)[1:]).encode(),
        "entry-extra-field": entry(QKV, "extra", 1),
    }
    return [Damage(f"{MODEL0}:header-{what}", "header", (MODEL0,), _edit_header(MODEL0, edit))
            for what, edit in cases.items()]


def _tensor_extra() -> list[Damage]:
    """A tensor beside the listed ones, in a file the manifest signs as it is."""
    def add(tensors):
        tensors["layers.9.qkv.weight"] = torch.zeros(16, 48)
    return [Damage(f"{MODEL0}:tensor-extra", "values", ("layers.9.qkv.weight",),
                   edit_tensors(MODEL0, add))]


def _rng() -> list[Damage]:
    state = torch.get_rng_state()
    cases = {"no-tensor": {}, "f32": {"torch.cpu": state.view(torch.float32)},
             "short": {"torch.cpu": state[:100].clone()},
             "2-d": {"torch.cpu": state.view(2, -1)},
             "zeros": {"torch.cpu": torch.zeros_like(state)},
             "other-name": {"torch.cuda": state},
             "tensor-extra": {"torch.cpu": state, "torch.cuda": state.clone()}}
    return [Damage(f"{RNG}:{what}", "rng", (RNG,),
                   edit_tensors(RNG, lambda _, t=tensors: t))
            for what, tensors in cases.items()]


def _index() -> list[Damage]:
    def edit(file: str, change):
        def apply(root: Path) -> None:
            path = root / STEP / file
            index = json.loads(path.read_text())
            change(index)
            path.write_text(json.dumps(index))
            _resign(root, file)
        return apply

    model, optimizer = fmt.MODEL_INDEX, fmt.OPTIMIZER_INDEX
    cases = (
        (model, "up", lambda i: i["weight_map"].update({QKV: f"../outside/{MODEL0}"})),
        (model, "tensor-missing", lambda i: i["weight_map"].pop(QKV)),
        (optimizer, "tensor-extra", lambda i: i["weight_map"].update({"x.exp_avg": OPT0})),
        (model, "total-size", lambda i: i["metadata"].update(total_size=1)),
        (optimizer, "weight-map-list", lambda i: i.update(weight_map=[])))
    return [Damage(f"{file}:{what}", "index", (file,), edit(file, change))
            for file, what, change in cases]


# The damage the issue names, and one of every kind: also through the real commands.
CLI = {"model-00000-of-00002.safetensors:layers.0.qkv.weight[3, 17]=inf",
       "optimizer-00000-of-00002.safetensors:layers.0.qkv.weight.exp_avg_sq[3, 17]=nan",
       "optimizer-00000-of-00002.safetensors:layers.0.qkv.weight.exp_avg_sq[3, 17]=-0.5",
       "manifest.json:optimizer.steps=string", "rng.safetensors:no-tensor",
       "manifest.json:nested-100000-deep", 'manifest.json:parameters["layers.0.qkv.weight"]'
       '=number', f"{MODEL0}:outside-link", f"{STEP}:outside-link",
       f"{fmt.MODEL_INDEX}:up", "manifest.json:files-up", "latest:names-up",
       "manifest.json:missing", f"{OPT1}:cut-in-half-resigned", "manifest.json:model.layers=number",
       "manifest.json:optimizer.lr=nan", "manifest.json:step=huge",
       "manifest.json:optimizer.betas[0]=infinity", "manifest.json:layout.extra",
       "manifest.json:integer-of-5000-digits", f"{MODEL0}:header-offsets-overlap",
       "rng.safetensors:zeros", f"{MODEL1}:fifo", f"{fmt.OPTIMIZER_INDEX}:tensor-extra",
       "manifest.json:model.family=llama"}


def damages(pristine: Path) -> list[Damage]:
    """The corpus, generated from the checkpoint directory ``pristine``."""
    step = pristine / STEP
    document = json.loads((step / MANIFEST).read_text())
    out: list[Damage] = []
    for name in (MANIFEST, *HASHED, LATEST):
        out += _whole_file(name, _path(pristine, name).read_bytes())
    for path in SECTIONS:
        out += _fields(document, path)
    out += _items(document)
    out += [Damage(f"manifest.json:{label(path + ('extra',))}", "unknown-field",
                   (label(path + ("extra",)),), _set(path + ("extra",), 1))
            for path in SECTIONS]
    out += _manifest_text((step / MANIFEST).read_bytes())
    out += _names(document) + _latest() + _step_directory() + _values() + _tensor_extra() + _headers()
    out += _rng() + _index()
    return [Damage(d.name, d.kind, d.names, d.apply, d.name in CLI) for d in out]


COUNTS = {"whole-file": 93, "resigned-file": 35, "field": 743, "item": 81,
          "unknown-field": 10, "manifest-text": 5, "names": 7, "latest": 4,
          "step-directory": 4, "values": 9, "header": 17, "rng": 7, "index": 5}


def nodes(value, path: tuple = ()):
    """The path of every value inside a JSON document, itself excluded."""
    items = value.items() if isinstance(value, dict) else \
        enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        yield path + (key,)
        yield from nodes(item, path + (key,))


def value_at(document, path: tuple):
    for key in path:
        document = document[key]
    return document
