"""What a rank receives from its peers (issue 20): never a pickle, only JSON text and
tensors, and a message of another form stops the rank with one line.

- A real 2-rank run under torchrun with --check, --trace and checkpoints, then a resume
  from its checkpoint, with a ``sitecustomize`` that kills a worker the moment it
  unpickles anything (the ``pickle.find_class`` audit event, and pickle's loaders).
- planc's source holds no ``*_object`` collective, no pickle and no ``torch.load``
  without ``weights_only=True``.
- Two real ranks: one sends the other bytes that are not UTF-8, not JSON, JSON nested
  beyond Python's recursion limit, JSON of another form and an oversized message.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

from planc.cli import main  # noqa: E402
from tests.conftest import ROOT  # noqa: E402

pytestmark = pytest.mark.slow

PLAN = """plan two_stages {
  model gpt { layers = 2; hidden = 32; heads = 4; vocab = 128; seq = 16; batch = 4 }
  mesh { pp = 2 }
  schedule { microbatches = 2 }
  train { steps = 3; optimizer = adamw(lr = 0.01); seed = 3 }
}
"""

# Loaded by every Python process started with this directory on PYTHONPATH; inert until
# the process runs planc's worker (torchrun's own agent may use pickle as it likes).
SITECUSTOMIZE = '''
import os, pickle, sys, traceback

def _in_worker():
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    return spec is not None and spec.name == "planc.runtime.worker"

def _refuse(what):
    sys.stderr.write(f"UNPICKLED in a planc worker: {what}\\n")
    traceback.print_stack(file=sys.stderr)
    sys.stderr.flush()
    os._exit(97)

_marked = []

def _audit(event, args):
    if not _in_worker():
        return
    if not _marked:  # one file per worker: the hook was active there
        _marked.append(1)
        open(os.path.join(os.environ["NO_PICKLE_MARKS"], str(os.getpid())), "w").close()
    if event == "pickle.find_class":
        _refuse(f"{args[0]}.{args[1]}")

sys.addaudithook(_audit)

class _Unpickler(pickle.Unpickler):  # pickles of plain data name no class
    def load(self):
        if _in_worker():
            _refuse("pickle.Unpickler.load")
        return super().load()

def _guarded(name, function):
    def guarded(*args, **kwargs):
        if _in_worker():
            _refuse(f"pickle.{name}")
        return function(*args, **kwargs)
    return guarded

pickle.Unpickler = _Unpickler
pickle.load = _guarded("load", pickle.load)
pickle.loads = _guarded("loads", pickle.loads)
'''


def _torchrun(build: Path, *args: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
         "2", "-m", "planc.runtime.worker", str(build), *args], cwd=ROOT,
        capture_output=True, text=True, timeout=300, env=env)


def test_a_worker_unpickles_nothing_from_its_peers(tmp_path, capfd):
    (tmp_path / "two.plan").write_text(PLAN)
    assert main(["compile", str(tmp_path / "two.plan"), "-o", str(tmp_path / "b")]) == 0
    capfd.readouterr()
    hooks, marks = tmp_path / "hooks", tmp_path / "marks"
    hooks.mkdir()
    marks.mkdir()
    (hooks / "sitecustomize.py").write_text(SITECUSTOMIZE)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "NO_PICKLE_MARKS": str(marks),
           "PYTHONPATH": os.pathsep.join([str(hooks), str(ROOT)])}
    saved, trace = tmp_path / "ckpt", tmp_path / "t.json"
    first = _torchrun(tmp_path / "b", "--steps", "2", "--check", "--trace", str(trace),
                      "--checkpoint-dir", str(saved), env=env)
    assert first.returncode == 0, first.stderr[-4000:]
    assert "UNPICKLED" not in first.stderr
    assert "check: 2 steps and" in first.stderr
    assert "every loss and parameter matches" in first.stderr
    assert len(list(marks.iterdir())) == 2  # the hook watched both workers
    events = json.loads(trace.read_text())["traceEvents"]
    assert {e["pid"] for e in events if e["ph"] == "X"} == {0, 1}
    assert (saved / "latest").read_text() == "step-000002\n"
    resumed = _torchrun(tmp_path / "b", "--resume", str(saved), "--check",
                        "--checkpoint-dir", str(saved), env=env)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert "UNPICKLED" not in resumed.stderr
    assert f"planc: resumed from {saved / 'step-000002'} at step 2" in resumed.stderr
    assert "check: 1 step (from step 2, resumed) and" in resumed.stderr
    assert "every loss and parameter matches" in resumed.stderr
    assert len(list(marks.iterdir())) == 4
    assert (saved / "latest").read_text() == "step-000003\n"


# --- the source -----------------------------------------------------------------------------

PICKLERS = {"pickle", "_pickle", "cPickle", "dill", "cloudpickle", "joblib", "shelve"}


def _problems(path: Path, root: Path = ROOT) -> list[str]:
    """Every way of unpickling in one module: an ``*_object`` or ``*_object_list``
    collective, an import of a pickle module, ``torch.load`` without
    ``weights_only=True``, numpy's ``allow_pickle=True``."""
    tree = ast.parse(path.read_text(), str(path))
    found = []
    for node in ast.walk(tree):
        where = f"{path.relative_to(root)}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Import):
            found += [f"{where}: import {a.name}" for a in node.names
                      if a.name.split(".")[0] in PICKLERS]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in PICKLERS:
            found.append(f"{where}: from {node.module} import")
        elif isinstance(node, ast.Call):
            name = node.func.attr if isinstance(node.func, ast.Attribute) else \
                getattr(node.func, "id", "")
            keywords = {k.arg: k.value for k in node.keywords}
            if name.endswith(("_object", "_object_list")):
                found.append(f"{where}: {name}(")
            elif name == "load" and isinstance(node.func, ast.Attribute) and \
                    getattr(node.func.value, "id", "") == "torch" and not (
                        isinstance(keywords.get("weights_only"), ast.Constant)
                        and keywords["weights_only"].value is True):
                found.append(f"{where}: torch.load without weights_only=True")
            elif isinstance(keywords.get("allow_pickle"), ast.Constant) and \
                    keywords["allow_pickle"].value is True:
                found.append(f"{where}: allow_pickle=True")
    return found


def test_planc_holds_no_way_of_unpickling():
    found = [p for path in sorted((ROOT / "planc").rglob("*.py")) for p in _problems(path)]
    assert found == []


def test_the_source_check_finds_each_way_of_unpickling(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text("import pickle\nfrom cloudpickle import loads\nimport torch\n"
                      "dist.gather_object(a, b)\ndist.broadcast_object_list(c)\n"
                      "torch.load(f)\ntorch.load(f, weights_only=True)\n"
                      "numpy.load(f, allow_pickle=True)\n")
    assert _problems(sample, tmp_path) == [
        "sample.py:1: import pickle", "sample.py:2: from cloudpickle import",
        "sample.py:4: gather_object(", "sample.py:5: broadcast_object_list(",
        "sample.py:6: torch.load without weights_only=True", "sample.py:8: allow_pickle=True"]


# --- a peer that sends something else -----------------------------------------------------

RANKS = r'''
import sys
import torch, torch.distributed as dist
from planc.runtime.engine import exchange

rank, path = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo", rank=rank, world_size=2, store=dist.FileStore(path, 2))
EVENTS = exchange.list_of(exchange.row(exchange.integer, exchange.text))
SENT = [b"\xff\xfe", b"{'quoted': 'singly'}", b"[" * 100000 + b"]" * 100000,
        b'[[1, "a"], [2]]', b'[[1, "a"], [true, "b"]]', b'[[1, "a"]]']
for payload in SENT:
    if rank == 1:  # bytes as they come, on the wire as planc's own messages travel
        exchange.gather_flat(torch.tensor(list(payload), dtype=torch.uint8), 0, "bytes",
                             exchange.MAX_JSON_BYTES)
        continue
    try:
        print(exchange.gather_json([[0, "mine"]], 0, EVENTS, "its events"))
    except SystemExit as stopped:
        print(stopped.code)
if rank == 1:  # announces a message of a terabyte and sends nothing
    sizes = [torch.empty(1, dtype=torch.int64) for _ in range(2)]
    dist.all_gather(sizes, torch.tensor([2**40]))
else:
    try:
        exchange.gather_json([[0, "mine"]], 0, EVENTS, "its events")
    except SystemExit as stopped:
        print(stopped.code)
sys.stdout.flush()
import os
os._exit(0)
'''


def test_a_peer_that_sends_anything_but_the_expected_json_stops_the_rank_with_one_line(
        tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    ranks = [subprocess.Popen([sys.executable, "-c", RANKS, str(rank), str(tmp_path / "s")],
                              cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=env) for rank in (0, 1)]
    outputs = [rank.communicate(timeout=120) for rank in ranks]
    assert [rank.returncode for rank in ranks] == [0, 0], outputs
    stopped = "; the run was stopped"
    assert outputs[0][0].splitlines() == [
        "planc: error: rank 1 sent its events in a form planc does not expect (not UTF-8 "
        "text)" + stopped,
        "planc: error: rank 1 sent its events in a form planc does not expect (not JSON: "
        "Expecting property name enclosed in double quotes: line 1 column 2 (char 1))"
        + stopped,
        "planc: error: rank 1 sent its events in a form planc does not expect (not JSON: "
        "maximum recursion depth exceeded while decoding a JSON array from a unicode "
        "string)" + stopped,
        "planc: error: rank 1 sent its events in a form planc does not expect (JSON of "
        "another form)" + stopped,
        "planc: error: rank 1 sent its events in a form planc does not expect (JSON of "
        "another form)" + stopped,  # true is JSON's boolean, not the integer the form asks
        "[[[0, 'mine']], [[1, 'a']]]",
        "planc: error: rank 1 announced its events of 1099511627776 elements, where planc "
        "accepts 0 to 1073741824" + stopped]
    assert "Traceback" not in outputs[0][1] + outputs[1][1]
