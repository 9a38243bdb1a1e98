"""``planc diff A B``: two plans or builds side by side."""

from __future__ import annotations

import argparse

from planc.commands import EXIT_OK, load_programs


def main(args) -> int:
    from planc.simulate import simulate
    from planc.views import diff_text

    sides = []
    for path, overrides in ((args.a, []), (args.b, args.set_b or [])):
        side = argparse.Namespace(file=path, set=overrides, error_format=args.error_format)
        built, status = load_programs(side)
        if built is None:
            return status
        sides.append((path, built, simulate(built), overrides))
    print(diff_text.render(sides), end="")
    return EXIT_OK
