"""``planc data prepare`` (issue 38): text and JSONL cut by a model's own tokenizer into a
token file, with a description that ``planc check`` joins to the ``init`` checkpoint.

The tokenizer is a real Hugging Face one, trained here with the ``tokenizers`` library
(a BPE over a few letters, small enough for the tiny Llama of tests/test_hf_init.py) and
saved as ``tokenizer.json`` beside the checkpoint, as ``save_pretrained`` ships it. A run
from that checkpoint on JSONL prepared with it must start at transformers' loss on the
same batch.
"""

from __future__ import annotations

import json
import os

import pytest

tokenizers = pytest.importorskip("tokenizers")

from planc.cli import main  # noqa: E402
from planc.data.documents import Source  # noqa: E402
from planc.data.prepare import prepare  # noqa: E402
from planc.data.tokenizer import Tokenizer  # noqa: E402
from planc.data.tokens import HEADER_BYTES, open_tokens  # noqa: E402

WORDS = ("the cat sat on a mat and the dog ran to the red barn while a bird sang "
         "over the green hill near the old mill").split()
EOS = "<|end_of_text|>"


def documents(count: int, seed: int = 0) -> list[str]:
    """``count`` short documents of WORDS, the same everywhere."""
    state, out = seed, []
    for _ in range(count):
        words = []
        for _ in range(6 + state % 9):
            state = (state * 6364136223846793005 + 1442695040888963407) % (1 << 64)
            words.append(WORDS[(state >> 33) % len(WORDS)])
        out.append(" ".join(words))
    return out


def save_tokenizer(directory, vocab: int = 64, special=(EOS,), config_eos: str | None = EOS):
    """A BPE of at most ``vocab`` ids trained on the documents, as tokenizer.json (and a
    tokenizer_config.json naming its end-of-text token) in ``directory``."""
    from tokenizers import Tokenizer as Rust, models, pre_tokenizers, trainers

    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = Rust(models.BPE(unk_token=None))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=list(special),
                                  show_progress=False)
    tokenizer.train_from_iterator(documents(200), trainer)
    tokenizer.save(str(directory / "tokenizer.json"))
    if config_eos is not None:
        (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": config_eos}))
    return directory / "tokenizer.json"


def read_ids(path) -> list[int]:
    fd, tokens = open_tokens(str(path))
    try:
        data = os.pread(fd, tokens.size, tokens.offset)
    finally:
        os.close(fd)
    return [int.from_bytes(data[i:i + tokens.width], "little")
            for i in range(0, len(data), tokens.width)]


def write_jsonl(path, texts, key="text"):
    path.write_text("".join(json.dumps({key: text, "n": i}) + "\n"
                            for i, text in enumerate(texts)))


def test_jsonl_becomes_each_documents_ids_and_its_end_of_text(tmp_path, capfd):
    tokenizer_json = save_tokenizer(tmp_path / "tok")
    texts = documents(40)
    write_jsonl(tmp_path / "a.jsonl", texts[:25])
    write_jsonl(tmp_path / "b.jsonl", texts[25:])
    out = tmp_path / "out.tokens"
    assert main(["data", "prepare", str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl"),
                 "-o", str(out), "--tokenizer", str(tmp_path / "tok")]) == 0
    rust = tokenizers.Tokenizer.from_file(str(tokenizer_json))
    eos = rust.token_to_id(EOS)
    expected = [i for text in texts for i in rust.encode(text).ids + [eos]]
    assert read_ids(out) == expected
    assert out.stat().st_size == HEADER_BYTES + 2 * len(expected)  # uint16: 64 ids
    described = json.loads((tmp_path / "out.tokens.json").read_text())
    assert list(described)[0] == "generator"
    assert (described["tokens"], described["documents"], described["width"]) == \
        (len(expected), 40, 2)
    assert described["tokenizer"]["eos_id"] == eos
    assert [(s["kind"], s["documents"]) for s in described["sources"]] == \
        [("jsonl", 25), ("jsonl", 15)]
    err = capfd.readouterr().err
    assert f"planc: {out} written ({len(expected):,} tokens of uint16, end-of-text id {eos})" \
        in err
    # a second time is refused without --force, and replaced with it
    assert main(["data", "prepare", str(tmp_path / "a.jsonl"), "-o", str(out),
                 "--tokenizer", str(tokenizer_json)]) == 2
    assert "holds a token file already (planc data prepare wrote it)" in capfd.readouterr().err
    assert main(["data", "prepare", str(tmp_path / "a.jsonl"), "-o", str(out),
                 "--tokenizer", str(tokenizer_json), "--force"]) == 0
    assert len(read_ids(out)) == sum(len(rust.encode(t).ids) + 1 for t in texts[:25])


def test_plain_text_by_line_paragraph_or_document(tmp_path):
    save_tokenizer(tmp_path / "tok")
    tokenizer = Tokenizer(str(tmp_path / "tok"))
    text = tmp_path / "notes.txt"
    text.write_text("the cat sat\non a mat\n\nthe dog ran\n")
    eos = tokenizer.eos_id
    cut = {}
    for sample_by in ("line", "paragraph", "document"):
        out = tmp_path / f"{sample_by}.tokens"
        progress = prepare([Source.of(str(text))], str(out), tokenizer, sample_by=sample_by)
        cut[sample_by] = progress.documents
        assert read_ids(out).count(eos) == progress.documents
    assert cut == {"line": 3, "paragraph": 2, "document": 1}


def test_gzipped_text_is_read_as_its_text_and_a_false_gz_is_refused(tmp_path, capfd):
    import gzip

    save_tokenizer(tmp_path / "tok")
    plain = "the cat sat\non a mat\n\nthe dog ran\n"
    (tmp_path / "notes.txt").write_text(plain)
    (tmp_path / "notes.txt.gz").write_bytes(gzip.compress(plain.encode()))
    (tmp_path / "false.txt.gz").write_text(plain)  # a name that says gzip, plain inside
    for name in ("notes.txt", "notes.txt.gz"):
        assert main(["data", "prepare", str(tmp_path / name), "-o",
                     str(tmp_path / f"{name}.tokens"), "--tokenizer",
                     str(tmp_path / "tok")]) == 0
    assert read_ids(tmp_path / "notes.txt.gz.tokens") == read_ids(tmp_path / "notes.txt.tokens")
    capfd.readouterr()
    out = tmp_path / "false.tokens"
    assert main(["data", "prepare", str(tmp_path / "false.txt.gz"), "-o", str(out),
                 "--tokenizer", str(tmp_path / "tok")]) == 1
    assert capfd.readouterr().err == (f"planc: error: source {tmp_path / 'false.txt.gz'} "
                                      f"cannot be read: its name ends in .gz and it is not a "
                                      f"gzip file; {out} was not written\n")
    assert not out.exists()
    # .ndjson.gz is JSONL, not text; a stream damaged inside is refused in one line
    (tmp_path / "d.ndjson.gz").write_bytes(gzip.compress(b'{"text": "the cat"}\n'))
    assert main(["data", "prepare", str(tmp_path / "d.ndjson.gz"), "-o",
                 str(tmp_path / "d.tokens"), "--tokenizer", str(tmp_path / "tok")]) == 0
    assert json.loads((tmp_path / "d.tokens.json").read_text())["sources"][0]["kind"] == \
        "jsonl"
    damaged = bytearray(gzip.compress(plain.encode() * 200))
    damaged[12:30] = bytes(18)
    (tmp_path / "damaged.txt.gz").write_bytes(bytes(damaged))
    capfd.readouterr()
    assert main(["data", "prepare", str(tmp_path / "damaged.txt.gz"), "-o", str(out),
                 "--tokenizer", str(tmp_path / "tok")]) == 1
    assert capfd.readouterr().err == (
        f"planc: error: source {tmp_path / 'damaged.txt.gz'} cannot be read: its gzip stream "
        f"is damaged; {out} was not written\n")
    # a trailer whose CRC does not match (gzip's BadGzipFile, as for a plain file)
    trailer = bytearray(gzip.compress(plain.encode()))
    trailer[-8] ^= 0xFF
    (tmp_path / "crc.txt.gz").write_bytes(bytes(trailer))
    assert main(["data", "prepare", str(tmp_path / "crc.txt.gz"), "-o", str(out),
                 "--tokenizer", str(tmp_path / "tok")]) == 1
    assert capfd.readouterr().err == (
        f"planc: error: source {tmp_path / 'crc.txt.gz'} cannot be read: its gzip stream "
        f"is damaged; {out} was not written\n")
    # and one cut short
    (tmp_path / "cut.txt.gz").write_bytes(gzip.compress(plain.encode() * 200)[:-20])
    assert main(["data", "prepare", str(tmp_path / "cut.txt.gz"), "-o", str(out),
                 "--tokenizer", str(tmp_path / "tok")]) == 1
    assert capfd.readouterr().err == (
        f"planc: error: source {tmp_path / 'cut.txt.gz'} cannot be read: its gzip stream "
        f"ends early (the file is cut short); {out} was not written\n")
    assert not out.exists()


def test_blank_documents_are_skipped_and_counted(tmp_path, capfd):
    """A JSONL text of white space, or an empty file read whole, is no document (as
    Megatron-LM's preprocess_data.py leaves out a document of no ids): not an end-of-text
    id alone."""
    tokenizer_json = save_tokenizer(tmp_path / "tok")
    (tmp_path / "some.jsonl").write_text(
        '{"text": ""}\n{"text": "the cat"}\n{"text": " \\n "}\n')
    out = tmp_path / "some.tokens"
    assert main(["data", "prepare", str(tmp_path / "some.jsonl"), "-o", str(out),
                 "--tokenizer", str(tmp_path / "tok")]) == 0
    rust = tokenizers.Tokenizer.from_file(str(tokenizer_json))
    assert read_ids(out) == rust.encode("the cat").ids + [rust.token_to_id(EOS)]
    assert json.loads((tmp_path / "some.tokens.json").read_text())["documents"] == 1
    err = capfd.readouterr().err
    assert err.startswith(f"planc data prepare: 1 document (2 blank ones skipped), "
                          f"{len(read_ids(out))} tokens, 0.0 MB read at "), err
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "blank.txt").write_text("\n \n")
    for sample_by, name, why in (("document", "blank.txt", " (1 blank document skipped)"),
                                 ("line", "empty.txt", "")):
        none = tmp_path / f"{sample_by}.tokens"
        assert main(["data", "prepare", str(tmp_path / name), "-o", str(none),
                     "--tokenizer", str(tmp_path / "tok"), "--sample-by", sample_by]) == 1
        assert capfd.readouterr().err == (f"planc: error: the sources hold no document{why}: "
                                          f"nothing to write; {none} was not written\n")
        assert not none.exists()


def _expected(directory, texts) -> list[int]:
    rust = tokenizers.Tokenizer.from_file(str(directory / "tokenizer.json"))
    eos = rust.token_to_id(EOS)
    return [i for text in texts for i in rust.encode(text).ids + [eos]]


def test_parquet_is_read_row_group_by_row_group_in_its_text_column(tmp_path, capfd):
    pyarrow = pytest.importorskip("pyarrow")
    import pyarrow.parquet as parquet

    save_tokenizer(tmp_path / "tok")
    texts = documents(30)
    table = pyarrow.table({"id": list(range(30)), "content": texts})
    parquet.write_table(table, tmp_path / "d.parquet", row_group_size=7)
    out = tmp_path / "p.tokens"
    assert main(["data", "prepare", str(tmp_path / "d.parquet"), "-o", str(out),
                 "--tokenizer", str(tmp_path / "tok"), "--text-key", "content"]) == 0
    assert read_ids(out) == _expected(tmp_path / "tok", texts)
    capfd.readouterr()
    assert main(["data", "prepare", str(tmp_path / "d.parquet"), "-o", str(out), "--force",
                 "--tokenizer", str(tmp_path / "tok")]) == 1
    assert capfd.readouterr().err.splitlines() == [
        f"planc: error: source {tmp_path / 'd.parquet'} has no column 'text' (it has id, "
        f"content); name the text's column with --text-key; {out} was not written"]
    (tmp_path / "bad.parquet").write_bytes(b"not parquet at all")
    assert main(["data", "prepare", str(tmp_path / "bad.parquet"), "-o",
                 str(tmp_path / "b.tokens"), "--tokenizer", str(tmp_path / "tok")]) == 1
    (line,) = capfd.readouterr().err.splitlines()
    assert line.startswith(f"planc: error: source {tmp_path / 'bad.parquet'} cannot be read "
                           f"as Parquet: ")
    assert not (tmp_path / "b.tokens").exists() and _leftovers(tmp_path) == []


def test_a_dataset_saved_to_disk_is_read_from_its_train_split(tmp_path, capfd):
    datasets = pytest.importorskip("datasets")

    save_tokenizer(tmp_path / "tok")
    texts = documents(20)
    datasets.Dataset.from_dict({"text": texts}).save_to_disk(str(tmp_path / "one"))
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": texts[:12]}),
                          "validation": datasets.Dataset.from_dict({"text": texts[12:]})}
                         ).save_to_disk(str(tmp_path / "splits"))
    datasets.DatasetDict({"test": datasets.Dataset.from_dict({"text": texts})}
                         ).save_to_disk(str(tmp_path / "no-train"))
    for name, expected in (("one", texts), ("splits", texts[:12])):
        out = tmp_path / f"{name}.tokens"
        assert main(["data", "prepare", str(tmp_path / name), "-o", str(out),
                     "--tokenizer", str(tmp_path / "tok")]) == 0
        assert read_ids(out) == _expected(tmp_path / "tok", expected)
    # a Hub dataset as the local cache holds it: a snapshot directory of data files,
    # streamed by datasets' own builders, offline
    snapshot = tmp_path / "datasets--acme--stories" / "snapshots" / "0123abcd" / "data"
    snapshot.mkdir(parents=True)
    write_jsonl(snapshot / "train-00000.jsonl", texts[:9])
    write_jsonl(snapshot / "train-00001.jsonl", texts[9:])
    out = tmp_path / "hub.tokens"
    assert main(["data", "prepare", str(snapshot.parent), "-o", str(out), "--tokenizer",
                 str(tmp_path / "tok")]) == 0
    assert read_ids(out) == _expected(tmp_path / "tok", texts)
    (tmp_path / "empty").mkdir()
    capfd.readouterr()
    assert main(["data", "prepare", str(tmp_path / "empty"), "-o", str(tmp_path / "e.tokens"),
                 "--tokenizer", str(tmp_path / "tok")]) == 1
    (line,) = capfd.readouterr().err.splitlines()
    assert line.startswith(f"planc: error: source {tmp_path / 'empty'} is neither a dataset "
                           f"saved by save_to_disk nor a directory of data files datasets "
                           f"can read: ")
    assert main(["data", "prepare", str(tmp_path / "no-train"), "-o",
                 str(tmp_path / "n.tokens"), "--tokenizer", str(tmp_path / "tok")]) == 1
    assert capfd.readouterr().err.splitlines() == [
        f"planc: error: source {tmp_path / 'no-train'} holds the splits test, no 'train'; "
        f"save the split to read with save_to_disk; {tmp_path / 'n.tokens'} was not written"]


def test_a_vocabulary_beyond_65536_ids_is_written_as_uint32(tmp_path):
    from tokenizers import Tokenizer as Rust, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(70_000)}
    vocab["<eos>"] = 70_000
    rust = Rust(models.WordLevel(vocab, unk_token="w0"))
    rust.pre_tokenizer = pre_tokenizers.Whitespace()
    rust.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "d.jsonl").write_text(json.dumps({"text": "w69999 w3 w65536"}) + "\n")
    out = tmp_path / "big.tokens"
    prepare([Source.of(str(tmp_path / "d.jsonl"))], str(out),
            Tokenizer(str(tmp_path / "tokenizer.json")))
    assert read_ids(out) == [69_999, 3, 65_536, 70_000]
    assert open_tokens(str(out))[1].width == 4


def _leftovers(directory) -> list[str]:
    return sorted(name for name in os.listdir(directory) if name.startswith("."))


@pytest.mark.parametrize("line, message", [
    (b"{\"text\": \"the cat\"", "not a JSON object (Expecting ',' delimiter)"),
    (b"[1, 2]", "a JSON array, not an object with a 'text' field"),
    (b"{\"body\": \"the cat\"}", "the object has no 'text' field (it has 'body'); name the "
                               "text's field with --text-key"),
    (b"{\"text\": 7}", "the 'text' field is a JSON number, not a string"),
    (b"{\"text\": null}", "the 'text' field is a JSON null, not a string"),
    # JSON escapes a lone surrogate, which the tokenizer refused with a TypeError
    (b"{\"text\": \"a\\udc80b\"}", "the 'text' field holds a lone surrogate (\\udc80), not "
                                   "Unicode text"),
], ids=["truncated", "list", "no-field", "not-a-string", "null", "lone-surrogate"])
def test_a_bad_line_names_its_file_and_line_and_writes_nothing(line, message, tmp_path,
                                                               capfd):
    save_tokenizer(tmp_path / "tok")
    source = tmp_path / "d.jsonl"
    source.write_bytes(b'{"text": "the cat sat"}\n\n' + line + b"\n")
    out = tmp_path / "out.tokens"
    assert main(["data", "prepare", str(source), "-o", str(out), "--tokenizer",
                 str(tmp_path / "tok")]) == 1
    assert capfd.readouterr().err.splitlines() == [
        f"planc: error: {source}:3: {message}; {out} was not written"]
    assert not out.exists() and not (tmp_path / "out.tokens.json").exists()
    assert _leftovers(tmp_path) == []


def test_an_interrupted_prepare_leaves_the_output_as_it_was(tmp_path):
    """A Ctrl-C (here raised by the progress report after the first batch) removes the
    partial file; an earlier output stays whole."""
    save_tokenizer(tmp_path / "tok")
    tokenizer = Tokenizer(str(tmp_path / "tok"))
    write_jsonl(tmp_path / "d.jsonl", documents(300))
    out = tmp_path / "out.tokens"
    prepare([Source.of(str(tmp_path / "d.jsonl"))], str(out), tokenizer)
    before = out.read_bytes()

    def interrupt(progress):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        prepare([Source.of(str(tmp_path / "d.jsonl"))], str(out), tokenizer,
                report=interrupt, batch_bytes=100)
    assert out.read_bytes() == before
    assert _leftovers(tmp_path) == []


@pytest.mark.parametrize("setup, message", [
    (lambda d: (d / "none").mkdir(), "tokenizer directory {d}/none has no tokenizer.json "
                                     "(a Hugging Face tokenizer saved by save_pretrained)"),
    (lambda d: (d / "none").mkdir() or (d / "none" / "tokenizer.json").write_text("{"),
     "tokenizer {d}/none/tokenizer.json cannot be read: "),
    (lambda d: save_tokenizer(d / "none", special=("<pad>",), config_eos=None),
     "tokenizer {d}/none/tokenizer.json names no end-of-text token (its "
     "tokenizer_config.json has no eos_token, and it has none of <|end_of_text|>, "
     "<|endoftext|>, </s>, <eos>): give one with --eos"),
], ids=["no-tokenizer-json", "damaged", "no-end-of-text"])
def test_a_tokenizer_that_cannot_cut_is_refused_in_one_line(setup, message, tmp_path, capfd):
    setup(tmp_path)
    write_jsonl(tmp_path / "d.jsonl", documents(3))
    assert main(["data", "prepare", str(tmp_path / "d.jsonl"), "-o",
                 str(tmp_path / "o.tokens"), "--tokenizer", str(tmp_path / "none")]) == 1
    (line,) = capfd.readouterr().err.splitlines()
    assert line.startswith("planc: error: " + message.format(d=tmp_path))
    assert not (tmp_path / "o.tokens").exists()


REPAIR = "repair or remove it, or name the end-of-text token with --eos"
NAMED = "repair it, or name the end-of-text token with --eos"


@pytest.mark.parametrize("damage, said", [
    (lambda c: c.write_text("{"), "cannot be read (it is not JSON: Expecting property name "
                                  "enclosed in double quotes, line 1, column 2): " + REPAIR),
    (lambda c: c.write_text('{"eos_token": "a\x01'), "cannot be read (it is not JSON: "
                                                      "Invalid control character, line 1, "
                                                      "column 17): " + REPAIR),
    (lambda c: c.write_bytes(b'{"eos_token": "\xff"}'), "cannot be read (it is not UTF-8 "
                                                          "text): " + REPAIR),
    (lambda c: c.write_text('{"n": ' + "9" * 5000 + "}"), "cannot be read (it holds a "
                                                          "number too long to read): " + REPAIR),
    (lambda c: c.mkdir(), "cannot be read (it is a directory, not a regular file): " + REPAIR),
    (lambda c: c.symlink_to(c.parent / "gone.json"), "is a symbolic link that leads to no "
                                                     "file: " + REPAIR),
    (lambda c: c.write_text("[1]"), "holds no JSON object: " + REPAIR),
    (lambda c: c.write_text('{"eos_token": 5}'), "gives eos_token 5, which is not a token's "
                                                 "name: " + NAMED),
    (lambda c: c.write_text('{"eos_token": {"content": [1]}}'), "gives eos_token [1], which "
                                                                "is not a token's name: "
                                                                + NAMED),
    (lambda c: c.write_text('{"eos_token": "\\ud800"}'), 'gives eos_token "\\ud800", which '
                                                         "is not a token's name: " + NAMED),
], ids=["not-json", "control-character", "not-utf8", "long-number", "directory",
        "dangling-link", "a-list", "a-number", "a-list-in-a-token", "lone-surrogate"])
def test_a_tokenizer_config_that_names_no_token_is_refused_not_passed_over(
        damage, said, tmp_path, capfd):
    """A tokenizer_config.json beside the tokenizer names the model's end-of-text token;
    one that is there but cannot be read, or whose eos_token names no token, was passed
    over, and the documents cut at whichever end-of-text name the vocabulary also has.
    --eos reads no config."""
    tokenizer = save_tokenizer(tmp_path / "tok", config_eos=None)
    config = tmp_path / "tok" / "tokenizer_config.json"
    damage(config)
    write_jsonl(tmp_path / "d.jsonl", documents(3))
    out = tmp_path / "o.tokens"
    command = ["data", "prepare", str(tmp_path / "d.jsonl"), "-o", str(out), "--tokenizer",
               str(tmp_path / "tok")]
    assert main(command) == 1
    assert capfd.readouterr().err.splitlines() == [f"planc: error: {config} {said}"]
    assert not out.exists() and tokenizer.exists()
    assert main(command + ["--eos", EOS]) == 0
    assert out.exists()


def test_a_tokenizer_config_is_the_end_of_text_token_it_names_or_none(tmp_path, capfd):
    """The config's eos_token is the end-of-text token, as a name or as transformers'
    AddedToken; a name the vocabulary lacks is refused, not replaced by the usual names;
    no eos_token, or null, leaves the usual names."""
    tokenizer = save_tokenizer(tmp_path / "tok", special=(EOS, "</s>"), config_eos=None)
    config = tmp_path / "tok" / "tokenizer_config.json"
    for text, name in (('{"eos_token": "</s>"}', "</s>"),
                       ('{"eos_token": {"content": "</s>", "lstrip": false}}', "</s>"),
                       ('{"eos_token": null}', EOS), ("{}", EOS)):
        config.write_text(text)
        assert Tokenizer(str(tokenizer)).eos_id == \
            Tokenizer(str(tokenizer), name).eos_id, text
    assert Tokenizer(str(tokenizer), "</s>").eos_id != Tokenizer(str(tokenizer), EOS).eos_id
    config.write_text('{"eos_token": "<nope>"}')
    write_jsonl(tmp_path / "d.jsonl", documents(3))
    assert main(["data", "prepare", str(tmp_path / "d.jsonl"), "-o", str(tmp_path / "o"),
                 "--tokenizer", str(tmp_path / "tok")]) == 1
    assert capfd.readouterr().err.splitlines() == [
        f'planc: error: {config} gives eos_token "<nope>", which tokenizer {tokenizer} has '
        f"no token for: " + NAMED]


def test_an_end_of_text_name_that_is_not_text_is_refused(tmp_path, capfd):
    """--eos given bytes that are not UTF-8 (Python holds them as lone surrogates) is
    refused in one line (a tokenizer_config.json whose eos_token is a lone surrogate,
    above, too). It raised UnicodeEncodeError in the tokenizer's lookup, a traceback."""
    tokenizer = save_tokenizer(tmp_path / "tok")
    write_jsonl(tmp_path / "d.jsonl", documents(3))
    out = tmp_path / "o.tokens"
    assert main(["data", "prepare", str(tmp_path / "d.jsonl"), "-o", str(out),
                 "--tokenizer", str(tmp_path / "tok"), "--eos", "\udcff"]) == 1
    assert capfd.readouterr().err.splitlines() == [
        f"planc: error: --eos '\\udcff' is not valid UTF-8 text, so no token of tokenizer "
        f"{tokenizer} can be named so"]
    assert not out.exists()


# --- joined to an init checkpoint ----------------------------------------------------------

def _llama_with_tokenizer(tmp_path):
    """tests/test_hf_init.py's tiny Llama (vocabulary 96) with a tokenizer of 64 ids."""
    hf_init = pytest.importorskip("tests.test_hf_init")
    hf_init.save_llama(tmp_path / "hf")
    save_tokenizer(tmp_path / "hf")
    write_jsonl(tmp_path / "docs.jsonl", documents(200))
    return hf_init


@pytest.mark.slow
def test_a_run_from_a_checkpoint_on_data_cut_by_its_tokenizer_starts_at_transformers_loss(
        tmp_path, capfd):
    pytest.importorskip("torch")
    hf_init = _llama_with_tokenizer(tmp_path)
    out = tmp_path / "docs.tokens"
    assert main(["data", "prepare", str(tmp_path / "docs.jsonl"), "-o", str(out),
                 "--tokenizer", str(tmp_path / "hf")]) == 0
    source, metrics = tmp_path / "init.plan", tmp_path / "m.jsonl"
    source.write_text(hf_init.plan_text(mesh="tp = 2", train='; data = "docs.tokens"'))
    status = main(["run", str(source), "-o", str(tmp_path / "build"), "--metrics",
                   str(metrics), "--check", "--timeout", "60"])
    err = capfd.readouterr().err
    assert status == 0, err
    assert "every loss and parameter matches" in err
    plan = hf_init.load_file(source).plan
    assert plan.train.data == str(out)
    first = json.loads(metrics.read_text().splitlines()[0])["loss"]
    assert first == pytest.approx(hf_init.transformers_loss(plan), rel=1e-5)


def test_check_refuses_data_cut_by_another_tokenizer_than_inits(tmp_path, capfd):
    pytest.importorskip("torch")
    hf_init = _llama_with_tokenizer(tmp_path)
    save_tokenizer(tmp_path / "other", vocab=48)  # another vocabulary: another tokenizer
    out = tmp_path / "docs.tokens"
    assert main(["data", "prepare", str(tmp_path / "docs.jsonl"), "-o", str(out),
                 "--tokenizer", str(tmp_path / "other")]) == 0
    source = tmp_path / "init.plan"
    source.write_text(hf_init.plan_text(train='; data = "docs.tokens"'))
    capfd.readouterr()
    assert main(["check", str(source)]) == 1
    err = capfd.readouterr().err
    assert "error: data file 'docs.tokens' was cut by another tokenizer than the init " \
           "checkpoint's (its tokenizer.json has SHA-256 " in err
    assert "hint: prepare the data with the checkpoint's tokenizer: planc data prepare " \
           "SOURCE -o OUT.tokens --tokenizer INIT_DIRECTORY" in err
    # cut by the checkpoint's own: accepted
    assert main(["data", "prepare", str(tmp_path / "docs.jsonl"), "-o", str(out),
                 "--tokenizer", str(tmp_path / "hf"), "--force"]) == 0
    assert main(["check", str(source)]) == 0
    # a description that no longer matches its file is named
    with open(out, "ab") as handle:
        handle.write(bytes(2))
    capfd.readouterr()
    assert main(["check", str(source)]) == 1
    size = out.stat().st_size
    assert f"error: 'docs.tokens.json' describes a token file of {size - 2:,} bytes, but " \
           f"'docs.tokens' has {size:,}; prepare the data again" in capfd.readouterr().err


def test_check_refuses_data_cut_by_a_tokenizer_larger_than_the_models_vocabulary(
        tmp_path, capfd, monkeypatch):
    """A description names its tokenizer's size: a file too large to scan (here over a
    scan limit of 64 bytes) is still refused before it runs."""
    import planc.lang.data_check

    monkeypatch.setattr(planc.lang.data_check, "DATA_SCAN_LIMIT", 64)
    save_tokenizer(tmp_path / "tok")  # 64 ids
    write_jsonl(tmp_path / "d.jsonl", documents(50))
    assert main(["data", "prepare", str(tmp_path / "d.jsonl"), "-o",
                 str(tmp_path / "d.tokens"), "--tokenizer", str(tmp_path / "tok")]) == 0
    size = json.loads((tmp_path / "d.tokens.json").read_text())["tokenizer"]["vocab_size"]
    plan = ('plan p {{\n  model gpt {{ layers = 1; hidden = 8; heads = 2; vocab = {v}; seq = 7; '
            'batch = 4 }}\n  train {{ data = "d.tokens" }}\n}}\n')
    (tmp_path / "p.plan").write_text(plan.format(v=size - 1))
    capfd.readouterr()
    assert main(["check", str(tmp_path / "p.plan")]) == 1
    assert f"error: data file 'd.tokens' was cut by a tokenizer of {size} ids, more than the " \
           f"model's vocab = {size - 1}" in capfd.readouterr().err
    (tmp_path / "p.plan").write_text(plan.format(v=size))
    assert main(["check", str(tmp_path / "p.plan")]) == 0
