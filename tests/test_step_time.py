"""What a step's time counts: every piece of the step's work, the zeroing of the gradient
buffers included (planc.runtime.engine.executor; docs/metrics.md, ``time_s``)."""

from __future__ import annotations

import textwrap

from conftest import one_rank_printed, run_one_rank

# One rank whose gradient zeroing lasts at least ZEROING_S: each step's recorded time
# must hold it. (A lower bound: sleeping never takes less than asked.)
ZEROING_S = 0.3
SLOW_ZEROING = textwrap.dedent(f"""
    import json, sys, time
    import planc.runtime.worker as worker
    from planc.runtime.engine.store import ParamStore
    zeroing = ParamStore.zero_grads
    def slow_zeroing(self):
        zeroing(self)
        time.sleep({ZEROING_S})
    ParamStore.zero_grads = slow_zeroing
    status = worker.main([sys.argv[1], "--steps", "2", "--metrics", sys.argv[2]])
    records = [json.loads(line) for line in open(sys.argv[2])]
    print(json.dumps({{"status": status, "times": [r["time_s"] for r in records],
                      "waits": [[r[k] for k in ("comm_s", "exposed_comm_s", "pipeline_wait_s",
                                                 "slowest_rank")] for r in records]}}))
""")


def test_a_steps_time_counts_the_zeroing_of_its_gradients(tmp_path):
    seen = one_rank_printed(run_one_rank(SLOW_ZEROING, tmp_path,
                                         str(tmp_path / "metrics.jsonl")))
    assert seen["status"] == 0
    assert len(seen["times"]) == 2
    assert all(time_s >= ZEROING_S for time_s in seen["times"]), seen["times"]
    # one rank: no communication to wait for (its loss's all-reduce over a group of one
    # costs a call) and no pipeline
    assert [w[1:] for w in seen["waits"]] == [[0.0, 0.0, 0]] * 2
    assert all(w[0] >= 0 for w in seen["waits"]), seen["waits"]


# Two data-parallel ranks; rank 1's optimizer sleeps DELAY_S in step 0, after the step's
# last collective. Step 0 is then rank 1's slowest (it ends DELAY_S later); in step 1
# rank 0 starts DELAY_S earlier and waits in the gradients' all-reduce for rank 1, so
# step 1 is rank 0's. Each record names that rank and holds its time.
DELAY_S = 0.5
DELAYED_OPTIMIZER = textwrap.dedent(f"""
    import os, sys, time
    import planc.runtime.worker as worker
    from planc.runtime.engine.interpreter import Interpreter
    optimizer = Interpreter._optimizer
    slept = []
    def delayed(self, state, step, mb):
        if os.environ["RANK"] == "1" and state.step == 0 and not slept:
            slept.append(True)
            time.sleep({DELAY_S})
        return optimizer(self, state, step, mb)
    Interpreter._optimizer = delayed
    sys.exit(worker.main([sys.argv[1], "--steps", "2", "--metrics", sys.argv[2]]))
""")


def test_a_steps_time_is_its_slowest_ranks(tmp_path):
    import json

    from conftest import ONE_RANK_PLAN, run_ranks

    metrics = tmp_path / "metrics.jsonl"
    done = run_ranks(DELAYED_OPTIMIZER, tmp_path, str(metrics), world=2,
                     plan_text=ONE_RANK_PLAN.replace("mesh { }", "mesh { dp = 2 }"))
    assert [rank.returncode for rank in done] == [0, 0], [r.stderr[-2000:] for r in done]
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [(r["step"], r["slowest_rank"]) for r in records] == [(0, 1), (1, 0)]
    assert all(r["time_s"] >= DELAY_S * 0.5 for r in records), records
    assert records[0]["time_s"] >= DELAY_S
