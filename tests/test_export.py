"""planc export: Chakra execution traces, read back by a protobuf decoder written here
from et_def.proto (independently of planc's encoder)."""

from __future__ import annotations

import struct
from collections import Counter

from planc.compile import compile_plan
from planc.lang import load_file
from planc.program.expansion import expand
from tests.conftest import PLANS


def _varint(data: bytes, at: int) -> tuple[int, int]:
    shift = value = 0
    while True:
        byte = data[at]
        at += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return value, at


def _fields(message: bytes) -> list[tuple[int, object]]:
    """(field number, value) of every field: ints, bytes or doubles by wire type."""
    out, at = [], 0
    while at < len(message):
        key, at = _varint(message, at)
        field, wire = key >> 3, key & 7
        if wire == 0:
            value, at = _varint(message, at)
        elif wire == 1:
            value, at = struct.unpack("<d", message[at:at + 8])[0], at + 8
        elif wire == 2:
            size, at = _varint(message, at)
            value, at = message[at:at + size], at + size
        else:
            raise AssertionError(f"unexpected wire type {wire}")
        out.append((field, value))
    return out


def _messages(data: bytes) -> list[bytes]:
    out, at = [], 0
    while at < len(data):
        size, at = _varint(data, at)
        out.append(data[at:at + size])
        at += size
    assert at == len(data)
    return out


def _attributes(fields) -> dict:
    attrs = {}
    for field, raw in fields:
        if field != 10:
            continue
        inner = dict(_fields(raw))
        name = inner.pop(1).decode()
        (number, value), = inner.items()
        attrs[name] = value.decode() if number == 29 else value
    return attrs


def test_chakra_traces_read_back(tmp_path, run_planc):
    done = run_planc("export", PLANS / "gpt-tiny.plan", "-o", tmp_path)
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["planc.0.et", "planc.2.et"]
    build = compile_plan(load_file(PLANS / "gpt-tiny.plan").plan)
    for rank, stage in ((0, 0), (2, 1)):
        metadata, *nodes = _messages((tmp_path / f"planc.{rank}.et").read_bytes())
        meta = dict(_fields(metadata))
        assert meta[1] == b"0.0.4"
        assert _attributes([(10, raw) for f, raw in _fields(metadata) if f == 2]) == {
            "schema": "planc", "generator": "planc export --format chakra", "plan": "gpt_tiny",
        "rank": rank, "stage": stage, "world": 8}
        program = next(p for n, p in build.programs.items()
                       if build.table.stages.get(n) == stage)
        work = [i for i in expand(program) if i.op not in ("record", "wait", "sync")]
        decoded = [dict((f, v) for f, v in _fields(n) if f != 10 and f != 4) | {
            "deps": [d for f, raw in _fields(n) if f == 4
                     for d in _packed(raw)], "attr": _attributes(_fields(n))} for n in nodes]
        assert len(decoded) == len(work)  # gpt-tiny has no ring shifts: one node each
        assert [d.get(1, 0) for d in decoded] == list(range(len(decoded)))
        types = Counter(d[3] for d in decoded)
        assert types[4] == sum(i.op == "compute" for i in work)
        assert types[5] == sum(i.op == "send" for i in work)
        assert types[6] == sum(i.op == "recv" for i in work)
        assert types[7] == sum(i.op not in ("compute", "send", "recv") for i in work)
        assert all(dep < d.get(1, 0) for d in decoded for dep in d["deps"])
        assert all(d[7] >= 1 for d in decoded)  # duration_micros
        sends = [d for d in decoded if d[3] == 5]
        peer = 2 if rank == 0 else 0
        assert all(d["attr"]["comm_src"] == rank and d["attr"]["comm_dst"] == peer
                   for d in sends)
        collectives = [d for d in decoded if d[3] == 7]
        assert {d["attr"]["pg_name"] for d in collectives} >= {"tp", "dp_cp"}


def _packed(raw: bytes) -> list[int]:
    out, at = [], 0
    while at < len(raw):
        value, at = _varint(raw, at)
        out.append(value)
    return out


def test_a_prefix_with_a_control_character_is_refused(tmp_path, run_planc):
    """A newline would start every trace's file name (it was written so)."""
    out = tmp_path / "out"
    done = run_planc("export", PLANS / "gpt-tiny.plan", "-o", out, "--prefix", "\nx")
    assert (done.returncode, done.stderr) == (2, (
        "planc: error: --prefix '\\nx': a file name's start, without '/' or control "
        "characters and not starting with '.'\n"))
    assert not out.exists()


def test_a_prefix_too_long_for_a_trace_name_is_refused_before_anything_is_written(tmp_path,
                                                                                    run_planc):
    """A trace is PREFIX.RANK.et, for ranks up to 524,287: a prefix of 250 bytes stopped
    the export at its first rank of two digits, with the traces of the others written."""
    out = tmp_path / "out"
    done = run_planc("export", PLANS / "gpt-tiny.plan", "-o", out, "--prefix", "p" * 246)
    assert (done.returncode, done.stderr) == (2, (
        "planc: error: --prefix is 246 bytes; a trace's file name (PREFIX.RANK.et) holds at "
        "most 255, so the prefix at most 245\n"))
    assert not out.exists()
    done = run_planc("export", PLANS / "gpt-tiny.plan", "-o", out, "--prefix", "p" * 245)
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in out.iterdir()) == [f"{'p' * 245}.{r}.et" for r in (0, 2)]
