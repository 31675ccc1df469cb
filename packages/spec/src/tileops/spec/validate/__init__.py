"""The static validator: every rule a spec must satisfy before anything is generated from it.

Rules (each :class:`~tileops.spec.errors.Diagnostic` carries its rule id):

``index-source``  every index has exactly one source: forall, construction param, let or data.
``unknown-name``  expressions name only known indices, tensors, families and primitives.
``kind``          kinds agree wherever an index is used (a Shape is spliced with ``*``, a
                  predicate is Bool, a formula is a number, a dtype is a DType, ...).
``family``        every type family is total over its discriminant, with no case twice.
``let-cycle``     ``let`` definitions do not depend on each other in a cycle.
``solvable``      every forall index is solved by unification from the required inputs.
``effects``       effects are consistent: alias names an input of the same dtype and shape
                  that is mutated (at least in some calls: the output is that input object
                  in the calls that write it, a fresh tensor in the others); write_only only
                  on a mutated input; buffer never with alias; effect predicates depend only
                  on construction params and presence; present(x) only on a tensor that may
                  be absent.
``workload``      every workload row instantiates: all indices given, dtypes from the declared
                  sets, values of the right kind, shapes non-negative, refinements hold.
``default``       a construction param's default is a value of its kind.
``adt``           ADT constructors have valid field kinds, a Python class path and a Bool
                  invariant.
``composition``   stages are uniquely named and name known ops.
``bounds``        no part of an expression that names nothing computes a value beyond the
                  bounds of :mod:`tileops.spec.bounds` (``9 ** 9 ** 9``); the loader and the
                  evaluator hold the rest of a spec to them.
``backward``      a forward's ``backward:`` block names a backward entry of the file, feeds
                  every input of it, maps gradients to outputs, and the two signatures'
                  shapes and dtypes unify.

One module a concern: :mod:`.infer` (the kinds of expressions), :mod:`.values` (YAML values
against kinds), :mod:`.signature` (index sources, defaults, let, refinements, roofline,
composition), :mod:`.families`, :mod:`.effects`, :mod:`.solvable`, :mod:`.workloads`,
:mod:`.adts` (types.yaml), :mod:`.backward`; :mod:`.entry` runs them on an entry in dependency order and
:mod:`.files` on files and folders. :mod:`.context` holds what they share.
"""

from .adts import validate_types
from .context import EntryModel
from .entry import validate_entry
from .files import check_paths, spec_paths, validate_spec_file

__all__ = [
    "EntryModel",
    "RULES",
    "check_paths",
    "spec_paths",
    "validate_entry",
    "validate_spec_file",
    "validate_types",
]

RULES = (
    "index-source",
    "unknown-name",
    "kind",
    "family",
    "let-cycle",
    "solvable",
    "effects",
    "workload",
    "default",
    "adt",
    "composition",
    "bounds",
    "backward",
)
