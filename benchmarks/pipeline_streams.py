"""What the pipeline's communicators cost on a backend that runs each communicator's operations in issue order on one
stream (NCCL), in a timed model: the step time of each schedule with every point-to-point operation on one
communicator, and with one communicator per edge direction (`pipeline_comm.edge_channel`, what training uses),
against the schedule's dependencies alone (`schedules.simulate` with the same transfer time).

The model: each rank's host runs its actions (a forward takes t_f, a backward t_b + t_w or t_b and t_w apart, a
chunk of an interleaved schedule 1/v of that) and posts each operation of `pipeline_comm.posting_plan` as a unit
of its own when the plan says (as `PointToPoint.post` does); an action waits for its input's receive. Each
(rank, communicator) has one stream; its head operation starts once posted and once the one before it completed;
a send and its receive complete together, `transfer` after both are at the heads of their streams (a rendezvous:
NCCL's large messages). The NCCL test model, tests/test_pipeline_p2p_replay.py, checks the same postings for
deadlock; this one times them.

    python benchmarks/pipeline_streams.py
"""

from __future__ import annotations

import argparse
from collections import defaultdict

from fivefold.parallel.pipeline_comm import posting_plan, remote_input
from fivefold.parallel.schedules import Schedule, build_schedule, simulate


def step_time(schedule: Schedule, transfer: float, per_edge: bool, t_f: float = 1.0) -> float:
    """The modelled step time (t_b = t_w = t_f; a chunk of a v-chunk schedule takes 1/v of a stage's time)."""
    v = schedule.v
    duration = {"F": t_f / v, "B": (1 if schedule.split_backward else 2) * t_f / v, "W": t_f / v}
    programs = []
    for rank, actions in enumerate(schedule.actions):
        plan = posting_plan(schedule, rank)
        program = [("post", op) for op in plan[0]]
        for k, action in enumerate(actions):
            if (key := remote_input(schedule, action)) is not None:
                program.append(("wait", key))
            program.append(("compute", duration[action.kind]))
            program += [("post", op) for op in plan[k + 1]]
        programs.append(program)

    def channel(op) -> int:
        return op.channel if per_edge else 0

    host, pc = [0.0] * schedule.p, [0] * schedule.p
    streams: defaultdict[tuple[int, int], list[dict]] = defaultdict(list)
    head: defaultdict[tuple[int, int], int] = defaultdict(int)
    free_at: defaultdict[tuple[int, int], float] = defaultdict(float)  # when the stream's previous unit completed
    receive: dict[tuple[int, tuple], dict] = {}
    progress = True
    while progress:
        progress = False
        for r in range(schedule.p):  # the hosts, until they wait for a receive not completed yet
            while pc[r] < len(programs[r]):
                what, arg = programs[r][pc[r]]
                if what == "post":
                    unit = {"op": arg, "posted": host[r], "start": None, "end": None}
                    streams[(r, channel(arg))].append(unit)
                    if not arg.send:
                        receive[(r, arg.message.key)] = unit
                elif what == "compute":
                    host[r] += arg
                else:
                    unit = receive.get((r, arg))
                    if unit is None or unit["end"] is None:
                        break
                    host[r] = max(host[r], unit["end"])
                pc[r] += 1
                progress = True
        for key, stream in list(streams.items()):  # a head unit starts once posted and its stream is free
            if head[key] < len(stream) and stream[head[key]]["start"] is None:
                unit = stream[head[key]]
                unit["start"] = max(unit["posted"], free_at[key])
                progress = True
        for (r, c), stream in list(streams.items()):  # a send at a head meets its receive at the peer's head
            if head[(r, c)] >= len(stream):
                continue
            unit = stream[head[(r, c)]]
            if unit["start"] is None or unit["end"] is not None or not unit["op"].send:
                continue
            peer = (unit["op"].message.dst, c)
            if head[peer] >= len(streams[peer]):
                continue
            other = streams[peer][head[peer]]
            if other["start"] is None or other["op"].message.key != unit["op"].message.key:
                continue
            unit["end"] = other["end"] = max(unit["start"], other["start"]) + transfer
            progress = True
        for key, stream in streams.items():
            while head[key] < len(stream) and stream[head[key]]["end"] is not None:
                free_at[key] = stream[head[key]]["end"]
                head[key] += 1
                progress = True
    if any(pc[r] < len(programs[r]) for r in range(schedule.p)):
        raise RuntimeError(f"{schedule.name}: the model deadlocked (per_edge = {per_edge})")
    return max(max(host), max(free_at.values(), default=0.0))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--transfers", default="0.05,0.2", help="transfer times, as shares of a stage's forward")
    args = parser.parse_args()
    transfers = [float(t) for t in args.transfers.split(",")]
    print("step time over the dependency-only time (schedules.simulate with the same transfer time); t_b = t_w = "
          "t_f = 1, a transfer of one activation or gradient as a share of t_f\n")
    print("| schedule | pp | micro-batches | transfer | dependency-only step | one communicator | one per edge "
          "direction |\n|---|---|---|---|---|---|---|")
    for name, p, m, v in (("1f1b", 4, 8, 1), ("interleaved", 4, 8, 2), ("zero-bubble", 4, 8, 1),
                          ("dualpipev", 4, 8, 1), ("1f1b", 8, 16, 1), ("interleaved", 8, 16, 2)):
        schedule = build_schedule(name, p, m, v)
        for transfer in transfers:
            t = 1.0 / schedule.v
            bound = simulate(schedule, t, t, t, p2p=transfer).makespan
            one, edge = step_time(schedule, transfer, False), step_time(schedule, transfer, True)
            print(f"| {name} | {p} | {m} | {transfer:g} | {bound:.2f} | {one / bound:.3f} | {edge / bound:.3f} |")


if __name__ == "__main__":
    main()
