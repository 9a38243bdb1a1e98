"""A CPU rank's intra-op (OpenMP) threads: the compute stream runs with the rank's count,
the rank's main thread with one while the streams run (a second team of OpenMP threads in
the process slows every parallel operator of the first: planc.runtime.engine.executor),
and each thread keeps the count it asked for whatever another thread sets later."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

from conftest import ONE_RANK_PLAN, ROOT, one_rank_printed, run_one_rank

# conftest's 1-rank plan with an evaluation after every step
EVALUATED_PLAN = ONE_RANK_PLAN.replace("seed = 0 }", "seed = 0; eval_every = 1; eval_batches = 2 }")

# Two threads ask for their counts in turn, each before the other's first operator;
# each then reads back its own.
TWO_THREADS = textwrap.dedent("""
    import json, threading, torch
    from planc.runtime.launcher.torch_threads import own_intra_op_threads
    own_intra_op_threads(1)
    first_set, second_set, seen = threading.Event(), threading.Event(), {}
    def first():
        own_intra_op_threads(2); first_set.set(); second_set.wait()
        seen["first"] = torch.get_num_threads()
    def second():
        first_set.wait(); own_intra_op_threads(1); second_set.set()
        seen["second"] = torch.get_num_threads()
    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for t in threads: t.start()
    for t in threads: t.join()
    seen["main"] = torch.get_num_threads()
    print(json.dumps(seen))
""")

# One rank of a 1-rank plan (conftest.run_one_rank), started as torchrun starts it (planc.runtime.worker's
# main), every compute kernel and every step's record noting the thread it ran on and
# that thread's intra-op count (the evaluations' too), as do the --check comparison and the writing of the
# last step's checkpoint in the background (--checkpoint-async).
ONE_RANK = textwrap.dedent("""
    import json, sys, threading, torch
    import planc.runtime.oracle.check as check
    import planc.runtime.worker as worker
    from planc.runtime.checkpoint.checkpoints import Checkpoints
    from planc.runtime.engine.kernels import Kernels
    seen = {"kernels": set(), "records": set(), "check": set(), "checkpoint": set()}
    def noting(where, function):
        def noted(*args, **kwargs):
            seen[where].add((threading.current_thread().name, torch.get_num_threads()))
            return function(*args, **kwargs)
        return noted
    Kernels.forward = noting("kernels", Kernels.forward)
    worker.StepRecords.step = noting("records", worker.StepRecords.step)
    check.compare = noting("check", check.compare)
    Checkpoints._finish = noting("checkpoint", Checkpoints._finish)
    evaluated, evaluating = [], worker.Evaluator.run
    def evaluate(*args, **kwargs):
        evaluated.append(evaluating(*args, **kwargs))
        return evaluated[-1]
    worker.Evaluator.run = evaluate
    saving = Checkpoints.save
    def save_after_another_thread_asked_for_two(*args, **kwargs):
        # the value torch shares between threads is now 2, whatever the streams set
        other = threading.Thread(target=torch.set_num_threads, args=(2,))
        other.start()
        other.join()
        return saving(*args, **kwargs)
    Checkpoints.save = save_after_another_thread_asked_for_two
    status = worker.main([sys.argv[1], "--steps", "2", "--check", "--checkpoint-dir",
                          sys.argv[2], "--checkpoint-async"])
    print(json.dumps({"status": status, "evaluations": len(evaluated),
                      **{k: sorted(v) for k, v in seen.items()}}))
""")


def test_a_thread_keeps_the_count_it_asked_for_when_another_thread_asks_later():
    # torch sets a thread's count from a value every thread shares on its first
    # operator: asked for without a read first, the first thread got the second's 1
    done = subprocess.run([sys.executable, "-c", TWO_THREADS], capture_output=True,
                          text=True, cwd=ROOT, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "2"})
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen == {"first": 2, "second": 1, "main": 1}


def test_the_compute_stream_gets_the_ranks_threads_and_the_main_thread_one(tmp_path):
    assert EVALUATED_PLAN != ONE_RANK_PLAN
    seen = one_rank_printed(run_one_rank(ONE_RANK, tmp_path,
                                         str(tmp_path / "checkpoints"), threads=2,
                                         plan_text=EVALUATED_PLAN))
    assert seen["status"] == 0
    # the evaluation's forwards too, on the training's compute thread: an executor of
    # its own computed them on a thread with one intra-op thread
    assert seen["kernels"] == [["stream-compute", 2]]
    assert seen["evaluations"] == 2
    assert seen["records"] == [["MainThread", 1]]
    # the streams are gone: the one-process reference of --check gets the cores again
    assert seen["check"] == [["MainThread", 2]]
    assert seen["checkpoint"] == [["planc-checkpoint-2", 1]]
