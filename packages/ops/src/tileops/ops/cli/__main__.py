"""``python -m tileops.ops.cli``: the ``tileops`` command."""

from . import main

main(prog_name="tileops")
