"""planc's safetensors writer (planc.runtime.checkpoint.tensor_file): the bytes the
safetensors library writes, from the tensors' memory, with their sha256."""

from __future__ import annotations

import hashlib
import json
import struct

import pytest

torch = pytest.importorskip("torch")
safetensors_torch = pytest.importorskip("safetensors.torch")

from planc.runtime.checkpoint.tensor_file import write_tensor_file  # noqa: E402


def header(data: bytes) -> dict:
    return json.loads(data[8:8 + struct.unpack("<Q", data[:8])[0]])


def body(data: bytes) -> bytes:
    return data[8 + struct.unpack("<Q", data[:8])[0]:]


def tensors() -> dict:
    generator = torch.Generator().manual_seed(0)
    return {
        "layers.0.qkv.weight": torch.randn(48, 16, generator=generator),
        "embedding.weight": torch.randn(64, 16, generator=generator),
        "layers.0.ln.bias": torch.zeros(16),
        "half": torch.randn(5, 3, generator=generator).to(torch.float16),
        "brain": torch.randn(7, generator=generator).to(torch.bfloat16),
        "rng": torch.randint(0, 255, (9,), dtype=torch.uint8, generator=generator),
        "steps": torch.tensor(3, dtype=torch.int64),  # 0-dimensional
        "empty": torch.zeros(0, 4),
        "wide": torch.randn(3, generator=generator, dtype=torch.float64),
        "flags": torch.tensor([True, False]),
    }


def test_the_file_is_what_safetensors_writes(tmp_path):
    metadata = {"format": "pt", "planc": "planc-checkpoint", "step": "4", "stage": "1"}
    written = write_tensor_file(tmp_path / "t.safetensors", tensors(), metadata)
    data = (tmp_path / "t.safetensors").read_bytes()
    theirs = safetensors_torch.save(tensors(), metadata)
    # the same header (the library's metadata comes in its hash map's order) and data
    assert header(data) == header(theirs) and len(data) == len(theirs)
    assert body(data) == body(theirs)
    assert written == {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    loaded = safetensors_torch.load_file(tmp_path / "t.safetensors")
    assert loaded.keys() == tensors().keys()
    assert all(torch.equal(loaded[name], tensor) for name, tensor in tensors().items())
    assert [p.name for p in tmp_path.iterdir()] == ["t.safetensors"]  # no temporary left


def test_a_view_that_is_not_contiguous_is_written_as_its_values(tmp_path):
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    write_tensor_file(tmp_path / "t.safetensors", {"t": base.t()}, {})
    assert (tmp_path / "t.safetensors").read_bytes() == \
        safetensors_torch.save({"t": base.t().contiguous()})  # no metadata: every byte


def test_the_tensors_come_in_the_librarys_order(tmp_path):
    write_tensor_file(tmp_path / "t.safetensors", tensors(), {})
    data = (tmp_path / "t.safetensors").read_bytes()
    assert data == safetensors_torch.save(tensors())
    assert list(header(data)) == ["steps", "wide", "embedding.weight", "empty",
                                  "layers.0.ln.bias", "layers.0.qkv.weight", "brain", "half",
                                  "rng", "flags"]
