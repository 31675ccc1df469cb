"""tileops.spec: the TileOPs spec language as typed, validated schemas.

Load spec YAML into frozen Structs (:func:`load_spec_file`; a file's ``families:`` block is
applied to its entries there), parse and print expressions
(:func:`parse_expr`, :func:`print_expr`), and validate (:func:`check_paths`,
:func:`validate_entry`). ``python -m tileops.spec check PATH...`` runs the validator.
"""

from . import expr, stored
from .errors import Diagnostic, SpecError, SpecLoadError
from .evaluate import AdtValue, EvalError, Scope, eval_shape, evaluate
from .expr import ExprSyntaxError, Node
from .expr import parse as parse_expr
from .expr import unparse as print_expr
from .kinds import DTYPES, Kind, KindError, kind_from_expr
from .loader import load_spec_file, load_spec_text, load_types_file, load_types_text
from .primitives import GENERATORS, PRIMITIVES
from .schema import (
    AdtDef,
    Backward,
    Composition,
    Constructor,
    Expr,
    FamilyCase,
    FamilyDef,
    Feed,
    GradOf,
    Grid,
    GridRow,
    GridUse,
    InputDecl,
    OpEntry,
    OutputDecl,
    ParamDecl,
    Roofline,
    Saved,
    Signature,
    SpecFile,
    Stage,
    TypeFamily,
    TypesFile,
    Workload,
    feed_of,
)
from .validate import (
    RULES,
    EntryModel,
    check_paths,
    validate_entry,
    validate_spec_file,
    validate_types,
)

__version__ = "0.1.0"

__all__ = [
    "DTYPES",
    "GENERATORS",
    "PRIMITIVES",
    "RULES",
    "AdtDef",
    "AdtValue",
    "Backward",
    "Composition",
    "Constructor",
    "Diagnostic",
    "EntryModel",
    "EvalError",
    "Expr",
    "ExprSyntaxError",
    "FamilyCase",
    "FamilyDef",
    "Feed",
    "GradOf",
    "Grid",
    "GridRow",
    "GridUse",
    "InputDecl",
    "Kind",
    "KindError",
    "Node",
    "OpEntry",
    "OutputDecl",
    "ParamDecl",
    "Roofline",
    "Saved",
    "Scope",
    "Signature",
    "SpecError",
    "SpecFile",
    "SpecLoadError",
    "Stage",
    "TypeFamily",
    "TypesFile",
    "Workload",
    "check_paths",
    "eval_shape",
    "evaluate",
    "expr",
    "stored",
    "feed_of",
    "kind_from_expr",
    "load_spec_file",
    "load_spec_text",
    "load_types_file",
    "load_types_text",
    "parse_expr",
    "print_expr",
    "validate_entry",
    "validate_spec_file",
    "validate_types",
]
