"""``planc diff A B``: two plans or builds side by side."""

from __future__ import annotations

import argparse

import os

from planc.commands import EXIT_OK, EXIT_USAGE, fail, load_programs


def main(args) -> int:
    from planc.simulate import simulate
    from planc.views import diff_text

    if args.set_b and os.path.isdir(args.b):
        return fail(f"--set-b needs B to be a .plan file, but {args.b} is a build directory; "
                    f"name the plan file instead", EXIT_USAGE)
    sides = []
    for path, overrides in ((args.a, []), (args.b, args.set_b or [])):
        side = argparse.Namespace(file=path, set=overrides, error_format=args.error_format)
        built, status = load_programs(side, verified=True)
        if built is None:
            return status
        sides.append((path, built, simulate(built), overrides))
    print(diff_text.render(sides), end="")
    return EXIT_OK
