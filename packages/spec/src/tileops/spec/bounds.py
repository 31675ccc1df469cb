"""The bounds every spec input is held to, so that accepting or refusing one takes well under
a second and never ends in ``RecursionError``, ``MemoryError`` or a hang.

A spec is input: a power tower (``9 ** 9 ** 9``), a thousand-digit constant, a YAML alias
bomb or a ten-thousand-deep list is refused with a ``file:line`` error instead of being
computed. Each bound is checked where the thing it bounds is made: the text and YAML tree in
:mod:`.loader`, an expression's text, depth and literals in :mod:`.expr`, every integer and
sequence a computation makes in :mod:`.evaluate` (which the signature package also uses at
op construction, so the same bounds hold there).
"""

from __future__ import annotations

__all__ = [
    "MAX_EXPR_CHARS",
    "MAX_EXPR_DEPTH",
    "MAX_FILE_WORKLOADS",
    "MAX_INT",
    "MAX_POW_EXPONENT",
    "MAX_SEQUENCE",
    "MAX_SPEC_BYTES",
    "MAX_YAML_DEPTH",
    "MAX_YAML_NODES",
    "int_in_range",
]

#: The largest integer magnitude a spec may write or compute. Tensor sizes, element counts,
#: strides and the counts of a roofline are int64 in torch, so a value beyond 2**63 - 1 is
#: no size and no count; holding every integer to it keeps each operation machine-sized.
MAX_INT = 2**63 - 1

#: An integer power ``a ** b`` with ``|a| >= 2`` and ``b`` above this exceeds MAX_INT
#: (2**64 > MAX_INT), so it is refused before it is computed, whatever ``a`` is.
MAX_POW_EXPONENT = 63

#: The longest expression text. The shipped specs' longest is under 100 characters; a
#: formula ten times that belongs in several ``let``s. It also keeps Python's parser (which
#: parses the text before any depth can be measured) far from its own nesting limits.
MAX_EXPR_CHARS = 1000

#: The deepest expression tree. A sum of 50 terms (a left-leaning chain of 50) is still one
#: expression, and the parser, printer and evaluator (each recursive) stay far below
#: Python's recursion limit of 1000 however they nest.
MAX_EXPR_DEPTH = 50

#: The longest sequence an evaluation may build (a generated metadata tensor, a spliced
#: shape): 2**22 elements holds the index tensor of a large MoE workload (512k tokens x top-8)
#: and takes about 0.1 s to build in Python.
MAX_SEQUENCE = 2**22

#: The largest spec file. The shipped files are under 8 KiB; pure-Python YAML reads about a
#: MiB a second, so 256 KiB loads in a fraction of one.
MAX_SPEC_BYTES = 256 * 1024

#: The deepest YAML nesting (mappings and lists inside each other, aliases expanded). A
#: spec entry nests about eight levels (entry, signature, inputs, x, ...); the loader and the
#: line table are recursive, and 64 keeps them far from Python's recursion limit.
MAX_YAML_DEPTH = 64

#: The most YAML nodes a file may expand to once every alias is replaced by what it names.
#: A file of MAX_SPEC_BYTES written out plainly has fewer (a node takes at least two bytes);
#: an alias bomb (nine lists of nine aliases of the one before) has billions and is refused
#: before anything walks it.
MAX_YAML_NODES = 200_000

#: The most workloads one entry may have once its grid items are expanded. The shipped entries
#: have under 50; each workload is a test and a benchmark case, and a grid of many rows
#: expanded by many items would otherwise multiply into more than any run could use (and
#: the validator checks every one).
MAX_WORKLOADS = 4096

#: The most workloads the entries of one file may have together (the shipped files have at
#: most some 600): the validator instantiates every one, and thousands of entries each using a
#: large grid would keep it for minutes where a spec must be accepted or refused in about a
#: second.
MAX_FILE_WORKLOADS = 8192


def int_in_range(value: int) -> bool:
    """Whether an integer is within MAX_INT (``bit_length`` reads the size without
    converting a huge int to text)."""
    return value.bit_length() <= MAX_INT.bit_length()
