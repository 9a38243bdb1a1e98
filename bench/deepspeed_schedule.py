"""DeepSpeed's pipeline schedule against 1F1B's time (docs/simulate.md, "What the A100
tables still miss").

BLOOM and MT-NLG ran DeepSpeed's pipeline engine, whose ``TrainSchedule``
(``deepspeed/runtime/pipe/schedule.py``) runs ``2 (m + p - 1)`` steps: a stage computes a
forward on the steps of its own parity and a backward on the others, and at the start
of each step exchanges with one neighbour through blocking sends and receives
(``deepspeed/runtime/pipe/p2p.py``). This replays that order of instructions, each
send meeting its receive (the later of the two arrivals, plus ``transfer``), and prints
the step's time beside 1F1B's ``(m + p - 1) (F + B)``.

    python3 bench/deepspeed_schedule.py [--forward 1] [--backward 3] [--transfer 0]
"""

from __future__ import annotations

import argparse

FORWARD, BACKWARD = "forward", "backward"


def step_commands(microbatches: int, stages: int, stage: int) -> list[tuple]:
    """The instructions of one stage, in TrainSchedule's order: ("send" | "recv", what,
    microbatch, peer) and (FORWARD | BACKWARD, microbatch)."""
    commands, previous = [], -1

    def valid(microbatch: int) -> bool:
        return 0 <= microbatch < microbatches

    for step in range(2 * (microbatches + stages - 1)):
        forward = step % 2 == stage % 2
        # the forward of microbatch j runs at step 2j + stage, its backward at
        # 2j + 2 stages - stage - 1
        microbatch = (step - stage) // 2 if forward else (step - 2 * stages + stage + 1) // 2
        if forward:
            if valid(previous) and stage > 0:
                commands.append(("send", "grad", previous, stage - 1))
            if valid(microbatch) and stage > 0:
                commands.append(("recv", "activation", microbatch, stage - 1))
        else:
            if valid(microbatch) and stage < stages - 1:
                commands.append(("recv", "grad", microbatch, stage + 1))
            if valid(previous) and stage < stages - 1:
                commands.append(("send", "activation", previous, stage + 1))
        if valid(microbatch):
            commands.append((FORWARD if forward else BACKWARD, microbatch))
        previous = microbatch
    return commands


def replay(microbatches: int, stages: int, forward: float, backward: float,
           transfer: float = 0.0) -> float:
    """When the last stage finishes, every send and receive blocking until its partner
    arrives."""
    programs = [step_commands(microbatches, stages, s) for s in range(stages)]
    position, clock = [0] * stages, [0.0] * stages
    # a transfer's key: (what, microbatch, sender, receiver)
    arrived: dict[tuple, float] = {}  # the first side to arrive, and when
    finished: dict[tuple, float] = {}  # met: when the transfer ends, for the other side
    progressed = True
    while progressed:
        progressed = False
        for stage in range(stages):
            program = programs[stage]
            while position[stage] < len(program):
                command = program[position[stage]]
                if command[0] in (FORWARD, BACKWARD):
                    clock[stage] += forward if command[0] == FORWARD else backward
                elif command[0] in ("send", "recv"):
                    kind, what, microbatch, peer = command
                    key = (what, microbatch) + ((stage, peer) if kind == "send" else
                                                (peer, stage))
                    if key in finished:  # the partner met this side's earlier arrival
                        clock[stage] = finished.pop(key)
                    elif key in arrived and arrived[key][0] != stage:
                        end = max(clock[stage], arrived.pop(key)[1]) + transfer
                        clock[stage] = finished[key] = end
                    else:
                        arrived.setdefault(key, (stage, clock[stage]))
                        break
                position[stage] += 1
                progressed = True
    if any(p < len(program) for p, program in zip(position, programs)):
        raise RuntimeError("the schedule deadlocked")
    return max(clock)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--forward", type=float, default=1.0)
    parser.add_argument("--backward", type=float, default=3.0,
                        help="a backward with full recomputation: 3 forwards")
    parser.add_argument("--transfer", type=float, default=0.0)
    args = parser.parse_args(argv)
    # MT-NLG at 280, 350 and 420 nodes, BLOOM-176B
    for microbatches, stages in ((240, 35), (192, 35), (160, 35), (128, 12)):
        deepspeed = replay(microbatches, stages, args.forward, args.backward, args.transfer)
        one_f_one_b = (microbatches + stages - 1) * (args.forward + args.backward)
        print(f"m {microbatches:3d}, p {stages:2d}: TrainSchedule {deepspeed:8.2f}, "
              f"1F1B {one_f_one_b:8.2f}, ratio {deepspeed / one_f_one_b:.4f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
