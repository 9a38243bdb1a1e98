"""Megatron-LM's indexed datasets (``PREFIX.bin`` and ``PREFIX.idx``) read as they are
(issue 38): the pair is written here byte by byte from Megatron-Core's documented layout
(``megatron/core/datasets/indexed_dataset.py``'s ``_IndexWriter`` and
``IndexedDatasetBuilder``: one sequence a document, document indices from 0), and must
give the batches and the losses of a planc token file of the same ids; a damaged ``.idx``
is one line from ``planc check``, never a traceback.
"""

from __future__ import annotations

import json
import struct

import pytest

from planc.cli import main
from planc.data.tokens import write_tokens

DOCUMENTS = [[(7 * d + 3 * i) % 61 + 1 for i in range(9 + d % 5)] for d in range(40)]


def write_megatron(prefix, documents=DOCUMENTS, code: int = 8, version: int = 1,
                   change=None) -> None:
    """``prefix``.bin and .idx as Megatron-Core writes them; ``change`` edits the index's
    fields (a dict) before they are packed."""
    width, form = {8: (2, "H"), 4: (4, "i")}.get(code, (2, "H"))
    lengths = [len(d) for d in documents]
    pointers, at = [], 0
    for length in lengths:
        pointers.append(at)
        at += length * width
    fields = {"magic": b"MMIDIDX\x00\x00", "version": version, "code": code,
              "lengths": lengths, "pointers": pointers,
              "documents": list(range(len(documents) + 1)), "tail": b""}
    if change:
        change(fields)
    tokens = [t for d in documents for t in d]
    (prefix.parent / (prefix.name + ".bin")).write_bytes(
        struct.pack(f"<{len(tokens)}{form}", *tokens))
    index = (fields["magic"] + struct.pack("<QBQQ", fields["version"], fields["code"],
                                           len(fields["lengths"]), len(fields["documents"]))
             + struct.pack(f"<{len(fields['lengths'])}i", *fields["lengths"])
             + struct.pack(f"<{len(fields['pointers'])}q", *fields["pointers"])
             + struct.pack(f"<{len(fields['documents'])}q", *fields["documents"])
             + fields["tail"])
    (prefix.parent / (prefix.name + ".idx")).write_bytes(index)


def plan_text(data: str, shuffle: bool = False, steps: int = 3) -> str:
    return (f'plan megatron {{\n  model gpt {{ layers = 2; hidden = 16; heads = 2; vocab = 64; '
            f'seq = 7; batch = 4 }}\n  mesh {{ dp = 2 }}\n  schedule {{ microbatches = 2 }}\n'
            f'  train {{ steps = {steps}; optimizer = sgd(lr = 0.1); seed = 5; '
            f'data = "{data}"{"; shuffle = on" if shuffle else ""} }}\n}}\n')


@pytest.mark.parametrize("code", [8, 4], ids=["uint16", "int32"])
@pytest.mark.parametrize("named", ["prefix", "bin", "idx"])
def test_a_megatron_pair_gives_the_batches_of_the_same_tokens_in_a_token_file(
        code, named, tmp_path):
    pytest.importorskip("torch")
    from planc.runtime.engine.data import DataSource, batch_tokens

    write_megatron(tmp_path / "web_text_document", code=code)
    write_tokens(tmp_path / "web.tokens", [t for d in DOCUMENTS for t in d], 4)
    path = {"prefix": "web_text_document", "bin": "web_text_document.bin",
            "idx": "web_text_document.idx"}[named]
    for shuffle in (False, True):
        ours = DataSource(str(tmp_path / path), 5, 4, 7, 64, shuffle)
        theirs = DataSource(str(tmp_path / "web.tokens"), 5, 4, 7, 64, shuffle)
        for step in range(6):
            assert batch_tokens(ours, step).tolist() == batch_tokens(theirs, step).tolist()


@pytest.mark.slow
def test_a_run_on_a_megatron_pair_has_the_losses_of_the_token_file(tmp_path, capfd):
    pytest.importorskip("torch")
    write_megatron(tmp_path / "web_text_document")
    write_tokens(tmp_path / "web.tokens", [t for d in DOCUMENTS for t in d], 2)
    losses = {}
    for name, data in (("megatron", "web_text_document"), ("planc", "web.tokens")):
        source, metrics = tmp_path / f"{name}.plan", tmp_path / f"{name}.jsonl"
        source.write_text(plan_text(data))
        status = main(["run", str(source), "-o", str(tmp_path / f"build-{name}"),
                       "--metrics", str(metrics)])
        assert status == 0, capfd.readouterr().err
        losses[name] = [json.loads(line)["loss"] for line in metrics.read_text().splitlines()]
    assert len(losses["planc"]) == 3 and losses["megatron"] == losses["planc"]


def _set(**values):
    def change(fields):
        fields.update(values)
    return change


def _edit(key, index, value):
    def change(fields):
        fields[key] = list(fields[key])
        fields[key][index] = value
    return change


DAMAGES = {
    "magic": (_set(magic=b"MMIDIDX\x00\x01"), "does not begin with Megatron's MMIDIDX magic"),
    "version": (_set(version=2), "is of version 2; planc reads version 1"),
    "float32": (_set(code=7), "holds float32 tokens; planc reads uint16 or int32 token ids"),
    "int64": (_set(code=5), "holds int64 tokens; planc reads uint16 or int32 token ids"),
    "unknown-dtype": (_set(code=99), "has the unknown dtype code 99"),
    "truncated": (_set(tail=b"\x00" * 3), "is 845 bytes long, but its counts (40 "
                  "sequences, 41 document indices) make 842"),
    "multimodal": (_set(tail=b"\x00" * 40), "is a multimodal index (each sequence has a "
                   "mode); planc reads token datasets"),
    "negative-length": (_edit("lengths", 3, -1), "gives sequence 3 a negative length (-1)"),
    "pointer": (_edit("pointers", 5, 3), "puts sequence 5 at byte 3 of the .bin, but the "
                "sequences before it end at 110"),
    "first-document": (_edit("documents", 0, 1), "starts its document indices at 1, not 0"),
    "documents-decrease": (_edit("documents", 7, 2), "has document index 7 (2) below the "
                           "one before it (6)"),
    "last-document": (_edit("documents", -1, 39), "ends its document indices at 39, not at "
                      "its 40 sequences"),
    "longer-than-bin": (_edit("lengths", -1, 20), "describes 447 tokens (894 bytes), but "
                        "the .bin holds 880 bytes"),
}


@pytest.mark.parametrize("damage", DAMAGES)
def test_a_damaged_index_is_one_line_from_check(damage, tmp_path, capfd):
    change, message = DAMAGES[damage]
    write_megatron(tmp_path / "web", change=change)
    (tmp_path / "p.plan").write_text(plan_text("web"))
    assert main(["check", str(tmp_path / "p.plan")]) == 1
    err = capfd.readouterr().err
    assert "Traceback" not in err
    assert f"error: data file 'web' (a Megatron dataset): its .idx {message}\n" in err


def test_half_a_pair_and_a_short_index_are_refused(tmp_path, capfd):
    write_megatron(tmp_path / "web")
    (tmp_path / "web.bin").unlink()
    (tmp_path / "p.plan").write_text(plan_text("web"))
    assert main(["check", str(tmp_path / "p.plan")]) == 1
    assert "error: data file 'web' (a Megatron dataset): its .bin does not exist\n" in \
        capfd.readouterr().err
    write_megatron(tmp_path / "web")
    (tmp_path / "web.idx").write_bytes(b"MMIDIDX")
    assert main(["check", str(tmp_path / "p.plan")]) == 1
    assert "its .idx is 7 bytes long; its header alone is 34\n" in capfd.readouterr().err
    # a .bin alone is nanoGPT's raw uint16 file, as before
    (tmp_path / "web.idx").unlink()
    (tmp_path / "p.plan").write_text(plan_text("web.bin"))
    assert main(["check", str(tmp_path / "p.plan")]) == 0


def test_an_index_over_the_scan_limit_is_checked_at_its_ends(tmp_path):
    """Past planc.data.tokens.SCAN_LIMIT the index is not read whole: its header, size,
    first and last offsets and document indices are checked against the .bin."""
    from planc.data.megatron import IndexDamage, check_index

    write_megatron(tmp_path / "web")
    bin_size = (tmp_path / "web.bin").stat().st_size
    assert check_index(str(tmp_path / "web.idx"), bin_size, 64) == (2, 40)
    with pytest.raises(IndexDamage, match=r"^does not end its sequences where the .bin "
                       r"ends \(878 bytes\)$"):
        check_index(str(tmp_path / "web.idx"), bin_size - 2, 64)
    write_megatron(tmp_path / "web", change=_edit("documents", -1, 39))
    with pytest.raises(IndexDamage, match="^ends its document indices at 39, not at its 40 "
                                          "sequences$"):
        check_index(str(tmp_path / "web.idx"), bin_size, 64)
    # a damage between the ends is what a run's reads would meet; read whole, it is named
    write_megatron(tmp_path / "web", change=_edit("documents", 7, 2))
    assert check_index(str(tmp_path / "web.idx"), bin_size, 64) == (2, 40)
    with pytest.raises(IndexDamage, match=r"^has document index 7 \(2\) below"):
        check_index(str(tmp_path / "web.idx"), bin_size, None)
