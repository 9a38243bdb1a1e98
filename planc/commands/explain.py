"""``planc explain``: why each transfer exists, and what the passes did."""

from __future__ import annotations

from planc.commands import EXIT_OK, EXIT_USAGE, fail, load_build


def main(args) -> int:
    from planc.lang.schema import did_you_mean
    from planc.views import explain_text

    built, status = load_build(args)
    if built is None:
        return status
    graph, plan = built.graph, built.plan
    if args.layer is not None and not 0 <= args.layer < plan.model.layers:
        return fail(f"layer {args.layer} does not exist; the plan has layers "
                    f"0..{plan.model.layers - 1}", EXIT_USAGE)
    if args.param is not None:
        params = {p for n in graph.nodes for p in graph.nodes[n].get("params", [])}
        if args.param not in params:
            hint = did_you_mean(args.param, params)
            return fail(f"the plan has no parameter {args.param!r}" +
                         (f"; {hint}" if hint else ""), EXIT_USAGE)
    print(explain_text.explain(plan, graph, args.layer, args.param, args.axis, args.buckets,
                               args.routes), end="")
    return EXIT_OK
