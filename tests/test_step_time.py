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
