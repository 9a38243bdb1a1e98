"""Token files (planc/runtime/engine/data.py, docs/data.md): both widths read the batches an
independent reading of the format predicts, the header is detected and checked, a token
at or above vocab is named with its position, paths that are not regular files fail at
once, the chunked scan agrees with a whole-file scan, memory stays bounded, and a run
trains on uint32 tokens. The corpus tool is deterministic and lossless."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import random
import re
import struct
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from planc.lang import load_file, load_text
from planc.runtime.engine.data import (CHUNK_BYTES, HEADER_BYTES, DataError, DataMissing,
                                check_file, header, largest_token, open_tokens, write_tokens)
from tests.conftest import ROOT

ENGINES = ["python", pytest.param("torch", marks=pytest.mark.skipif(
    importlib.util.find_spec("torch") is None, reason="needs torch"))]


def raw16(path: Path, ids: list[int]) -> Path:
    path.write_bytes(struct.pack(f"<{len(ids)}H", *ids))
    return path


def with_header(path: Path, ids: list[int], width: int) -> Path:
    """The format written out by hand from docs/data.md, not by write_tokens."""
    code = {2: "H", 4: "I"}[width]
    path.write_bytes(b"PLANCTOK" + struct.pack("<II", 1, width) + bytes(16)
                     + struct.pack(f"<{len(ids)}{code}", *ids))
    return path


def plan_for(path: Path, vocab: int, seq: int = 7, batch: int = 4, extra: str = ""):
    text = (f"plan d {{\n  model gpt {{ layers = 1; hidden = 8; heads = 2; vocab = {vocab}; "
            f"seq = {seq}; batch = {batch} }}{extra}\n  train {{ data = \"{path}\" }}\n}}\n")
    loaded = load_text(text)
    assert loaded.ok, [d.message for d in loaded.diagnostics]
    return loaded.plan


def expected_batch(ids: list[int], seq: int, batch: int, step: int) -> list[list[int]]:
    """docs/language.md: sample j starts at token j (seq + 1), wrapping over the
    count - seq places a whole sample can start."""
    sample = seq + 1
    starts = len(ids) - sample + 1
    rows = []
    for j in range(step * batch, (step + 1) * batch):
        start = (j * sample) % starts
        rows.append(ids[start:start + sample])
    return rows


# --- the format --------------------------------------------------------------------


def test_the_header_is_32_bytes_magic_version_width_and_zeros():
    assert header(4) == b"PLANCTOK\x01\x00\x00\x00\x04\x00\x00\x00" + bytes(16)
    assert header(2)[12:16] == b"\x02\x00\x00\x00"
    assert len(header(2)) == HEADER_BYTES == 32
    with pytest.raises(ValueError):
        header(3)


def test_write_tokens_writes_what_the_format_says(tmp_path):
    ids = [0, 1, 65535, 65536, 128255, 2**32 - 1]
    write_tokens(tmp_path / "a.tokens", ids, 4)
    assert (tmp_path / "a.tokens").read_bytes() == with_header(tmp_path / "b", ids, 4).read_bytes()


@pytest.mark.parametrize("kind", ["raw16", "header16", "header32"])
def test_both_widths_read_the_batches_an_independent_reader_predicts(kind, tmp_path):
    torch = pytest.importorskip("torch")
    from planc.runtime.engine.data import batch_tokens

    rng = random.Random(kind)
    limit = 70000 if kind == "header32" else 65536
    ids = [rng.randrange(limit) for _ in range(101)]
    ids[:3] = [limit - 1, 0, 40000]  # the top bit of either width set
    path = tmp_path / "t.bin"
    if kind == "raw16":
        raw16(path, ids)
    else:
        with_header(path, ids, 2 if kind == "header16" else 4)
    plan = plan_for(path, vocab=limit)
    fd, tokens = open_tokens(str(path))
    os.close(fd)
    assert (tokens.offset, tokens.width, tokens.count) == (
        (0, 2, 101) if kind == "raw16" else (32, 2 if kind == "header16" else 4, 101))
    for step in range(7):  # 7 steps x 4 samples x 8 tokens: wraps around 94 starts
        got = batch_tokens(plan, step)
        assert got.dtype == torch.int64 and got.shape == (4, 8)
        assert got.tolist() == expected_batch(ids, 7, 4, step)


def test_a_raw_file_whose_first_bytes_differ_from_the_magic_stays_uint16(tmp_path):
    ids = [ord("P") | ord("L") << 8, ord("A") | ord("N") << 8, 7, 8]  # "PLAN" then not "CTOK"
    fd, tokens = open_tokens(str(raw16(tmp_path / "t.bin", ids)))
    os.close(fd)
    assert (tokens.offset, tokens.width, tokens.count) == (0, 2, 4)


@pytest.mark.parametrize("content, message", [
    (b"PLANCTOK\x01\x00", ("begins with the PLANCTOK header but is only 10 bytes long; the "
                           "header alone is 32")),
    (b"PLANCTOK" + struct.pack("<II", 2, 4) + bytes(16),
     "has a PLANCTOK header of version 2; this planc reads version 1"),
    (b"PLANCTOK" + struct.pack("<II", 1, 8) + bytes(16),
     "has a PLANCTOK header with a token width of 8 bytes; expected 2 (uint16) or 4 (uint32)"),
    (b"PLANCTOK" + struct.pack("<II", 1, 4) + b"\x01" + bytes(15),
     "has a PLANCTOK header whose reserved bytes 16..31 are not zero"),
    (header(4) + bytes(10), ("holds 10 bytes after its header, not a whole number of "
                             "uint32 tokens (4 bytes each)")),
    (bytes(17), "has an odd size (17 bytes); expected little-endian uint16 tokens"),
])
def test_a_bad_header_or_size_is_refused_with_an_exact_message(content, message, tmp_path):
    path = tmp_path / "t.bin"
    path.write_bytes(content)
    with pytest.raises(DataError) as caught:
        check_file(str(path), "'t.bin'")
    assert str(caught.value) == f"data file 't.bin' {message}"


# --- validation --------------------------------------------------------------------


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("width", [2, 4])
def test_a_token_at_or_above_vocab_is_named_with_its_position(width, engine, tmp_path):
    ids = [5] * 100
    ids[61] = ids[90] = 1000  # the first occurrence of the largest id is reported
    ids[30] = 999
    path = with_header(tmp_path / "t.tokens", ids, width)
    with pytest.raises(DataError) as caught:
        check_file(str(path), "'t.tokens'", seq=7, vocab=1000, chunk_bytes=64, engine=engine)
    assert str(caught.value) == ("data file 't.tokens' holds token id 1000 (token 61 of the "
                                 "file), not below vocab = 1000")
    check_file(str(path), seq=7, vocab=1001, chunk_bytes=64, engine=engine)
    with pytest.raises(DataError) as caught:
        check_file(str(path), "'t.tokens'", seq=100, vocab=1001)
    assert str(caught.value) == ("data file 't.tokens' holds 100 tokens, fewer than one "
                                 "sample (seq + 1 = 101)")


def test_planc_check_and_run_name_the_token_the_same_way(tmp_path):
    from planc.runtime.engine.data import data_problem

    ids = list(range(50))
    ids[44] = 70000
    with_header(tmp_path / "tokens.bin", ids, 4)
    plan = tmp_path / "d.plan"
    plan.write_text('plan d {\n  model gpt { layers = 1; hidden = 8; heads = 2; vocab = 512; '
                    'seq = 7; batch = 4 }\n  train { data = "tokens.bin" }\n}\n')
    loaded = load_file(plan)
    assert [(d.span.line, d.span.column, d.message) for d in loaded.diagnostics] == [
        (3, 18, ("data file 'tokens.bin' holds token id 70000 (token 44 of the file), not "
                 "below vocab = 512"))]
    ids[44] = 7
    with_header(tmp_path / "tokens.bin", ids, 4)
    checked = load_file(plan).plan
    ids[44] = 70000
    with_header(tmp_path / "tokens.bin", ids, 4)  # changed after the check
    assert data_problem(checked, chunk_bytes=16) == (
        f"data file {tmp_path / 'tokens.bin'} holds token id 70000 (token 44 of the file), "
        f"not below vocab = 512")


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("width", [2, 4])
def test_the_chunked_scan_agrees_with_a_whole_file_scan(width, engine, tmp_path):
    rng = random.Random(width)
    top = (1 << (8 * width)) - 1
    for trial in range(12):
        count = rng.randrange(1, 3000)
        ids = [rng.randrange(top + 1) if rng.random() < 0.5 else rng.randrange(300)
               for _ in range(count)]
        if trial % 3 == 0:  # ties: the largest id in several chunks
            for at in rng.sample(range(count), min(count, 4)):
                ids[at] = top
        if trial % 3 == 1:  # all below 2^15: the signed fast path of torch
            ids = [i % 30000 for i in ids]
        path = with_header(tmp_path / f"{trial}.tokens", ids, width)
        whole = (max(ids), ids.index(max(ids)))
        fd, tokens = open_tokens(str(path))
        try:
            for chunk in (width, 6, 64, 1000, 4096, CHUNK_BYTES):  # 6: rounded down to width
                assert largest_token(fd, tokens, chunk, engine) == whole, (trial, chunk)
        finally:
            os.close(fd)


def test_a_raw_uint16_file_is_scanned_like_a_headed_one(tmp_path):
    ids = [random.Random(1).randrange(65536) for _ in range(5000)]
    fd, tokens = open_tokens(str(raw16(tmp_path / "t.bin", ids)))
    try:
        assert largest_token(fd, tokens, 100, "python") == (max(ids), ids.index(max(ids)))
    finally:
        os.close(fd)


def test_check_and_run_scan_only_small_files_whole(tmp_path, monkeypatch):
    """A file over the limit is left to the steps that read it (tests/test_data_order.py)."""
    from planc.runtime.engine.data import check_data, data_problem

    check = sys.modules["planc.lang.data_check"]

    ids = [1] * 40 + [900]
    raw16(tmp_path / "tokens.bin", ids)
    plan = tmp_path / "d.plan"
    plan.write_text('plan d {\n  model gpt { layers = 1; hidden = 8; heads = 2; vocab = 512; '
                    'seq = 7; batch = 4 }\n  train { data = "tokens.bin" }\n}\n')
    monkeypatch.setattr(check, "DATA_SCAN_LIMIT", 64)
    loaded = load_file(plan)
    assert loaded.ok and loaded.diagnostics == ()
    assert data_problem(loaded.plan) == (f"data file {tmp_path / 'tokens.bin'} holds token id "
                                         f"900 (token 40 of the file), not below vocab = 512")
    identity = check_data(loaded.plan, scan_limit=64)  # the header and the size only
    assert identity is not None and identity.size == 82


# --- paths that are not regular files ------------------------------------------------


@pytest.fixture
def odd_paths(tmp_path) -> dict[str, tuple[str, str]]:
    """name -> (path, what check says it is)."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    (tmp_path / "loop-a").symlink_to(tmp_path / "loop-b")
    (tmp_path / "loop-b").symlink_to(tmp_path / "loop-a")
    (tmp_path / "dir").mkdir()
    paths = {"fifo": (str(fifo), "is a named pipe (FIFO), not a regular file"),
             "loop": (str(tmp_path / "loop-a"), "is a loop of symbolic links"),
             "dir": (str(tmp_path / "dir"), "is a directory, not a regular file")}
    if os.path.exists("/dev/zero"):
        paths["zero"] = ("/dev/zero", "is a character device, not a regular file")
    return paths


def test_fifos_devices_directories_and_link_loops_fail_at_once(odd_paths, run_planc, tmp_path):
    """In fresh processes under a timeout: opening a FIFO for reading waits for a writer
    and /dev/zero never ends, so a wrong path shows up as a timeout, not a hang."""
    script = textwrap.dedent("""
        import dataclasses, json, sys
        from planc.lang import load_text
        from planc.runtime.engine.data import DataError, batch_tokens, check_file, data_problem
        out = {}
        for name, path in json.loads(sys.argv[1]).items():
            try:
                check_file(path, seq=7, vocab=512)
                out[name] = ["accepted"]
            except DataError as exc:
                out[name] = [str(exc)]
            plan = load_text('plan d { model gpt { layers = 1; hidden = 8; heads = 2; '
                             'vocab = 512; seq = 7; batch = 4 } }').plan
            plan = dataclasses.replace(plan, train=dataclasses.replace(plan.train, data=path))
            out[name].append(data_problem(plan))
            try:
                batch_tokens(plan, 0)
            except DataError as exc:
                out[name].append(str(exc))
        print(json.dumps(out))
    """)
    done = subprocess.run([sys.executable, "-c", script,
                           json.dumps({k: p for k, (p, _) in odd_paths.items()})],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout)
    for name, (path, what) in odd_paths.items():
        message = f"data path {path} {what}"
        assert found[name] == [message, message, message], name
    for name, (path, what) in odd_paths.items():
        plan = tmp_path / f"{name}.plan"
        plan.write_text('plan d {\n  model gpt { layers = 1; hidden = 8; heads = 2; vocab = 512; '
                        f'seq = 7; batch = 4 }}\n  train {{ data = "{path}" }}\n}}\n')
        result = run_planc("check", plan, timeout=60)
        assert result.returncode == 1
        assert f"3:18: error: data path '{path}' {what}" in result.stderr, result.stderr


def test_a_missing_file_is_a_warning_for_check_and_an_error_for_run(tmp_path):
    with pytest.raises(DataMissing) as caught:
        check_file(str(tmp_path / "none.bin"), "'none.bin'")
    assert str(caught.value) == "data file 'none.bin' does not exist"
    (tmp_path / "dangling").symlink_to(tmp_path / "none.bin")
    with pytest.raises(DataMissing):
        check_file(str(tmp_path / "dangling"))


# --- bounded work ------------------------------------------------------------------


def test_a_step_reads_only_its_samples_and_a_scan_holds_one_chunk(tmp_path):
    """A sparse 64 GiB file: one batch comes back at once (reading it all would take
    many seconds), and a whole-file scan of 256 MiB raises the peak RSS by about one
    chunk, not by the file's size (the torch.from_file scan it replaces took 5x)."""
    pytest.importorskip("torch")
    huge, big = tmp_path / "huge.bin", tmp_path / "big.bin"
    for path, size in ((huge, 64 << 30), (big, 256 << 20)):
        with open(path, "wb") as f:
            f.write(header(4))
            f.truncate(HEADER_BYTES + size)
    script = textwrap.dedent("""
        import json, resource, sys, time
        import torch
        from planc.lang import load_text
        from planc.runtime.engine.data import batch_tokens, data_problem
        def plan(path):
            return load_text('plan d { model gpt { layers = 1; hidden = 8; heads = 2; '
                             'vocab = 512; seq = 7; batch = 4 } train { data = "%s" } }'
                             % path).plan
        start = time.perf_counter()
        ok = batch_tokens(plan(sys.argv[1]), 10**9).tolist() == [[0] * 8] * 4
        batch_s = time.perf_counter() - start
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        problem = data_problem(plan(sys.argv[2]))
        grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
        print(json.dumps([ok, batch_s, problem, grown * 1024]))
    """)
    done = subprocess.run([sys.executable, "-c", script, str(huge), str(big)],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    ok, batch_s, problem, grown = json.loads(done.stdout)
    assert ok and problem is None
    assert batch_s < 5
    assert grown < 64 << 20, f"the scan raised the peak RSS by {grown >> 20} MiB"


# --- a file that changes under a run (issue 20) ----------------------------------------


def _pinned(tmp_path, ids=None):
    """A token file, the plan reading it, and the file's identity as planc run checks it."""
    from planc.runtime.engine.data import check_data

    path = with_header(tmp_path / "t.tokens", ids or list(range(200)), 4)
    plan = plan_for(path, vocab=512)
    identity = check_data(plan)
    info = os.stat(path)
    assert (identity.device, identity.inode, identity.size, identity.mtime_ns) == (
        info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns)
    return path, plan, identity


def test_a_pinned_file_that_did_not_change_reads_as_before(tmp_path):
    pytest.importorskip("torch")
    from planc.runtime.engine.data import Identity, batch_tokens

    path, plan, identity = _pinned(tmp_path)
    assert Identity.parse(str(identity)) == identity
    for step in range(3):
        assert batch_tokens(plan, step, identity).tolist() == \
            batch_tokens(plan, step).tolist() == expected_batch(list(range(200)), 7, 4, step)


@pytest.mark.parametrize("change, detail", [
    ("truncated", "832 bytes when the run began, 256"),
    ("grown", "832 bytes when the run began, 836"),
    ("rewritten", "rewritten in place"),
    ("replaced", "replaced by another file"),
    ("removed", "removed"),
    ("odd-size", "832 bytes when the run began, 831"),
])
def test_a_pinned_file_that_changed_stops_the_step_that_reads_it(tmp_path, change, detail):
    """Truncated to 7 samples (what the issue's run trained on without a word), grown,
    rewritten in place with the same size (another modification time), replaced by a
    rename, removed, or cut to a size no token file has: each is named, with the step."""
    pytest.importorskip("torch")
    from planc.runtime.engine.data import DataChanged, batch_tokens

    path, plan, identity = _pinned(tmp_path)
    if change == "truncated":
        os.truncate(path, HEADER_BYTES + 7 * 8 * 4)  # 7 samples of seq + 1 = 8 tokens
    elif change == "grown":
        with open(path, "ab") as out:
            out.write(bytes(4))
    elif change == "rewritten":
        with_header(path, [5] * 200, 4)  # the same size; ids that would train quietly
        os.utime(path, ns=(identity.mtime_ns + 10**9, identity.mtime_ns + 10**9))
    elif change == "replaced":
        with_header(tmp_path / "new.tokens", list(range(200)), 4)  # the same bytes
        os.replace(tmp_path / "new.tokens", path)
    elif change == "removed":
        path.unlink()
    else:
        os.truncate(path, identity.size - 1)
    with pytest.raises(DataChanged) as caught:
        batch_tokens(plan, 3, identity)
    assert str(caught.value) == (f"data file {path} changed during the run ({detail} at step "
                                 f"3); nothing from step 3 on was trained or checkpointed")


def test_an_evaluation_batch_names_its_evaluation_not_a_step(tmp_path):
    """An evaluation reads batch j of eval_data after training step k (counted from 1, as
    the progress line and the checkpoints count): a change of the file, or an id it
    cannot train on, names both, and says that steps 1 to k were trained."""
    pytest.importorskip("torch")
    from planc.runtime.engine.data import DataChanged, batch_tokens

    path, plan, identity = _pinned(tmp_path)
    with open(path, "r+b") as out:  # rewritten in place: the same size, another time
        out.seek(HEADER_BYTES)
        out.write(struct.pack("<8I", *[5] * 8))
    os.utime(path, ns=(identity.mtime_ns + 10**9, identity.mtime_ns + 10**9))
    with pytest.raises(DataChanged) as caught:
        batch_tokens(plan, 1, identity, evaluation=600)
    assert str(caught.value) == (
        f"eval_data file {path} changed during the run (rewritten in place when the "
        f"evaluation after step 600 read its batch 1); steps 1 to 600 were trained and the "
        f"checkpoints before step 600 written as asked; nothing from step 600's evaluation "
        f"on was recorded or checkpointed")
    high = with_header(tmp_path / "high.tokens", [3] * 200, 4)
    plan = plan_for(high, vocab=512)
    with_header(high, [3] * 32 + [600] + [3] * 167, 4)  # in batch 1's first sample
    with pytest.raises(DataError) as caught:
        batch_tokens(plan, 1, evaluation=600)
    assert str(caught.value) == (
        f"data file {high} holds token id 600 (token 32 of the file, position 0 of sample 4, "
        f"read by batch 1 of the evaluation after step 600), not below vocab = 512")


@pytest.mark.slow
def test_eval_data_rewritten_under_a_running_job_names_the_evaluation(tmp_path):
    """The issue's run: eval_data rewritten in place while a job trained and evaluated
    after every step stopped it "at step 0", the evaluation's batch, saying nothing was
    trained. The message names the evaluation, its batch and the step after which it ran;
    every checkpoint and metrics record before that evaluation is there, none after."""
    pytest.importorskip("torch")
    evaluated = tmp_path / "e.tokens"
    write_tokens(evaluated, [random.Random(34).randrange(64) for _ in range(2000)], 4)
    (tmp_path / "d.plan").write_text(
        "plan d {\n  model gpt { layers = 1; hidden = 16; heads = 2; vocab = 64; seq = 7; "
        "batch = 4 }\n  train { steps = 500; optimizer = sgd(lr = 0.1); eval_every = 1; "
        "eval_batches = 2; eval_data = \"e.tokens\" }\n}\n")
    checkpoints, metrics = tmp_path / "ckpt", tmp_path / "m.jsonl"
    process = subprocess.Popen(
        [sys.executable, "-m", "planc", "run", str(tmp_path / "d.plan"), "-o",
         str(tmp_path / "b"), "--checkpoint-dir", str(checkpoints), "--checkpoint-every", "1",
         "--metrics", str(metrics)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while not (checkpoints / "step-000001").is_dir():  # evaluating: rewrite it now
            assert process.poll() is None, process.communicate()
            assert time.monotonic() < deadline, "no checkpoint after 300 s"
            time.sleep(0.01)
        began = evaluated.stat().st_mtime_ns
        with open(evaluated, "r+b") as out:  # the same size: only the time tells
            out.seek(HEADER_BYTES)
            out.write(bytes(4 * 100))
        os.utime(evaluated, ns=(began + 10**9, began + 10**9))
        _, err = process.communicate(timeout=300)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert process.returncode == 1, err[-3000:]
    found = re.findall(r"evaluation after step (\d+) read its batch (\d+)\)", err)
    assert found, err[-3000:]
    step, batch = (int(n) for n in found[0])
    message = (f"planc: error: eval_data file {evaluated} changed during the run (rewritten in "
               f"place when the evaluation after step {step} read its batch {batch}); steps 1 "
               f"to {step} were trained and the checkpoints before step {step} written as "
               f"asked; nothing from step {step}'s evaluation on was recorded or checkpointed")
    reports = [line.split("] ", 1)[1] for line in err.splitlines()
               if line.startswith("[rank ") and "planc: error:" in line]
    assert reports == [message], err[-3000:]
    assert "Traceback" not in err
    assert 2 <= step < 500 and batch in (0, 1)
    written = sorted(int(p.name[5:]) for p in checkpoints.glob("step-*"))
    assert written == list(range(1, step)), (step, written)
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(step - 1))  # 0-based: steps 1..k-1
    assert all("eval_loss" in r for r in records)


@pytest.mark.slow
def test_a_token_file_truncated_under_a_running_job_stops_it(tmp_path):
    """Issue 20: a token file truncated to 7 samples while a job ran, and training went
    on without an error. Now the step that reads it stops the run, with the file and the
    step, before it trains; no checkpoint after the change exists."""
    pytest.importorskip("torch")
    ids = [random.Random(20).randrange(64) for _ in range(5000)]
    tokens = tmp_path / "t.tokens"
    write_tokens(tokens, ids, 4)
    size = tokens.stat().st_size
    (tmp_path / "d.plan").write_text(
        "plan d {\n  model gpt { layers = 1; hidden = 16; heads = 2; vocab = 64; seq = 7; "
        "batch = 4 }\n  mesh { dp = 2 }\n  train { steps = 500; optimizer = sgd(lr = 0.1); "
        "data = \"t.tokens\" }\n}\n")
    checkpoints = tmp_path / "ckpt"
    process = subprocess.Popen(
        [sys.executable, "-m", "planc", "run", str(tmp_path / "d.plan"), "-o",
         str(tmp_path / "b"), "--checkpoint-dir", str(checkpoints), "--checkpoint-every", "1"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while not (checkpoints / "step-000001").is_dir():  # the run is training: cut now
            assert process.poll() is None, process.communicate()
            assert time.monotonic() < deadline, "no checkpoint after 300 s"
            time.sleep(0.01)
        os.truncate(tokens, HEADER_BYTES + 7 * 8 * 4)
        _, err = process.communicate(timeout=300)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert process.returncode == 1, err[-3000:]
    found = re.findall(r"planc: error: data file .* at step (\d+)\)", err)
    assert found, err[-3000:]
    step = int(found[0])
    # the size check before a read sees the cut, or, when the cut lands between the check
    # and the read, the read that comes back short does: each names the file and the step
    seen = (f"({size} bytes when the run began, {HEADER_BYTES + 7 * 8 * 4} at step {step})",
            f"(a read of 32 bytes returned 0 at step {step})")
    messages = {f"planc: error: data file {tokens} changed during the run {what}; nothing "
                f"from step {step} on was trained or checkpointed" for what in seen}
    reports = [line.split("] ", 1)[1] for line in err.splitlines()
               if line.startswith("[rank ") and "planc: error:" in line]
    assert reports and set(reports) <= messages, err[-3000:]
    assert "Traceback" not in err
    written = sorted(int(p.name[5:]) for p in checkpoints.glob("step-*"))
    assert 1 <= step < 500 and written and max(written) <= step, (step, written)
    assert int((checkpoints / "latest").read_text().strip()[5:]) <= step


# --- a run ---------------------------------------------------------------------------


@pytest.mark.slow
def test_a_run_on_two_ranks_trains_on_uint32_tokens(tmp_path, capfd):
    """ids above 65,535 (they need uint32), two data-parallel ranks with gloo, compared
    step by step with one process (--check)."""
    pytest.importorskip("torch")
    from planc.cli import main
    from planc.runtime.engine.data import batch_tokens

    rng = random.Random(3)
    ids = [65536 + rng.randrange(64) if rng.random() < 0.3 else rng.randrange(200)
           for _ in range(1000)]
    write_tokens(tmp_path / "tokens.bin", ids, 4)
    assert batch_tokens(plan_for(tmp_path / "tokens.bin", 65600, 16), 0).max() >= 65536
    (tmp_path / "u32.plan").write_text(
        "plan u32 {\n"
        "  model gpt { layers = 2; hidden = 32; heads = 4; vocab = 65600; seq = 16; batch = 4 }\n"
        "  mesh { dp = 2 }\n"
        "  train { steps = 3; optimizer = sgd(lr = 0.5); seed = 1; data = \"tokens.bin\" }\n"
        "}\n")
    status = main(["run", str(tmp_path / "u32.plan"), "-o", str(tmp_path / "b"), "--check",
                   "--metrics", str(tmp_path / "m.jsonl")])
    err = capfd.readouterr().err
    assert status == 0, err
    losses = [json.loads(line)["loss"] for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert len(losses) == 3 and all(math.isfinite(loss) for loss in losses)


# --- the corpus tool -----------------------------------------------------------------


def test_the_corpus_tool_is_deterministic_and_lossless(tmp_path):
    """make corpus's tokenizer is trained by the tokenizers library, the same bytes under
    any hash seed, and saved as a tokenizer.json that planc data prepare takes."""
    pytest.importorskip("tokenizers")
    from planc.data import corpus
    from planc.data.tokenizer import Tokenizer

    text = corpus.tiny_text(20_000)
    assert "".join(corpus.pieces(text)) == text and text.isascii()
    tokenizer = corpus.train(text, 600)
    ids = corpus.encode(text, tokenizer)
    assert corpus.decode(ids, tokenizer) == text
    assert max(ids) < tokenizer.get_vocab_size() <= 600 and len(ids) < len(text) / 2
    assert tokenizer.token_to_id(corpus.END_OF_TEXT) == 0 and 0 not in ids
    # digits are pieces of their own: numbers are spelled digit by digit
    assert all(sum(c.isdigit() for c in token) <= 1
               for token in tokenizer.encode("x 2024 and 1999").tokens)
    unicode = "naïve café — ünïcödé, tabs\tand  spaces __x__ 123\n"
    assert "".join(corpus.pieces(unicode)) == unicode
    assert corpus.decode(corpus.encode(unicode, tokenizer), tokenizer) == unicode
    own = corpus.train(unicode * 3, 300)
    assert corpus.decode(corpus.encode(unicode, own), own) == unicode
    outputs = []
    for hash_seed in ("1", "2"):
        out = tmp_path / hash_seed / "c.tokens"
        done = subprocess.run([sys.executable, "-m", "planc.data.corpus", "-o", str(out),
                               "--chars", "20000", "--vocab", "600"], cwd=ROOT, timeout=60,
                              capture_output=True, text=True,
                              env={**os.environ, "PYTHONHASHSEED": hash_seed})
        assert done.returncode == 0, done.stderr
        outputs.append((out.read_bytes(), (out.parent / "c.json").read_bytes()))
        assert (out.parent / "c.txt").read_text() == text
    assert outputs[0] == outputs[1] and outputs[0][0][:8] == b"PLANCTOK"
    fd, tokens = open_tokens(str(tmp_path / "1" / "c.tokens"))
    os.close(fd)
    assert (tokens.width, tokens.count) == (4, len(ids))
    saved = Tokenizer(str(tmp_path / "1" / "c.json"))  # what planc data prepare loads
    assert (saved.vocab_size, saved.eos_id) == (tokenizer.get_vocab_size(), 0)
    assert saved.encode([text]) == [ids + [0]]


def test_the_corpus_tool_wraps_a_raw_file(tmp_path):
    ids = [0, 70000, 5, 2**32 - 1]
    (tmp_path / "raw.bin").write_bytes(struct.pack("<4I", *ids))
    done = subprocess.run([sys.executable, "-m", "planc.data.corpus", "--raw", "uint32",
                           str(tmp_path / "raw.bin"), "-o", str(tmp_path / "w.tokens")],
                          cwd=ROOT, timeout=60, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "w.tokens").read_bytes() == with_header(tmp_path / "x", ids, 4).read_bytes()


def test_the_corpus_tool_refuses_what_it_cannot_do_and_replaces_only_its_own(tmp_path,
                                                                              capsys):
    """A missing or undecodable input is an error, not a traceback; an earlier corpus is
    replaced only with --force; a file beside the token file that the tool did not
    write is never replaced (README, "Outputs")."""
    pytest.importorskip("tokenizers")
    from planc.data import corpus

    def run(*argv):
        status = corpus.main([str(a) for a in argv])
        return status, capsys.readouterr().err

    missing = tmp_path / "none.txt"
    assert run(missing, "-o", tmp_path / "n.tokens") == (
        1, f"planc: error: {missing}: No such file or directory; {tmp_path}/n.tokens was "
           f"not written\n")
    assert run("--raw", "uint32", missing, "-o", tmp_path / "r.tokens")[0] == 1
    (tmp_path / "bad.txt").write_bytes(b"\xff\xfe text")
    status, err = run(tmp_path / "bad.txt", "-o", tmp_path / "b.tokens", "--vocab", "300")
    assert status == 1 and "can't decode byte 0xff" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.txt"]  # nothing written

    small = ("--chars", "4000", "--vocab", "300")
    assert run("-o", tmp_path / "c.tokens", *small)[0] == 0
    written = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    assert sorted(written) == ["bad.txt", "c.json", "c.tokens", "c.txt"]
    assert corpus.written_here(str(tmp_path / "c.json"))
    assert run("-o", tmp_path / "c.tokens", *small) == (
        1, f"planc: error: -o {tmp_path}/c.tokens: holds a token file already (planc data "
           f"prepare wrote it); replace it with --force, or name another path\n")
    assert run("-o", tmp_path / "c.tokens", *small, "--force")[0] == 0
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == written  # deterministic

    (tmp_path / "d.json").write_text('{"mine": true}')
    assert not corpus.written_here(str(tmp_path / "d.json"))
    assert run("-o", tmp_path / "d.tokens", *small, "--force") == (
        1, f"planc: error: {tmp_path}/d.json is there, and this tool writes the tokenizer "
           f"beside -o {tmp_path}/d.tokens: planc did not write it; move it, or name "
           f"another -o\n")
    assert (tmp_path / "d.json").read_text() == '{"mine": true}'
    assert not (tmp_path / "d.tokens").exists()


def test_planc_check_reads_token_files_without_torch(tmp_path):
    ids = [3] * 30 + [70000]
    write_tokens(tmp_path / "tokens.bin", ids, 4)
    (tmp_path / "d.plan").write_text(
        'plan d {\n  model gpt { layers = 1; hidden = 8; heads = 2; vocab = 512; seq = 7; '
        'batch = 4 }\n  train { data = "tokens.bin" }\n}\n')
    script = textwrap.dedent("""
        import json, sys
        sys.modules["torch"] = None  # any `import torch` now fails
        from planc.cli import main
        status = main(["check", sys.argv[1]])
        print(json.dumps([status, sorted(m for m in sys.modules if m.startswith("torch")
                                         and sys.modules[m] is not None)]))
    """)
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path / "d.plan")], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert json.loads(done.stdout.strip().splitlines()[-1]) == [1, []]
    assert ("error: data file 'tokens.bin' holds token id 70000 (token 30 of the file), not "
            "below vocab = 512") in done.stderr
