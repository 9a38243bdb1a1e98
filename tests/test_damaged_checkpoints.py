"""A corpus of damaged checkpoints (issue 20: "checkpoints are untrusted input, as builds
are"): one checkpoint of a small gpt (tp 2 x pp 2, AdamW, so exp_avg and exp_avg_sq),
written once by a real ``planc run --checkpoint-dir``, and 1,018 copies of it, each with
one damage (made by tests/checkpoint_damages.py), built like tests/test_damaged_builds.py.
Per kind:

* whole-file (93): each of the 8 files of the step directory, and ``latest``, deleted
  (but ``latest``, which may be absent), emptied, cut at 1, 8, half and all but two of
  its bytes, replaced by a directory, a named pipe, a link to /dev/zero and a link to an
  intact copy outside the directory; manifest.json also not UTF-8, a JSON list, null, NaN;
* resigned-file (35): each of the 7 hashed files emptied and cut at 1, 8, half and all
  but two bytes, with its size and sha256 recomputed in the manifest, as an attacker
  would, so that the damage reaches the checks behind the hashes;
* field (743): every field of the manifest, of its model, optimizer, data, rng and
  layout, of one history entry and its layout, of one parameter entry and of one files
  entry, deleted and given each of 11 wrong values but its own (a string, a number, a
  list, null, an object, true, 10**40, -1, "NaN", and the bare JSON literals NaN and
  Infinity);
* item (81): the first beta, a shape's first size, a state key and the RNG tensor's name
  given each wrong value; one parameter entry, one files entry and the history entry
  deleted and given each; the model's family made llama (its parameters are gpt's);
* unknown-field (10): a field planc does not know added to each of those objects;
* manifest-text (5): nested 100,000 deep, as a whole and in a field; an integer of 5000
  digits; a key given twice; 65 MiB;
* names (7): ``..``, ``/`` and hidden names for files, parameter files and the RNG file;
* latest (4): ``latest`` naming ``../x``, an absolute path, a path through the step
  directory, a name with more after it;
* step-directory (4): the step directory a link to a copy outside (named by ``latest``,
  or found by listing), a file, a named pipe;
* values (8): inf, -inf and NaN in weights, inf and NaN in exp_avg, NaN and a negative
  number in exp_avg_sq (resigned);
* header (17): a safetensors header lying about offsets (overlapping, past the end,
  reversed, negative, booleans), dtype (F16, I32, unknown) and shape (transposed, another
  size, negative, floats), its own length (past the end, one short), with a number in its
  metadata, a tensor named twice, an extra field (resigned);
* rng (6): rng.safetensors with no tensor, torch.cpu as F32, too short, 2-D, all zeros
  (a state torch refuses), under another name (resigned);
* index (5): an index mapping a tensor to ``../`` (what export once followed), missing a
  tensor, with one more, a wrong total size, a weight map that is a list (resigned).

Each goes through ``planc.checkpoint.format.find``, ``problems_resuming`` with the plan that
resumes it, the values check and ``export_hf``, in this process: each must be refused with
one line that names the damaged file, field or tensor, never with another exception; the
messages of a representative subset are exact. A sample, the damage the issue lists and
one of every kind (25, so 50 runs), goes through the real ``planc run PLAN --resume D``
and ``planc export D --format hf`` in children forked from a driver that imported planc:
exit status 1, one ``planc: error:`` line, no traceback, nothing trained. A value no
training writes goes through torchrun's workers too, which check what they read; and
400 manifests changed at random in one to three places must be refused or read, never
crash. Before this file, the readers accepted 406 of the 1,018 damages (an inf weight, a
symbolic link out of the directory, ``../`` in an index) and crashed on 36, and 51 of
the random manifests crashed them (AttributeError, TypeError).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections import Counter
from dataclasses import asdict
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("safetensors")

from planc.checkpoint.training_record import TrainingRecord
from planc.checkpoint import format as fmt  # noqa: E402
from tests import hostile_inputs as hostile  # noqa: E402
from tests.checkpoint_damages import (CLI, COUNTS, HASHED, INF, LATEST, MANIFEST,  # noqa: E402
                                      MODEL0, MODEL1, OPT0, OPT1, PLAN, QKV, SECTIONS,
                                      STEP, STEPS, WRONG, Damage, _set, damages, edit_tensors,
                                      label, manifest_of, nodes, set_value, value_at,
                                      write_manifest)
from tests.conftest import ROOT  # noqa: E402

# --- judging in this process ----------------------------------------------------------------


def refusal(root: Path, plan, buckets, scratch: Path) -> tuple[str, str]:
    """How the readers take a checkpoint directory: ("refused", the one line planc run
    would give), ("accepted", "") or ("crash", what was raised). planc run: find (every
    file hashed), problems_resuming against the plan and its buckets, the values; then
    planc export --format hf, which must refuse it too (a gpt model, if nothing else)."""
    from planc.runtime.checkpoint.values import check_values
    from planc.runtime.checkpoint.export_hf import export_hf

    problem = ""
    try:
        found = fmt.find(root)
        record = TrainingRecord.of(plan.to_dict())
        problem = fmt.problems_resuming(found.manifest, record, buckets, STEPS) or ""
        if not problem:
            check_values(found.directory, found.manifest)
    except fmt.CheckpointError as exc:
        problem = str(exc)
    except Exception as exc:  # noqa: BLE001 - what the corpus looks for
        return "crash", f"{type(exc).__name__}: {exc}"
    try:
        export_hf(str(root), str(scratch / "hf"))
    except fmt.CheckpointError:
        pass
    except Exception as exc:  # noqa: BLE001
        return "crash", f"export_hf: {type(exc).__name__}: {exc}"
    else:
        return "crash", "export_hf wrote it"
    return ("refused", problem) if problem else ("accepted", "")


def materialize(pristine: Path, damage: Damage, directory: Path) -> Path:
    root = directory / "ckpt"
    shutil.copytree(pristine, root, symlinks=True)
    damage.apply(root)
    return root


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    """The checkpoint (written by planc run), the plan that resumes it and its buckets."""
    from planc.cli import main
    from planc.compile import compile_plan
    from planc.lang import load_text

    base = tmp_path_factory.mktemp("pristine")
    (base / "a.plan").write_text(PLAN.format(mesh="tp = 2; pp = 2", steps=2))
    assert main(["run", str(base / "a.plan"), "-o", str(base / "build"), "--checkpoint-dir",
                 str(base / "ckpt")]) == 0
    text = PLAN.format(mesh="tp = 2; pp = 2", steps=STEPS)
    (base / "b.plan").write_text(text)
    plan = load_text(text).plan
    buckets = compile_plan(plan).graph.graph["buckets"]
    return base / "ckpt", base / "b.plan", plan, buckets


@pytest.fixture(scope="module")
def corpus(pristine) -> list[Damage]:
    return damages(pristine[0])


@pytest.fixture(scope="module")
def verdicts(pristine, corpus, tmp_path_factory) -> dict[str, tuple[str, str, Path]]:
    """Every damaged checkpoint through the readers: name -> (verdict, message, root)."""
    checkpoint, _, plan, buckets = pristine
    base = tmp_path_factory.mktemp("damaged")
    out = {}
    for i, damage in enumerate(corpus):
        directory = base / f"{i:04d}"
        directory.mkdir()
        root = materialize(checkpoint, damage, directory)
        out[damage.name] = (*refusal(root, plan, buckets, directory), root)
        shutil.rmtree(directory)
    return out


def test_the_corpus_is_systematic_and_deterministic(pristine, corpus):
    names = [damage.name for damage in corpus]
    assert len(names) == len(set(names)) == 1020
    assert names == [damage.name for damage in damages(pristine[0])]
    assert Counter(damage.kind for damage in corpus) == COUNTS
    kinds = {}
    for name in names:
        where, what = name.split(":", 1)
        kinds.setdefault(where, set()).add(what)
    for file in (MANIFEST, *HASHED, LATEST):  # every file: every whole-file damage
        assert {"empty", "cut-at-1", "cut-at-8", "cut-in-half", "cut-last-byte", "directory",
                "fifo", "dev-zero", "outside-link"} <= kinds[file], file
        assert ("missing" in kinds[file]) == (file != LATEST)  # latest may be absent
    document = json.loads((pristine[0] / STEP / MANIFEST).read_text())
    for section in SECTIONS:  # every field of every section deleted, and given a wrong value
        holder = document
        for key in section:
            holder = holder[key]
        for key in holder:
            assert f"{label(section + (key,))}-deleted" in kinds["manifest.json"]
            assert any(what.startswith(label(section + (key,)) + "=")
                       for what in kinds["manifest.json"])
    used = {name.rsplit("=", 1)[1] for name in names
            if name.startswith("manifest.json:") and "=" in name}
    assert used == {*WRONG, "llama"}
    assert {damage.name for damage in corpus if damage.cli} == CLI
    assert {damage.kind for damage in corpus if damage.cli} == set(COUNTS)  # every kind


def test_every_damaged_checkpoint_is_refused_in_one_line_naming_the_damage(corpus, verdicts):
    failures = []
    for damage in corpus:
        verdict, message, _ = verdicts[damage.name]
        if verdict != "refused":
            failures.append(f"{damage.name}: {verdict} {message[:300]}")
        elif "\n" in message or not any(name in message for name in damage.names):
            failures.append(f"{damage.name}: does not name {damage.names}: {message[:300]}")
    assert not failures, f"{len(failures)} of {len(corpus)}:\n" + "\n".join(failures[:60])


# Exact refusals of a representative subset: {D} the checkpoint directory, {S} its step
# directory; N(...) for a step directory passed over, which leaves none.
def N(reason: str) -> str:
    return f"{{D}} holds no complete checkpoint (1 incomplete or damaged; the newest: {reason})"


PLAIN = "not a plain file name (letters, digits and _ . + -, not starting with a dot)"
LINKED = "cannot be read (it is a symbolic link; a checkpoint's files lie inside its directory)"
EXPECTED = {
    "manifest.json:missing": N("{S} is not a complete checkpoint (no manifest.json; was the "
                               "run stopped while writing it?)"),
    "manifest.json:optimizer.steps=string":
        N('{S}/manifest.json: optimizer.steps is "x", not a whole number >= 0'),
    "manifest.json:optimizer.steps=number": N(
        "{S}/manifest.json: optimizer.steps is 7, but the checkpoint is at step 2 (AdamW "
        "takes one step per training step)"),
    'manifest.json:parameters["layers.0.qkv.weight"]=number':
        N('{S}/manifest.json: parameters["layers.0.qkv.weight"] is 7, not an object'),
    "manifest.json:nested-100000-deep":
        N("{S}/manifest.json nests its values too deep to be a planc checkpoint file"),
    "manifest.json:key-twice": N('{S}/manifest.json names "steps" twice in one object'),
    "manifest.json:step=huge":
        N("{S}/manifest.json: step is a number of 41 digits, not a whole number >= 1"),
    "manifest.json:optimizer.lr=nan":
        N("{S}/manifest.json: optimizer.lr is NaN, not a finite number > 0"),
    "manifest.json:optimizer.betas[0]=infinity":
        N("{S}/manifest.json: optimizer.betas[0] is Infinity, not a finite number >= 0 and < 1"),
    'manifest.json:files["model-00000-of-00002.safetensors"].sha256=string': N(
        '{S}/manifest.json: files["model-00000-of-00002.safetensors"].sha256 is "x", not 64 '
        'lowercase hex digits'),
    "manifest.json:history[0].layout.tp=number": N(
        "{S}/manifest.json: history[0].layout.tp is 7, but layout.tp is 2 (the last segment "
        "is the run that wrote the checkpoint)"),
    "manifest.json:layout.extra":
        N("{S}/manifest.json: layout.extra is not a field of a planc checkpoint manifest"),
    "manifest.json:model.layers=number":
        "the checkpoint's model differs from the plan's: layers = 7 in the checkpoint, 2 in "
        "the plan",
    "manifest.json:rng-file-up": N(f'{{S}}/manifest.json: rng.file is "..", {PLAIN}'),
    f"{MODEL0}:outside-link": N(f"{{S}}/{MODEL0} {LINKED}"),
    f"{MODEL1}:fifo":
        N(f"{{S}}/{MODEL1} cannot be read (it is a named pipe (FIFO), not a regular file)"),
    f"{OPT1}:cut-in-half-resigned":
        N(f'{{S}}/{OPT1}: tensor "layers.1.fc2.weight.exp_avg" has invalid data_offsets'),
    f"{STEP}:outside-link":
        N("{S} is a symbolic link; a checkpoint's step directories lie inside it"),
    "latest:names-up": '{D}/latest names "../x", not a step-NNNNNN directory of {D}',
    f"{MODEL0}:{QKV}[3, 17]=inf": f"checkpoint {{S}}: {QKV} holds inf at index (3, 17)",
    f"{OPT0}:{QKV}.exp_avg_sq[3, 17]=nan":
        f"checkpoint {{S}}: {QKV}.exp_avg_sq holds nan at index (3, 17)",
    f"{OPT0}:{QKV}.exp_avg_sq[3, 17]=-0.5":
        f"checkpoint {{S}}: {QKV}.exp_avg_sq holds -0.5 at index (3, 17); a second moment (a "
        f"mean of squares) is never negative",
    f"{MODEL0}:header-offsets-overlap": N(
        f'{{S}}/{MODEL0}: tensor "layers.0.ln1.bias" starts at byte 10624 of the data, not '
        f'10560 (tensors overlap or leave a gap)'),
    f"{MODEL0}:header-dtype-i32":
        N(f"{{S}}/{MODEL0}: {QKV} is I32 [16, 48], the manifest says F32 [16, 48]"),
    "rng.safetensors:no-tensor": N("{S}/rng.safetensors: torch.cpu is nothing, not the bytes "
                                   "(U8, one dimension) of torch's CPU generator state"),
    f"{MODEL0}:tensor-extra": N(f'{{S}}/{MODEL0} holds "layers.9.qkv.weight", which the '
                                 f'manifest does not list'),
    "rng.safetensors:tensor-extra":
        N('{S}/rng.safetensors holds "torch.cuda", which the manifest does not list'),
    "rng.safetensors:zeros": "checkpoint {S}: rng.safetensors holds a torch.cpu state that "
                             "torch's CPU generator does not take (Invalid mt19937 state)",
    f"{fmt.MODEL_INDEX}:up": N(
        f'{{S}}/{fmt.MODEL_INDEX}: its weight_map maps "{QKV}" to "../outside/{MODEL0}", the '
        f'manifest to "{MODEL0}"'),
}


def test_the_refusals_say_exactly_what_is_wrong(verdicts):
    for name, expected in EXPECTED.items():
        _, message, root = verdicts[name]
        assert message == expected.format(D=root, S=root / STEP), name


def test_export_names_a_parameter_its_model_does_not_have(pristine, corpus, tmp_path):
    """A checkpoint whose model block says llama but whose parameters are gpt's: export
    once reached hf_name's ValueError."""
    from planc.runtime.checkpoint.export_hf import export_hf

    damage = next(d for d in corpus if d.name == "manifest.json:model.family=llama")
    root = materialize(pristine[0], damage, tmp_path)
    with pytest.raises(fmt.CheckpointError) as refused:
        export_hf(str(root), str(tmp_path / "hf"))
    assert str(refused.value) == f"{root / STEP}: its parameters are not its model's " \
        f"(final_ln.bias is [16] in the checkpoint, absent in its llama model)"
    assert not (tmp_path / "hf").exists()


def test_what_may_be_damaged_is_accepted(pristine, tmp_path):
    """The intact checkpoint; ``latest`` missing or naming a step directory that is not
    there: the newest step directory is taken (docs/checkpoints.md)."""
    checkpoint, _, plan, buckets = pristine
    for what in ("intact", "latest-missing", "latest-elsewhere"):
        root = tmp_path / what
        shutil.copytree(checkpoint, root)
        if what == "latest-missing":
            (root / LATEST).unlink()
        elif what == "latest-elsewhere":
            (root / LATEST).write_text("step-000009\n")
        assert refusal(root, plan, buckets, tmp_path) == ("accepted", ""), what
        found = fmt.find(root)
        assert found.directory == root / STEP
        assert found.skipped == ([] if what != "latest-elsewhere" else [
            f"{root / LATEST} names step-000009, which cannot be read (No such file or "
            f"directory)"])


FUZZ_CASES = 400


def test_a_fuzz_of_the_manifest_is_refused_or_read_never_crashes(pristine, tmp_path):
    """Manifests changed at random in one to three places (a value deleted, given a wrong
    value, or given another field's value): what the readers do not refuse they read
    without an exception other than CheckpointError."""
    import random

    checkpoint, _, plan, buckets = pristine
    root = tmp_path / "ckpt"
    shutil.copytree(checkpoint, root)
    document = manifest_of(root)
    paths = list(nodes(document))
    rng = random.Random(20)
    verdicts = Counter()
    for case in range(FUZZ_CASES):
        data = json.loads(json.dumps(document))
        for _ in range(rng.randint(1, 3)):
            path = rng.choice(paths)
            holder = data
            try:
                for key in path[:-1]:
                    holder = holder[key]
                what = rng.random()
                if what < 0.3:
                    del holder[path[-1]]
                else:
                    holder[path[-1]] = json.loads(json.dumps(
                        WRONG[rng.choice(list(WRONG))] if what < 0.7 else
                        value_at(document, rng.choice(paths)), allow_nan=True))
            except (KeyError, IndexError, TypeError):  # an earlier change removed the place
                pass
        write_manifest(root, data)
        verdict, message = refusal(root, plan, buckets, tmp_path)
        assert verdict != "crash", (case, message)
        assert "\n" not in message, (case, message)
        verdicts[verdict] += 1
    # the two read: each gave a field the value it had (a parameter's own shape or file)
    assert verdicts == {"refused": 398, "accepted": 2}


# --- the real commands ----------------------------------------------------------------------

# Imported by the driver before it forks, so that each run starts at once.
PRELOAD = ("planc.cli", "planc.commands", "planc.commands.run", "planc.commands.export",
           "planc.checkpoint.format", "planc.lang", "planc.compile", "planc.build.directory",
           "planc.runtime.checkpoint.values", "planc.runtime.checkpoint.export_hf")
DRIVER = f"""
import importlib, sys
sys.path.insert(0, {str(ROOT)!r})
from tests import hostile_inputs
for module in {PRELOAD!r}:
    importlib.import_module(module)
sys.exit(hostile_inputs._drive(sys.argv[1:]))
"""
MEMORY_LIMIT = 8 << 30  # the driver holds torch: more address space than a plan check


def run_jobs(jobs: list[hostile.Job], scratch: Path) -> list[hostile.Result]:
    """Every job in a child forked from a driver that imported planc and torch."""
    scratch.mkdir(parents=True)
    jobs_path, results_path = scratch / "jobs.json", scratch / "results.json"
    jobs_path.write_text(json.dumps([asdict(job) for job in jobs]))
    done = subprocess.run([sys.executable, "-c", DRIVER, "drive", str(jobs_path),
                           str(results_path), "--workers", "2", "--memory-limit",
                           str(MEMORY_LIMIT)], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-5000:]
    return [hostile.Result(**r) for r in json.loads(results_path.read_text())]


def test_the_commands_refuse_a_sample_with_status_1(pristine, corpus, verdicts, tmp_path):
    """planc run PLAN --resume D and planc export D --format hf: status 1, one line, no
    traceback, nothing trained; planc run says what the readers said in this process."""
    checkpoint, plan_file = pristine[:2]
    cases, jobs = [], []
    for damage in (d for d in corpus if d.cli):
        directory = tmp_path / f"{len(cases):02d}"
        directory.mkdir()
        root = materialize(checkpoint, damage, directory)
        for argv in (["run", str(plan_file), "-o", str(directory / "build"), "--resume",
                      str(root), "--timeout", "60"],
                     ["export", str(root), "--format", "hf", "-o", str(directory / "hf")]):
            cases.append((damage, argv[0], root, directory))
            jobs.append(hostile.Job(f"{damage.name} :: {argv[0]}", argv, str(directory),
                                    "fork", 60.0))
    results = run_jobs(jobs, tmp_path / "driver")
    assert len(results) == 2 * len(CLI)
    failures = []
    for (damage, command, root, directory), result in zip(cases, results):
        _, message, first_root = verdicts[damage.name]
        lines = result.stderr.strip().splitlines()
        found = []
        if result.status != 1 or result.timed_out or result.signal:
            found.append(f"status {result.status}, signal {result.signal}")
        if hostile.TRACEBACK in result.markers or hostile.TRACEBACK in result.stderr:
            found.append("a traceback")
        if len(lines) != 1 or not lines[0].startswith("planc: error: "):
            found.append("not one planc: error: line")
        elif message.replace(str(first_root), str(root)) not in lines[0] and (
                command == "run" or not message.startswith("the checkpoint's")):
            found.append("not the message of the readers in this process")  # but the plan's
        if "planc: running" in result.stderr or (directory / "build" / "logs").exists():
            found.append("training started")
        if found:
            failures.append(f"{result.name}: {'; '.join(found)}\n  {result.stderr[-600:]!r}")
    assert not failures, "\n".join(failures)


def _torchrun_resuming(pristine, damage: Damage, tmp_path: Path, capfd, ports: int):
    """The damaged checkpoint, and two ranks of torchrun resuming a tp = 2 build from it
    (no planc run to check the values first)."""
    from planc.cli import main

    root = materialize(pristine[0], damage, tmp_path)
    plan = tmp_path / "w.plan"
    plan.write_text(PLAN.format(mesh="tp = 2", steps=STEPS))
    assert main(["compile", str(plan), "-o", str(tmp_path / "b")]) == 0
    capfd.readouterr()
    port = str(ports + os.getpid() % 1000)
    return root, subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--master-port", port, "-m", "planc.runtime.worker", str(tmp_path / "b"),
         "--resume", str(root)], cwd=ROOT, capture_output=True, text=True, timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_the_workers_check_the_values_they_read(pristine, tmp_path, capfd):
    """torchrun ... -m planc.runtime.worker --resume D has no planc run to check the values
    first: each rank checks the blocks it reads. Under tp = 2 only rank 1 reads column 41
    of qkv (a column of its v head): it names the index in the whole tensor, and every
    rank stops with that one line."""
    damage = Damage("inf", "values", (QKV,), edit_tensors(MODEL0, set_value(QKV, (3, 41),
                                                                                INF)))
    root, result = _torchrun_resuming(pristine, damage, tmp_path, capfd, 30500)
    assert result.returncode != 0
    assert result.stderr.count("planc: error:") == 1, result.stderr
    assert f"planc: error: checkpoint {root / STEP}: {QKV} holds inf at index (3, 41)\n" in \
        result.stderr, result.stderr
    # both ranks stopped on the shared verdict: none aborted on its way out
    assert "SIGABRT" not in result.stderr and "terminate called" not in result.stderr
    assert "planc/runtime" not in result.stderr  # no traceback of planc's (torchrun has its own)
    assert "step 3/3" not in result.stderr  # nothing trained


def test_the_workers_refuse_a_negative_second_moment_they_read(pristine, tmp_path, capfd):
    """Guards Loading._load_bucket under torchrun: a negative exp_avg_sq stops every rank."""
    damage = Damage("negative", "values", (f"{QKV}.exp_avg_sq",), edit_tensors(
        OPT0, set_value(f"{QKV}.exp_avg_sq", (3, 41), -0.5)))
    root, result = _torchrun_resuming(pristine, damage, tmp_path, capfd, 31500)
    assert result.returncode != 0
    assert result.stderr.count("planc: error:") == 1, result.stderr
    assert (f"planc: error: checkpoint {root / STEP}: {QKV}.exp_avg_sq holds -0.5 at index "
            f"(3, 41); a second moment (a mean of squares) is never negative\n"
            in result.stderr), result.stderr
    assert "step 3/3" not in result.stderr  # nothing trained


def _refused_by_export(pristine, tmp_path: Path, edit) -> str:
    """What export says of the pristine checkpoint with its manifest edited by ``edit``
    (writing nothing), after the checkpoint's own path."""
    from planc.runtime.checkpoint.export_hf import export_hf

    root = materialize(pristine[0], Damage("model", "field", ("model",), edit), tmp_path)
    with pytest.raises(fmt.CheckpointError) as refused:
        export_hf(str(root), str(tmp_path / "hf"))
    assert not (tmp_path / "hf").exists()
    said = f"{root} holds no complete checkpoint (1 incomplete or damaged; the newest: " \
        f"{root / STEP}/manifest.json: "
    assert str(refused.value).startswith(said), refused.value
    return str(refused.value)[len(said):]


def test_a_model_block_of_another_family_is_refused_by_its_keys(pristine, tmp_path):
    """A manifest whose model block names a family whose keys it lacks (a gpt checkpoint
    said to be a mixture) is refused as planc check would refuse the block: export once
    reached the family's missing key (AttributeError)."""
    assert _refused_by_export(pristine, tmp_path, _set(("model", "family"), "moe")) == \
        "model.options has no experts, a key of model moe)"


@pytest.mark.parametrize("value, shown", [(None, "null"), ([4], "[4]"), ({"a": 1}, "an object")])
def test_a_family_key_without_a_value_is_refused_by_its_name(pristine, tmp_path, value, shown):
    """A key of model.options holding null (or a list, or an object) is named with what
    it holds: the message once said "model.options is an object, not an object of a
    family's keys and their values", naming neither the key nor its value."""
    edit = _set(("model", "options"), {"dropout": value})
    assert _refused_by_export(pristine, tmp_path, edit) == \
        f"model.options.dropout is {shown}, not a number, text, true or false)"


def test_export_says_which_newer_checkpoint_it_passed_over(pristine, tmp_path, capfd):
    """planc export of a checkpoint directory whose newest step directory is damaged
    takes the newest intact one and says first what it passed over, as planc run
    --resume does (it once said nothing); this gpt checkpoint then has no transformers
    class."""
    from planc.cli import main

    root = tmp_path / "ck"
    shutil.copytree(pristine[0], root)
    shutil.copytree(root / STEP, root / "step-000003")  # step 2's state under step 3's name
    (root / LATEST).write_text("step-000003\n")
    capfd.readouterr()
    status = main(["export", str(root), "--format", "hf", "-o", str(tmp_path / "hf")])
    err = capfd.readouterr().err.splitlines()
    assert status == 1 and len(err) == 2, err
    assert err[0] == f"planc: warning: passed over a checkpoint: {root}/step-000003 holds " \
        f"the checkpoint of step 2, not of the step its name says"
    assert err[1].startswith(f"planc: error: {root / STEP} holds a model gpt; --format hf")
