"""The fused call: generated code for an op's cached calls.

Two pieces, each built as one ``ast.Module`` from nodes (``ast.FunctionDef``, ``ast.If``,
``ast.Try``, ``ast.Name``, ...) and compiled with ``compile(module, ...)``: no code is written
as text. The names are the plan's parsed input names (``t_<input>``, the record's
``s_<input>`` / ``d_<input>`` fields, each checked to be an identifier), and the check is the
signature's own, handed over as parsed statements (``point.fast_bodies``). ``ast.unparse`` of
the module is kept for display (``op._fast_source``, and the source ``class_call`` returns);
the compiled code has no source lines of its own. Instances whose fused calls would be the
same module share its compiled code (``_compiled``), each with globals of its own.

- ``class_call(plan)``: each op class with an entry and tensor inputs gets a ``__call__``
  whose inputs are positional-only parameters. It tests for tracing first (so dynamo guards
  on nothing of the instance), then hands a plain call straight to the instance's fused call
  (``op._fast``); keywords, ``out=``, a wrong number of inputs, or no fused call yet go to
  ``Op._general_call`` with the inputs exactly as given.
- ``build_fast_call(op, call)``: after a call succeeds through ``Op._run_call``, an instance
  whose calls are plain (no delegates, no parent, no construction-time tensors, outputs
  allocated by the base class) gets its fused call, compiled once (``op._fast_source`` holds
  the source). Per presence combination of the optional inputs it runs the steps of
  ``_run_call`` in the same order, with every decision that call took folded in:

  1. the signature's hot-path check body, inlined (a copy of ``point.fast_bodies``'
     statements, then its record); any miss goes to ``_run_call``, whose check raises the
     precise error, before anything is written;
  2. the binding it was built for is still the instance's (``_target_builder``), else
     ``_run_call``;
  3. when an input requires grad and grad mode is on, the call as an autograd node
     (``Op._graph_call``, with the record the check made: it refuses a forward-only op);
  4. for a target, the kernel: the last one this body ran when device, dtypes and shapes
     match it, else ``_target_kernels`` under the key ``_run_call`` uses; a miss goes to
     ``_run_call``, which builds it;
  5. the outputs: ``empty_like`` of the input the output always matches when that input is
     contiguous, else the branch's cached allocator (the branch of each body is known when
     generating; a body whose branch no call has taken yet goes to ``_run_call`` and drops
     the fused call, which the next success rebuilds);
  6. the kernel (target) or ``forward`` (in-tree; its ``self.kernel`` lookup as usual);
  7. ``last_call``.

The fused call never binds, builds or selects, so it takes no lock and needs no CUDA graph
capture guard (those live on the paths it hands over). A kernel or ``forward`` that raises
leaves ``last_call`` as it was and, since the call did not bind the target, resets nothing,
as in ``_run_call``. ``_reset_binding`` drops the fused call; the next call that succeeds
through ``_run_call`` builds it again.

The check's globals are the point's ``namespace`` entries its statements read; any other name
they read must be a parameter of the function or a builtin, and the locals the fused call adds
(``call``, ``dev``, ``kernel``, ...) must be names the check does not bind. Both are verified
when building, so a check that the runtime cannot place is an error there, not a wrong call.
"""

from __future__ import annotations

import ast
import builtins
import functools
from typing import TYPE_CHECKING, Any

import torch
from torch.compiler import is_dynamo_compiling as _is_dynamo_compiling

from .memory import share_memory
from .registry import UNRESOLVED

if TYPE_CHECKING:  # pragma: no cover
    from tileops.signature import ConstructionPoint, SignatureCall

    from .op import Op

__all__ = ["NOT_GIVEN", "build_fast_call", "class_call", "class_function"]


def build_fast_call(op: Op, call: SignatureCall) -> tuple[Any, str] | None:
    """``(function, source)`` of ``op``'s fused call after ``call`` succeeded, or None when
    the instance's calls need the general path."""
    cls = type(op)
    plan = cls._signature
    if (plan is None or op._parent is not None or op._composite or cls.construction_tensors
            or not cls.allocate_outputs or "forward" in vars(op)):
        return None
    builder = op._target_builder
    if builder is UNRESOLVED:
        return None
    if not plan.input_names:
        return None
    ns: dict[str, Any] = {"_rt_B": builder, "_rt_grad": _grad_enabled, "_rt_NO": NOT_GIVEN,
                          "_rt_empty_like": torch.empty_like, "_rt_forward": cls.forward,
                          "_rt_ovl": torch._debug_has_internal_overlap,
                          "_rt_share": share_memory}
    fused = _Fused(op, op._point, builder, ns)
    module = ast.Module([_function("fast", _arguments(["op", *fused.params]), fused.body())],
                        type_ignores=[])
    key = (cls, op._point, builder is None, tuple(fused.allocations))
    compiled = _compiled.get(key)
    if compiled is None:
        code = compile(ast.fix_missing_locations(module),
                       f"<tileops.runtime fused call {cls.__name__}>", "exec")
        compiled = _compiled.setdefault(key, (code, ast.unparse(module)))
    exec(compiled[0], ns)  # noqa: S102 - built from nodes: the plan's names and parsed check
    return ns["fast"], compiled[1]


#: Compiled fused calls, by what their code depends on: the class, the construction point,
#: whether a target serves the instance, and how each body allocates (not yet known, like the
#: input at an index, or through an allocator). Instances that agree build the same module
#: (the globals it names are interned in the same order), so they share its code object and
#: source and differ only in the globals (builder, memos, allocators): placing a module's
#: positions, compiling it and unparsing it cost about 3 ms, building its nodes a fifth of that.
_compiled: dict[tuple, tuple[Any, str]] = {}


#: the fused call's own locals besides its parameters; a check body must bind none of them
_LOCALS = frozenset({"op", "call", "dev", "m", "kernel", "y", "outputs"})


class _Fused:
    """The body of one instance's fused call: the presence tree of its optional inputs, one
    leaf per combination (as in the check, ``point.fast_bodies``)."""

    def __init__(self, op: Op, point: ConstructionPoint, builder: Any,
                 ns: dict[str, Any]) -> None:
        self.op, self.point, self.builder, self.ns = op, point, builder, ns
        plan = point.plan
        self.names: tuple[str, ...] = plan.input_names
        self.params = [_t(n) for n in self.names]
        self.optional = set(plan.optional_inputs)
        self.buffers = plan.buffer_outputs
        #: per body, in tree order: None (a branch not taken yet), the index of the input
        #: the output is allocated like, or "allocator"
        self.allocations: list[int | str | None] = []

    def body(self) -> list[ast.stmt]:
        out: list[ast.stmt] = []
        for n in self.names:  # an input the caller left out (only optional ones reach here)
            if n in self.optional:
                out.append(_if(_is(_load(_t(n)), _load("_rt_NO")), [_assign(_t(n), _none())]))
        for n in self.buffers:  # out= goes to the general path: never given here
            out.append(_assign(_t(n), _none()))
        return out + self._tree(list(self.point.plan.optional_inputs), {})

    def _tree(self, remaining: list[str], presence: dict[str, bool]) -> list[ast.stmt]:
        if remaining:
            n, rest = remaining[0], remaining[1:]
            return [_if(_is(_load(_t(n)), _none()), self._tree(rest, {**presence, n: False}),
                        self._tree(rest, {**presence, n: True}))]
        return self._leaf(presence)

    def _packed(self) -> ast.expr:
        """``(t_a, t_b)``: the inputs, as ``_run_call`` takes them."""
        return _tuple([_load(p) for p in self.params])

    def _general(self) -> ast.stmt:
        """``return op._run_call((t_a, t_b), {})``: the general path, with the inputs."""
        return _return(_call(_attr(_load("op"), "_run_call"), self._packed(),
                             ast.Dict(keys=[], values=[])))

    def _intern(self, prefix: str, value: Any) -> str:
        """A fresh global of the fused call holding ``value`` (``_rt_<prefix><n>``)."""
        name = f"_rt_{prefix}{len(self.ns)}"
        self.ns[name] = value
        return name

    def _leaf(self, presence: dict[str, bool]) -> list[ast.stmt]:
        body = next(b for b in self.point.fast_bodies if b.presence == presence)
        allocate = self.op._effect_branches.get(body.branch)
        self.allocations.append(allocate if allocate is None or allocate.__class__ is int
                                else "allocator")
        if allocate is None:  # a branch no call has taken yet: the general path, then rebuild
            return [_assign_attr(_load("op"), "_fast", _none()), self._general()]
        given = [n for n in self.names if presence.get(n, True)]
        self._place(body, given)
        # 1. the check (a miss: the general path, whose check raises the precise error)
        out: list[ast.stmt] = [ast.Try(
            body=[*map(_own, body.statements), _assign("call", _own(body.record))],
            handlers=[ast.ExceptHandler(type=_load("Exception"), name=None,
                                        body=[self._general()])],
            orelse=[], finalbody=[])]
        # an input the body writes whose elements share memory, or two written inputs that
        # share it: the general path refuses them
        written = body.branch[0]
        for n in written:
            out.append(_if(_eq(_call(_load("_rt_ovl"), _load(_t(n))), ast.Constant(1)),
                           [self._general()]))
        for i, a in enumerate(written):
            for b in written[i + 1:]:
                out.append(_if(_call(_load("_rt_share"), _load(_t(a)), _load(_t(b))),
                               [self._general()]))
        # 2. still bound as when this was built (a reset or another binding: the general path)
        out.append(_if(_is_not(_attr(_load("op"), "_target_builder"), _load("_rt_B")),
                       [self._general()]))
        # 3. the autograd node (requires_grad first: it is False on the common path, which then
        # skips the mode read; with no input given nothing can require grad)
        if given:
            grads = _bool(ast.Or(), [_attr(_load(_t(n)), "requires_grad") for n in given])
            out.append(_if(_bool(ast.And(), [grads, _call(_load("_rt_grad"))]),
                           [_return(_call(_attr(_load("op"), "_graph_call"), _load("call"),
                                          self._packed(), _none()))]))
        if self.builder is not None:
            out += self._target_kernel(presence, given)
        # 5. the outputs
        if allocate.__class__ is int:  # one output, like the input at that index
            src = _t(self.names[allocate])
            out.append(_assign("y", ast.IfExp(
                test=_call(_attr(_load(src), "is_contiguous")),
                body=_call(_load("_rt_empty_like"), _load(src)),
                orelse=_call(_attr(_load("op"), "_like_output"), _load("call"),
                             self._packed()))))
            outs: list[ast.expr] = [_load("y")]
            result: ast.expr = _load("y")
        else:
            alloc = self._intern("alloc", allocate)
            out.append(_assign("outputs", _call(_load(alloc), _load("call"), self._packed(),
                                                _none())))
            outs = [ast.Starred(_load("outputs"), ast.Load())]
            result = ast.IfExp(test=_eq(_call(_load("len"), _load("outputs")), ast.Constant(1)),
                               body=_item(_load("outputs"), 0), orelse=_load("outputs"))
        # 6. run; 7. publish
        args = [*(_load(p) for p in self.params), *outs]
        if self.builder is not None:
            out.append(ast.Expr(_call(_load("kernel"), *args)))
        else:
            out.append(ast.Expr(_call(_load("_rt_forward"), _load("op"), _load("call"), *args)))
        out.append(_assign_attr(_load("op"), "_last_call", _load("call")))
        out.append(_return(result))
        return out

    def _target_kernel(self, presence: dict[str, bool], given: list[str]) -> list[ast.stmt]:
        """4. a target kernel: the last one this body ran, if the call has its device, dtypes
        and shapes; else the key ``_run_call`` uses, in ``_target_kernels`` (a miss: the
        general path builds it). The memo is this function's own: a reset drops the function.
        """
        memo = self._intern("memo", [(None,) * (2 * len(given) + 2)])
        same = []
        for i, n in enumerate(given):
            same += [_is(_load(f"d_{n}"), _item(_load("m"), 2 * i)),
                     _eq(_load(f"s_{n}"), _item(_load("m"), 2 * i + 1))]
        same.append(_eq(_load("dev"), _item(_load("m"), 2 * len(given))))
        key = _tuple([_load("dev"),
                      _tuple([_load(f"d_{n}") if presence.get(n, True) else _none()
                              for n in self.names]),
                      _tuple([_load(f"s_{n}") if presence.get(n, True) else _none()
                              for n in self.names])])
        reads = [_load(f"{p}_{n}") for n in given for p in ("d", "s")]
        return [
            _assign("dev", _attr(_load("call"), "device")),
            _assign("m", _item(_load(memo), 0)),
            _if(_bool(ast.And(), same), [_assign("kernel", _item(_load("m"), -1))], [
                _assign("kernel", _call(_attr(_attr(_load("op"), "_target_kernels"), "get"),
                                        key)),
                _if(_is(_load("kernel"), _none()), [self._general()]),
                ast.Assign(targets=[ast.Subscript(_load(memo), ast.Constant(0), ast.Store())],
                           value=_tuple([*reads, _load("dev"), _load("kernel")])),
            ]),
        ]

    def _place(self, body: Any, given: list[str]) -> None:
        """Give the fused call the globals ``body`` reads, after checking that every other
        name it reads is a local of the call (an input, an ``out=`` buffer) or a builtin, that
        it binds the ``s_`` / ``d_`` reads of each given input (the kernel key and memo use
        them) and none of the call's own locals."""
        cls = type(self.op).__name__
        own = set(self.params) | {_t(n) for n in self.buffers}
        for name in sorted(body.reads):
            if name in self.point.namespace:
                value = self.point.namespace[name]
                if self.ns.setdefault(name, value) is not value:
                    raise RuntimeError(f"{cls}: the signature's check reads a global "
                                       f"{name!r} that the fused call defines otherwise")
            elif name not in own and not hasattr(builtins, name):
                raise RuntimeError(f"{cls}: the signature's check reads {name!r}, which is "
                                   f"neither in its point's namespace, an input nor a builtin")
        needed = {f"{p}_{n}" for n in given for p in ("s", "d")}
        if not needed <= body.binds or body.binds & (_LOCALS | own):
            raise RuntimeError(
                f"{cls}: the signature's check binds {sorted(body.binds)}; the fused call "
                f"needs {sorted(needed)} and keeps {sorted(_LOCALS | own)} for itself")


def class_call(plan: Any) -> tuple[Any, str]:
    """``(__call__, source)`` for an op class: its inputs as positional-only parameters, so a
    plain call reaches the instance's fused call with no packing; anything else (keywords,
    ``out=``, too many or too few inputs, tracing, no fused call yet) goes to
    ``Op._general_call`` with the inputs exactly as given."""
    return class_function(plan), ast.unparse(_class_module(*_class_key(plan)))


def class_function(plan: Any) -> Any:
    """The ``__call__`` of :func:`class_call`, without its source text. Each class compiles
    its own code object (a traced frame is cached per code object, so classes do not share
    one); the module, which depends only on the input names, which are optional and whether
    a construction may leave an output out of the result, is built once for every class with
    those."""
    module = _class_module(*_class_key(plan))
    ns: dict[str, Any] = {"_NO": NOT_GIVEN, "_idc": _is_dynamo_compiling,
                          "_fta": torch._C._are_functorch_transforms_active}
    code = compile(module, f"<tileops.runtime {plan.name}.__call__>", "exec")
    exec(code, ns)  # noqa: S102 - built from nodes over the plan's names
    return ns["__call__"]


def _class_key(plan: Any) -> tuple[tuple[str, ...], frozenset[str], bool]:
    return (tuple(plan.input_names), frozenset(plan.optional_inputs) & frozenset(plan.input_names),
            plan.may_leave_out)


@functools.cache
def _class_module(names: tuple[str, ...], optional: frozenset[str],
                  picks: bool = False) -> ast.Module:
    """``picks``: a construction may leave outputs out of the result (``returned``), so each
    path's full result goes through the instance's ``_result`` (Op: the returned outputs
    picked, or the identity). The compile boundary's custom op returns every output (the
    pick follows it), and a gradient whose backward op leaves some out runs that op's general
    call (autograd.py), which gives them all."""
    params = [_t(n) for n in names]

    def ret(value: ast.expr) -> ast.stmt:
        return _return(_call(_attr(_load("self"), "_result"), value) if picks else value)

    def general() -> ast.stmt:
        # the inputs as given: (() if t_a is _NO else (t_a,)) + ... + _rest
        terms: list[ast.expr] = [ast.IfExp(test=_is(_load(p), _load("_NO")), body=_tuple([]),
                                           orelse=_tuple([_load(p)])) for p in params]
        given = terms[0]
        for term in [*terms[1:], _load("_rest")]:
            given = ast.BinOp(given, ast.Add(), term)
        return ret(_call(_attr(_load("self"), "_general_call"), given, _load("_kw")))

    # tracing is tested first: dynamo then reads (and guards on) nothing of the instance
    missing = [_is(_load(_t(n)), _load("_NO")) for n in names if n not in optional]
    body = [
        _if(_call(_load("_idc")), [general()]),
        _assign("fast", _attr(_load("self"), "_fast")),
        # torch.func transforms active: the general call refuses them by name
        _if(_bool(ast.Or(), [_is(_load("fast"), _none()), _load("_kw"), _load("_rest"),
                             *missing, _call(_load("_fta"))]), [general()]),
        ret(_call(_load("fast"), _load("self"), *(_load(p) for p in params))),
    ]
    args = ast.arguments(posonlyargs=[ast.arg(a) for a in ("self", *params)], args=[],
                         vararg=ast.arg("_rest"), kwonlyargs=[], kw_defaults=[],
                         kwarg=ast.arg("_kw"), defaults=[_load("_NO") for _ in params])
    return ast.fix_missing_locations(
        ast.Module([_function("__call__", args, body)], type_ignores=[]))


class _NotGiven:
    def __repr__(self) -> str:
        return "<not given>"


#: the default of a generated ``__call__``'s input parameters: "the caller passed nothing"
NOT_GIVEN: Any = _NotGiven()

_grad_enabled = torch._C.is_grad_enabled


# --- nodes ---------------------------------------------------------------------------------------


def _own(node: Any) -> Any:
    """A copy of one of the signature's nodes for this module: its fields copied, its
    positions (those of the check's text) left for ``ast.fix_missing_locations`` to set."""
    if isinstance(node, ast.AST):
        return type(node)(**{f: _own(getattr(node, f)) for f in node._fields
                             if hasattr(node, f)})
    if isinstance(node, list):
        return [_own(item) for item in node]
    return node  # an identifier, an operator's name or a constant's value: immutable


def _t(input_name: str) -> str:
    """The parameter of an input: ``t_<input>`` (the signature's name for it)."""
    return "t_" + input_name


def _name(name: str, ctx: ast.expr_context) -> ast.Name:
    if not name.isidentifier():  # compile() does not check what a Name holds
        raise ValueError(f"fused call: {name!r} is not a Python identifier")
    return ast.Name(name, ctx)


def _load(name: str) -> ast.Name:
    return _name(name, ast.Load())


def _none() -> ast.Constant:
    return ast.Constant(None)


def _attr(value: ast.expr, attr: str) -> ast.Attribute:
    return ast.Attribute(value, attr, ast.Load())


def _item(value: ast.expr, index: int) -> ast.Subscript:
    return ast.Subscript(value, ast.Constant(index), ast.Load())


def _call(func: ast.expr, *args: ast.expr) -> ast.Call:
    return ast.Call(func, list(args), [])


def _tuple(items: list[ast.expr]) -> ast.Tuple:
    return ast.Tuple(items, ast.Load())


def _is(left: ast.expr, right: ast.expr) -> ast.Compare:
    return ast.Compare(left, [ast.Is()], [right])


def _is_not(left: ast.expr, right: ast.expr) -> ast.Compare:
    return ast.Compare(left, [ast.IsNot()], [right])


def _eq(left: ast.expr, right: ast.expr) -> ast.Compare:
    return ast.Compare(left, [ast.Eq()], [right])


def _bool(op: ast.boolop, values: list[ast.expr]) -> ast.expr:
    """``a and b and ...`` (or ``or``); one value stands for itself."""
    return values[0] if len(values) == 1 else ast.BoolOp(op, values)


def _if(test: ast.expr, body: list[ast.stmt], orelse: list[ast.stmt] | None = None) -> ast.If:
    return ast.If(test, body, orelse or [])


def _assign(target: str, value: ast.expr) -> ast.Assign:
    return ast.Assign(targets=[_name(target, ast.Store())], value=value)


def _assign_attr(obj: ast.expr, attr: str, value: ast.expr) -> ast.Assign:
    return ast.Assign(targets=[ast.Attribute(obj, attr, ast.Store())], value=value)


def _return(value: ast.expr) -> ast.Return:
    return ast.Return(value)


def _arguments(params: list[str]) -> ast.arguments:
    return ast.arguments(posonlyargs=[], args=[ast.arg(p) for p in params], vararg=None,
                         kwonlyargs=[], kw_defaults=[], kwarg=None, defaults=[])


def _function(name: str, args: ast.arguments, body: list[ast.stmt]) -> ast.FunctionDef:
    fn = ast.FunctionDef(name=name, args=args, body=body, decorator_list=[], returns=None)
    if "type_params" in ast.FunctionDef._fields:  # Python 3.12+ (PEP 695)
        fn.type_params = []
    return fn
