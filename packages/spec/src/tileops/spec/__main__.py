"""``python -m tileops.spec check PATH...`` and ``python -m tileops.spec show PATH...``."""

from __future__ import annotations

import argparse
import sys

from .show import render_entry
from .validate import RULES, check_paths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tileops.spec",
        description="Validate and print TileOPs spec files (YAML).",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    check = sub.add_parser("check", help="validate spec files or folders; exit 1 on errors")
    check.add_argument("paths", nargs="+", metavar="PATH")
    show = sub.add_parser("show", help="validate, then print every entry's signature")
    show.add_argument("paths", nargs="+", metavar="PATH")
    args = parser.parse_args(argv)

    loaded, diags = check_paths(args.paths)
    for d in diags:
        print(f"{d}  [{d.rule}]", file=sys.stderr)
    entries = sum(len(s.entries) for s in loaded)
    if args.command == "show":
        for s in loaded:
            for name, entry in s.entries.items():
                print(render_entry(name, entry))
                print()
    if diags:
        print(f"{len(diags)} error(s) in {entries} entries ({len(loaded)} files)", file=sys.stderr)
        return 1
    print(f"ok: {entries} entries in {len(loaded)} files; rules checked: {', '.join(RULES)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
