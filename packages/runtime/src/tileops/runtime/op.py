"""``Op``: the base class of every TileOPs operator.

A concrete op is a spec entry plus a constructor, a ``forward`` and the choice of kernel slot.
Everything else comes from here and from code generated from the entry:

- ``__init_subclass__`` finds the class's entry (by class name, in the class's ``specs`` set
  or the process-wide one) and installs its :class:`~tileops.signature.SignaturePlan`; a class
  without an entry installs none.
- ``Op.__init__`` runs the construction check and sets up the three groups of instance state
  (construction, binding, run); it reads no device property.
- ``op(*inputs, **outs)`` runs the seven steps of a call (see ``_run_call``); with grad mode
  on and an input requiring grad, as one autograd node (``_graph_call``, autograd.py), a
  composite op's whole call included when its entry declares a backward.
- an op pickles and deep-copies as its construction (``__reduce__``): the copy is a new
  instance with its own caches and locks.

Instance state (every field exists after construction):

| group        | fields                                                             | on reset    |
|--------------|--------------------------------------------------------------------|-------------|
| construction | params, ``target``, ``_installed_kernel_types``, ``_preferred_over``,| kept        |
|              | ``_keys_by_interface``, ``_construction_indices``, ``_instance_key``,|             |
|              | ``_init_args``, ``_records_node``, ``_result``, ``_fed_by_forward`` |             |
| binding      | ``_target_builder``, ``_serving_target``, ``_entries_by_call``,      | initial     |
|              | ``_built_entries``, ``_target_kernels``                             | values      |
| run          | construction-time tensors, ``_tune_requested``, ``_delegates``,     | kept        |
|              | ``_delegate_stages``, ``_effect_branches``, ``_last_call``,          |             |
|              | ``_tune_warned``, ``_backward_ops``                                |             |

What a family base derives from its params in ``derive()`` (its index readers among it)
belongs to the construction group
(written once, at the end of ``Op.__init__``, kept on reset). ``_entries_by_call`` also holds
a family base's memoised entries under its own tuple keys (``kernel_for``); they go with the
binding.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Iterator, Mapping
from operator import itemgetter
from types import MappingProxyType
from typing import Any, ClassVar

import torch
from torch.compiler import is_dynamo_compiling as _is_dynamo_compiling

from tileops.signature import SignatureCall, SignaturePlan, torch_adapter

from . import autograd, declared, lazy, log, targets
from .composite import Composite
from .errors import NoKernelError, TargetError
from .fastpath import build_fast_call, class_function
from .kernel import Kernel, KernelInterface, select
from .memory import has_data, share_memory
from .registry import UNRESOLVED, empty_from_record, instance_for_key, register_instance
from .specs import SpecSet, default_specs
from .trained import Trained


def _kept(given: Any, checked: Any) -> Any:
    """The value an instance keeps as a param's attribute: the checked one where the caller's
    object only spells it (a list for a tuple, which the caller could change afterwards; a
    NumPy integer), else the caller's own (a torch dtype, a tensor, an int where a float is
    declared: torch's clamp tells them apart)."""
    if isinstance(checked, tuple) and isinstance(given, list | tuple):
        return checked
    if type(given).__module__ != "builtins" and isinstance(checked, bool | int | float):
        return checked
    return given


#: the dtypes whose tensors cannot require grad, as a spec writes them
_INTEGRAL_DTYPE_NAMES = frozenset({"bool", "uint8", "int8", "int16", "int32", "int64",
                                   "uint16", "uint32", "uint64"})

__all__ = ["Op", "instance_for_key"]


_UNRESOLVED: Any = UNRESOLVED
_EMPTY: Mapping = MappingProxyType({})


class Op(declared.Equivalents, Composite, Trained):
    """Base of every operator (see the module docstring)."""

    # --- class attributes (installed by __init_subclass__ or declared by the op) -------------
    _signature: ClassVar[SignaturePlan | None] = None
    _param_names: ClassVar[tuple[str, ...]] = ()
    #: the stage names the entry's composition declares (None: the spec declares none)
    _declared_stages: ClassVar[tuple[str, ...] | None] = None
    #: slot (interface) -> its implementations, declared by ops that run their own kernels
    kernel_types: ClassVar[Mapping[type[KernelInterface], tuple[type[Kernel], ...]]] = _EMPTY
    #: role -> op class, for composite ops
    delegate_types: ClassVar[Mapping[str, type[Op]]] = _EMPTY
    #: construction-time tensors (attribute -> the dtype index they follow, or None)
    construction_tensors: ClassVar[Mapping[str, str | None]] = _EMPTY
    #: False for composite ops whose forward returns its outputs
    allocate_outputs: ClassVar[bool] = True
    #: None (contiguous), or ``output_memory_format(self, inputs) -> torch.memory_format``: the
    #: format of the outputs the op allocates fresh (not one like an input, an alias or a given
    #: buffer), eagerly and as the compile boundary's fakes (a channels-last pool's output)
    output_memory_format: ClassVar[Any] = None
    #: None (outputs like an input, and fresh ones, contiguous), or ``output_layout(self,
    #: inputs, shape) -> strides | None``: the strides of an output of ``shape`` the op
    #: allocates, like an input or fresh (None: contiguous), eagerly and as the compile
    #: boundary's fakes (the elementwise family's: torch's TensorIterator layout, so a
    #: transposed input gives a transposed output); consulted only where an input is not
    #: contiguous
    output_layout: ClassVar[Any] = None
    #: the torch.library ops this class registered, one per effect branch
    compile_op_names: ClassVar[tuple[str, ...]] = ()
    #: the entry's ``backward`` block resolved (autograd.py), or None: forward-only
    _gradient: ClassVar[autograd.Gradient | None] = None

    # binding group: class-level initial values
    _target_builder: Any = _UNRESOLVED
    _serving_target: str | None = None
    # construction group defaults for ops without kernels of their own
    _installed_kernel_types: Mapping = _EMPTY
    _preferred_over: Mapping = _EMPTY
    _keys_by_interface: Mapping = _EMPTY
    #: the ``reference`` target's builder when the class declares ``reference``
    _reference_builder: ClassVar[Any] = None

    def __init_subclass__(cls, *, specs: SpecSet | None = None, entry: str | None = None,
                          **kw: Any) -> None:
        super().__init_subclass__(**kw)
        name = entry or cls.__name__
        found = (specs or default_specs()).find(name)
        if found is None:
            if entry is not None:
                raise LookupError(f"{cls.__name__}: no spec entry named {entry!r}")
            if "_signature" not in cls.__dict__:
                cls._signature = None
                cls._param_names = ()
            return
        op_entry, spec_file, adts = found
        clash = [p for p in op_entry.signature.params
                 if p.startswith("_") or p in _RESERVED or hasattr(Op, p)]
        if clash:
            raise TypeError(
                f"{cls.__name__}: construction param {clash[0]!r} of its spec entry would hide "
                f"an attribute of Op (params become instance attributes); rename it in the spec")
        cls._param_names = tuple(op_entry.signature.params)
        autograd.register_class(cls, spec_file, name)
        members = ["_signature", "_gradient"]
        inputs = tuple(op_entry.signature.inputs)
        if "__call__" not in cls.__dict__ and inputs and all(n.isidentifier() for n in inputs):
            members.append("__call__")
        generated = declared.deferred_members(cls, op_entry)
        members += generated

        def build(cls: type[Op]) -> dict[str, Any]:
            # the signature plan first: the generated members read it
            # an op runs kernels on torch tensors: nothing else passes its check
            plan = SignaturePlan(name, op_entry, spec=spec_file, adts=adts, validate=False,
                                 adapter=torch_adapter(strict=True))
            type.__setattr__(cls, "_signature", plan)
            out: dict[str, Any] = {"_signature": plan}
            if "__call__" in members:
                out["__call__"] = class_function(plan)
            out.update(declared.build_members(cls, op_entry, generated))
            block = getattr(op_entry, "backward", None)
            out["_gradient"] = None if block is None else autograd.Gradient(cls, block)
            return out

        # built on the class's first use (lazy.py): the import defines every op class
        lazy.defer(cls, tuple(members), build)
        cls._reference_builder = (declared.reference_builder if cls.reference is not Op.reference
                                  else None)
        cls.compile_op_names = ()
        comp = op_entry.composition
        cls._declared_stages = None if comp is None else tuple(st.name for st in comp.stages)

    # --- construction --------------------------------------------------------------------------

    def __init__(self, *, target: str | None = None,
                 kernel_map: Mapping[Any, Any] | None = None, tune: bool = False,
                 **params: Any) -> None:
        cls = type(self)
        if _is_dynamo_compiling():
            raise RuntimeError(
                f"{cls.__name__}: an op cannot be constructed inside torch.compile (its "
                f"construction generates and compiles its checks, which tracing cannot "
                f"follow); construct it once before the compiled function and call it inside")
        plan = cls._signature
        if plan is None:
            raise TypeError(f"{cls.__name__} has no spec entry; an op class is named after its "
                            f"entry (or passes entry=...) and its specs are registered first")
        if not isinstance(tune, bool):
            raise TypeError(f"{cls.__name__}: tune must be True or False, got {tune!r} "
                            f"({type(tune).__name__})")
        # construction group
        params = cls.normalize_params(
            {k: v for k, v in params.items() if v is not declared.REQUIRED})
        self._point = plan.construct(**params)
        #: what the instance was constructed with (pickling rebuilds it from these)
        self._init_args = (params, target, kernel_map, tune)
        for n, v in self._point.params.items():
            setattr(self, n, _kept(params.get(n, v), v))
        self._construction_indices = dict(self._point.params)
        self._result = _result_getter(plan.output_names, self._point.returned_outputs)
        self._n_inputs = len(plan.input_names)
        #: inputs up to the last required one (the check takes them positionally)
        self._n_required = max((i + 1 for i, n in enumerate(plan.input_names)
                                if n not in plan.optional_inputs), default=0)
        self._composite = bool(cls.delegate_types)
        #: a call with grad needed is one autograd node: every op with a gradient, and every
        #: op that is not composite (the rest refuse, naming the inputs); a composite op
        #: without one leaves each delegate call to record its own node
        self._records_node = cls._gradient is not None or not self._composite
        if target is not None and target != targets.IN_TREE and target not in targets.targets():
            raise TargetError(f"{cls.__name__}: unknown target {target!r}; known: "
                              f"{', '.join([targets.IN_TREE, *targets.targets()])}")
        self.target = target
        if cls.kernel_types:
            installed = self._install_kernel_map(kernel_map)
            self._installed_kernel_types = installed
            self._preferred_over = {k: k.preferred_over for ks in installed.values() for k in ks}
            self._keys_by_interface = {i: (i.slot or i.__name__) for i in installed}
        elif kernel_map:
            raise ValueError(f"{cls.__name__} runs no kernels of its own; kernel_map does not "
                             f"apply")
        self._instance_key = register_instance(self)
        #: a backward op a forward built for its gradient (Trained._backward_op): its inputs
        #: are that forward's saved tensors and upstream gradients (Trained.checks_indices)
        self._fed_by_forward = False
        self._boundary = None
        if plan.input_names:
            # a composite op too: traced, its call is one custom op whose real call composes
            # (eagerly, inside the op), so a compiled training step keeps one node and the
            # entry's gradient, not the delegates' intermediates
            from .boundary import boundary_for

            self._boundary = boundary_for(self)
        # binding group
        self._entries_by_call: dict = {}
        self._built_entries: dict = {}
        self._target_kernels: dict = {}
        # run group
        self._tune_requested = False
        self._delegates: dict[tuple, Op] = {}
        #: the backward op per combination of the gradient's ``needs`` (autograd.py)
        self._backward_ops: dict[tuple, Op] = {}
        self._delegate_stages = threading.local()
        self._effect_branches: dict[tuple, tuple] = {}
        self._last_call: SignatureCall | None = None
        #: construction tensor -> the last value of it that holds data (see
        #: _sync_construction_tensors)
        self._real_construction: dict[str, torch.Tensor] = {}
        self._tune_warned = False
        # the fused call of cached calls (fastpath.py): built after a call succeeds, dropped
        # by _reset_binding (it is specialised to the binding)
        self._fast: Any = None
        self._fast_source: str | None = None
        self._parent: Op | None = None
        self._lock = threading.RLock()
        self.derive()
        if tune:
            self.request_tune()

    def derive(self) -> None:
        """Compute what the op derives from its params, once, at the end of ``Op.__init__``
        (the params are attributes by then). An op or family base writes this, not
        ``__init__``, to derive something; the default derives nothing."""

    @classmethod
    def normalize_params(cls, params: dict[str, Any]) -> dict[str, Any]:
        """The construction params as the construction check is to see them. A family base
        overrides this for a spelling its ops accept beyond the spec's type (an ``int``
        ``normalized_shape`` for a one-element tuple, as torch takes it); the default keeps
        them as given."""
        return params

    def _install_kernel_map(self, kernel_map: Mapping[Any, Any] | None) -> dict:
        cls = type(self)
        installed = {i: tuple(ks) for i, ks in cls.kernel_types.items()}
        by_slot = {(i.slot or i.__name__): i for i in installed}
        if kernel_map is not None and not isinstance(kernel_map, Mapping):
            raise TypeError(f"{cls.__name__}: kernel_map must be a mapping of slots (or kernel "
                            f"interfaces) to Kernel classes, or None; got "
                            f"{type(kernel_map).__name__}")
        for key, impl in (kernel_map or {}).items():
            iface = key if isinstance(key, type) else by_slot.get(key)
            if iface not in installed:
                raise ValueError(f"{cls.__name__}: kernel_map key {key!r} is not a slot of this "
                                 f"op; slots: {', '.join(by_slot)}")
            impls = tuple(impl) if isinstance(impl, list | tuple) else (impl,)
            for k in impls:
                if not (isinstance(k, type) and issubclass(k, Kernel) and issubclass(k, iface)):
                    raise TypeError(f"{cls.__name__}: kernel_map[{key!r}] must be a Kernel "
                                    f"class implementing {iface.__name__}, got {k!r}")
            installed[iface] = impls
        return installed

    # --- public surface -------------------------------------------------------------------------

    @property
    def last_call(self) -> SignatureCall | None:
        """The record of the last call that succeeded."""
        return self._last_call

    @property
    def serving_target(self) -> str | None:
        """The target bound to this instance (``"tileops"`` for in-tree kernels), or None."""
        return self._serving_target

    @property
    def built_entries(self) -> dict:
        with self._lock:
            return {i: dict(v) for i, v in self._built_entries.items()}

    def eval_roofline(self, *inputs: Any) -> tuple[int, int]:
        """``(flops, bytes)`` of the last successful call: the spec's roofline formulas. Given
        that call's inputs, an op whose work depends on the values of an input (the offsets of
        packed sequences) counts it from them (:meth:`roofline_of_inputs`)."""
        if self._last_call is None:
            raise RuntimeError(f"{type(self).__name__}.eval_roofline needs a call first")
        if inputs:
            counted = self.roofline_of_inputs(self._last_call, inputs)
            if counted is not None:
                return counted
        return self._last_call.roofline()

    def roofline_of_inputs(self, call: SignatureCall,
                           inputs: tuple[Any, ...]) -> tuple[int, int] | None:
        """Hook: ``(flops, bytes)`` of ``call`` counted from its inputs' values where the
        spec's formulas, which see only shapes and params, can give a bound only; None (the
        default) keeps the formulas. Called by benchmarks, never on a call's path (it may read
        a device tensor on the host)."""
        return None

    def forward(self, call: SignatureCall, *tensors: Any) -> Any:
        """Run the in-tree kernels: ``tensors`` are the inputs then the outputs to write.
        Ops that run kernels of their own override this."""
        raise NotImplementedError(f"{type(self).__name__} has no in-tree forward")

    def __call__(self, *inputs: Any, **kwargs: Any) -> Any:
        # An op class with an entry gets a generated __call__ instead (fastpath.class_call):
        # a plain call goes straight to the instance's fused call, anything else here.
        return self._result(self._general_call(inputs, kwargs))

    @property
    def returned_outputs(self) -> tuple[str, ...]:
        """The outputs a call's result holds, in order: every declared output but those whose
        ``returned`` is false at this construction (attention's log-sum-exp unless
        ``return_lse``). One name: the result is that tensor; several: a tuple."""
        return self._point.returned_outputs

    def _general_call(self, inputs: tuple, kwargs: dict) -> Any:
        if _is_dynamo_compiling():  # tracing: emit the custom op, build nothing
            return self._traced_call(inputs, kwargs)
        return self._run_call(inputs, kwargs)

    def _traced_call(self, inputs: tuple, kwargs: dict) -> Any:
        if self._boundary is None:
            raise RuntimeError(f"{type(self).__name__} has no compile boundary (an op without "
                               f"tensor inputs); call it outside torch.compile")
        if kwargs:
            inputs, outs = self._split_kwargs(inputs, kwargs)
            if outs:
                raise NotImplementedError(
                    f"{type(self).__name__}: out= buffers are not supported under "
                    f"torch.compile; let the op allocate its outputs")
        if _grad_enabled() and any(t is not None and t.requires_grad for t in inputs):
            # the custom op carries the gradient (autograd.register) where there is one; what
            # torch.library cannot differentiate is refused here, by name
            if self._gradient is None and not self._outputs_take_no_grad():
                self._forward_only(inputs)
            if self._boundary.written:
                raise RuntimeError(
                    f"{repr(self)} writes {', '.join(self._boundary.written)} in place, and "
                    f"torch.compile cannot differentiate a custom op that writes its inputs; "
                    f"construct the op without its in-place effect for a compiled training "
                    f"step (eager calls differentiate it)")
        return self._boundary.call(self, inputs)

    # --- the call ---------------------------------------------------------------------------------

    def _run_call(self, inputs: tuple, kwargs: dict) -> Any:
        """The seven steps.

        1. check the call against the signature (generated code; raises, changes nothing);
        2. decide the effect branch and allocate the outputs not supplied;
        3. bring construction-time tensors to the call's device and dtype;
        4. bind a target if none is bound;
        5. get the kernel entry (one lookup when cached; built once on a miss);
        6. run it (a composite op's sub-calls are recorded into its stages);
        7. on success the record becomes ``last_call``; on failure nothing is kept, and if this
           call bound the target, the binding is reset so the next call chooses again.
        """
        if autograd.functorch_active():
            raise self._functorch_error()
        if kwargs:
            inputs, outs = self._split_kwargs(inputs, kwargs)
        else:
            outs = None
        if not self._n_required <= len(inputs) <= self._n_inputs:
            raise self._arity_error(inputs)
        call = self._point.check(*inputs, **outs) if outs else self._point.check(*inputs)
        if len(inputs) < self._n_inputs:  # absent optional inputs are passed on as None
            inputs = inputs + (None,) * (self._n_inputs - len(inputs))
        if call.branch[0]:  # the inputs this call writes
            self._refuse_shared_elements(call.branch[0], inputs)
        if _grad_enabled() and self._records_node:
            for t in inputs:
                if t is not None and t.requires_grad:
                    return self._graph_call(call, inputs, outs)
        result = self._execute(call, inputs, outs)
        return result[0] if len(result) == 1 else result

    def _execute(self, call: SignatureCall, inputs: tuple, outs: dict | None) -> tuple:
        """Steps 2-7 of a checked call: every output, in the entry's order."""
        parent = self._parent
        if parent is not None:
            sink = parent._stage_sink(self)
        bound_now = False
        if self._target_builder is _UNRESOLVED:
            bound_now = self._bind_target(call)
        try:
            allocate = self._effect_branches.get(call.branch)
            if allocate is None:
                allocate = self._branch_allocator(call.branch)
            if allocate.__class__ is int:  # one output, like the input at that index
                src = inputs[allocate]
                outputs = (_empty_like(src) if src.is_contiguous() else
                           self._like_output(call, inputs),)
            else:
                outputs = allocate(call, inputs, outs)
            if self.construction_tensors:
                self._sync_construction_tensors(call)
            builder = self._target_builder
            if builder is None:
                if self._composite:
                    result = self._forward_in_stages(call, inputs, outputs)
                else:
                    result = self.forward(call, *inputs, *outputs)
            else:
                key = (call.device, call.input_dtypes, call.input_shapes)
                kernel = self._target_kernels.get(key)
                if kernel is None:
                    kernel = self._build_target_kernel(key, call, builder)
                result = kernel(*inputs, *outputs)
            if self.allocate_outputs:
                result = outputs
            elif not isinstance(result, tuple):
                result = (result,)
        except BaseException:
            if bound_now:
                self._reset_binding()
            raise
        self._last_call = call
        if parent is not None:
            sink.append(call)
        elif self._fast is None and not self._composite:
            self._install_fast_call(call)
        return result

    # --- gradients (autograd.py) -------------------------------------------------------------------

    def _graph_call(self, call: SignatureCall, inputs: tuple, outs: dict | None) -> Any:
        """A checked call with grad mode on and an input requiring grad: the call recorded as
        one autograd node. A composite op's delegates run inside the node's forward, where grad
        mode is off, so they record nothing and save nothing: the node saves what the entry's
        ``backward:`` block names, once for the whole call."""
        gradient = self._gradient
        if gradient is None:
            if not self._outputs_take_no_grad():
                self._forward_only(inputs)
            # integer and bool outputs carry no gradient: as torch.argmax(x) of an x that
            # requires grad, the call runs as without grad (nothing to record)
            with torch.no_grad():
                result = self._execute(call, inputs, outs)
            return result[0] if len(result) == 1 else result
        names = self._signature.input_names  # type: ignore[union-attr]
        wanting = gradient.fixed_inputs and [names[i] for i in gradient.fixed_inputs
                                             if inputs[i] is not None and inputs[i].requires_grad]
        if wanting:
            raise RuntimeError(
                f"{type(self).__name__}: {', '.join(wanting)} require"
                f"{'s' if len(wanting) == 1 else ''} grad, but the op is not differentiable "
                f"with respect to {'it' if len(wanting) == 1 else 'them'} (differentiable: "
                f"{', '.join(names[i] for i in sorted(gradient.differentiable))}); pass "
                f"{'a detached tensor' if len(wanting) == 1 else 'detached tensors'}")
        if outs:
            raise RuntimeError(
                f"{type(self).__name__}: out= arguments ({', '.join(outs)}) do not support "
                f"automatic differentiation, but an input requires grad (torch's rule for "
                f"out=); let the op allocate its outputs, or call it under torch.no_grad()")
        views = []
        for n in call.branch[0]:  # the inputs this call writes
            t = inputs[names.index(n)]
            base = t._base
            if (t.is_leaf and t.requires_grad) or (
                    base is not None and base.is_leaf and base.requires_grad):
                what = "a leaf tensor" if base is None else "a view of a leaf tensor"
                raise RuntimeError(
                    f"{repr(self)} writes its input {n!r} in place, and {n} is {what} "
                    f"that requires grad: torch forbids in-place operations on such tensors "
                    f"(\"a leaf Variable that requires grad is being used in an in-place "
                    f"operation\"); write into a non-leaf (e.g. {n}.clone()) or construct the "
                    f"op without its in-place effect")
            if base is not None:
                views.append(n)
        if views and len(self._signature.output_names) > 1:  # type: ignore[union-attr]
            return self._graph_call_through_copies(call, inputs, views)
        return gradient.apply(self, call, *inputs)

    def _graph_call_through_copies(self, call: SignatureCall, inputs: tuple,
                                   views: list[str]) -> Any:
        """torch refuses an autograd.Function that writes a view in place and returns more than
        one tensor (RoPE's q and k, the fused add-norm's two outputs, on the views a
        projection's ``.view`` gives). The node runs on copies of those views instead, and
        each view takes its result back through torch's ``copy_``, which autograd records:
        the call still writes its inputs and returns them, and the gradient flows through the
        views to their bases."""
        plan = self._signature
        assert plan is not None
        names = plan.input_names
        args = list(inputs)
        for n in views:
            i = names.index(n)
            args[i] = args[i].clone()
        result = self._gradient.apply(self, call, *args)  # type: ignore[union-attr]
        outs = list(result) if isinstance(result, tuple) else [result]
        for k, o in enumerate(plan.output_names):
            alias = plan.sig.outputs[o].alias
            if alias in views:
                view = inputs[names.index(alias)]
                view.copy_(outs[k])
                outs[k] = view
        return tuple(outs) if len(outs) > 1 else outs[0]

    # --- pickling -----------------------------------------------------------------------------------

    def __reduce__(self) -> tuple:
        """An op pickles (and deep-copies) as its construction: the copy is a new instance
        built from the same params, target, kernel map and tuning request, with its own
        (empty) caches and locks; construction-time tensors travel as params."""
        params, target, kernel_map, tune = self._init_args
        return (_rebuild, (type(self), params, target, kernel_map,
                           tune or self._tune_requested))

    def _install_fast_call(self, call: SignatureCall) -> None:
        """Build the fused call for the calls like this one (see ``fastpath.py``)."""
        built = build_fast_call(self, call)
        if built is not None:
            self._fast, self._fast_source = built

    def _outputs_take_no_grad(self) -> bool:
        """Whether every output's declared dtype is an integer or bool one, whatever the call
        (an index, a mask; or a computed dtype every value of which is, ``uint8 if T == uint8
        else bool``): outputs that cannot require grad, so that a forward-only op serves
        inputs that require it, as torch's argmax or eq does."""
        plan = self._signature
        assert plan is not None
        return all(d.dtype.text.strip() in _INTEGRAL_DTYPE_NAMES
                   or _INTEGRAL_DTYPE_NAMES.issuperset(plan.output_dtype_members[n] or ("?",))
                   for n, d in plan.sig.outputs.items())

    def _forward_only(self, inputs: tuple) -> None:
        plan = self._signature
        assert plan is not None
        names = [n for n, t in zip(plan.input_names, inputs, strict=False)
                 if t is not None and t.requires_grad]
        raise RuntimeError(
            f"{type(self).__name__} is forward-only (it has no backward), but "
            f"{', '.join(names)} require{'s' if len(names) == 1 else ''} grad; call it under "
            f"torch.no_grad() or torch.inference_mode(), or pass detached tensors")

    def _refuse_shared_elements(self, written: tuple[str, ...], inputs: tuple) -> None:
        """An input this call writes whose elements share memory (an expanded or overlapping
        view) is refused by name before anything runs, as torch refuses it: which of the
        values written to one element it would hold is ambiguous."""
        plan = self._signature
        assert plan is not None
        if len(written) > 1:
            self._refuse_written_together(written, inputs)
        for n in written:
            t = inputs[plan.input_names.index(n)]
            if t is None or not t.numel() or torch._debug_has_internal_overlap(t) != 1:
                continue
            optional = plan.sig.inputs[n].mutated.text.strip() != "True"
            raise RuntimeError(
                f"{self!r}: {n} is written in place, but its elements share memory (an "
                f"expanded or overlapping view of shape {tuple(t.shape)} and strides "
                f"{t.stride()}), so what an element would hold is ambiguous; pass a tensor "
                f"that owns its elements (.contiguous())"
                + (", or construct the op without its in-place effect" if optional else ""))

    def _refuse_written_together(self, written: tuple[str, ...], inputs: tuple) -> None:
        """Two inputs a call writes that share memory (the same tensor passed twice, or
        overlapping views) are refused by name: each write would overwrite the other's."""
        plan = self._signature
        assert plan is not None
        for i, a in enumerate(written):
            for b in written[i + 1:]:
                if share_memory(inputs[plan.input_names.index(a)],
                                inputs[plan.input_names.index(b)]):
                    raise RuntimeError(
                        f"{self!r}: {a} and {b} are both written in place and share memory "
                        f"(the same tensor, or overlapping views of one), so each write would "
                        f"overwrite the other's; pass tensors that do not share memory")

    def _functorch_error(self) -> RuntimeError:
        """torch.func's transforms (vmap, grad, vjp, jacrev, ...) wrap the tensors: vmap hands
        a sample's view of a batched tensor, which a kernel reading its memory would take for
        the whole batch, and grad takes an autograd.Function only in its setup_context form
        (this node keeps torch's classic one). Refused by name, before anything runs."""
        return RuntimeError(
            f"{type(self).__name__}: torch.func transforms (vmap, grad, vjp, jacrev, ...) do "
            f"not reach this op: its kernels and its gradient take plain tensors; call it "
            f"outside the transform (on the whole batch rather than under vmap, and "
            f"differentiate it with torch.autograd.grad or .backward())")

    def _arity_error(self, inputs: tuple) -> TypeError:
        """A call with too few or too many inputs, named by the op's signature."""
        plan = self._signature
        assert plan is not None
        names = plan.input_names
        optional = set(plan.optional_inputs)
        sig = ", ".join(f"{n}=None" if n in optional else n for n in names)
        lines = "".join(f"\n  {self._point.expected_inputs.get(n, n)}"
                        + ("  (optional)" if n in optional else "") for n in names)
        if len(inputs) > len(names):
            return TypeError(
                f"{type(self).__name__}({sig}) takes {len(names)} inputs, got {len(inputs)}: "
                f"{len(inputs) - len(names)} extra positional argument"
                f"{'s' if len(inputs) - len(names) > 1 else ''} after {names[-1]}; inputs:"
                f"{lines}")
        missing = [n for i, n in enumerate(names)
                   if n not in optional and (i >= len(inputs) or inputs[i] is None)]
        return TypeError(
            f"{type(self).__name__}({sig}): required input{'s' if len(missing) > 1 else ''} "
            f"{', '.join(missing)} not given; inputs:{lines}")

    def _split_kwargs(self, inputs: tuple, kwargs: dict) -> tuple[tuple, dict]:
        plan = self._signature
        assert plan is not None
        names = plan.input_names
        args = list(inputs) + [None] * (len(names) - len(inputs))
        if len(inputs) > len(names):
            raise self._arity_error(inputs)
        outs = {}
        for k, v in kwargs.items():
            if k in names:
                i = names.index(k)
                if i < len(inputs):
                    raise TypeError(f"{type(self).__name__}: input {k!r} given twice")
                args[i] = v
            elif k in plan.buffer_outputs:
                outs[k] = v  # the generated check takes buffer outputs by their names
            else:
                accepted = list(names) + list(plan.buffer_outputs)
                why = ""
                if k in plan.output_names:  # an output the op allocates: no out= buffer
                    why = (f" ({k!r} is an output this op allocates; its spec declares no "
                           f"buffer for it, so it takes none)")
                raise TypeError(f"{type(self).__name__}: unexpected argument {k!r}{why}; "
                                f"accepted: {', '.join(accepted)}")
        while args and args[-1] is None and len(args) > len(inputs):
            args.pop()
        return tuple(args), outs

    def _branch_allocator(self, branch: tuple) -> Any:
        """The output allocator of one effect branch (cached in ``_effect_branches``): the
        recipe below, specialised for the common one-output-like-an-input case, where it is
        that input's index and ``_run_call`` allocates inline (``empty_like`` of a contiguous
        input; saves a call on the hot path)."""
        if not self.allocate_outputs:
            def allocate(call, inputs, outs):
                return ()
        else:
            recipe = self._branch_recipe(branch)
            # (an op with an ``output_layout`` and more than one input: the layout depends on
            # every input, not on the one the output is like alone)
            if len(recipe) == 1 and recipe[0][0] == "like" and (
                    self.output_layout is None or len(self._signature.input_names) == 1):
                allocate = recipe[0][2]
            else:
                # the last call's derivation: a function of the record and of torch's default
                # floating dtype alone
                memo = [None]

                def allocate(call, inputs, outs):
                    return self._make_outputs(recipe, call, inputs, outs, memo)
        self._effect_branches[branch] = allocate
        return allocate

    def _branch_recipe(self, branch: tuple) -> tuple:
        """How to produce each output in this effect branch: ``("new", i)``,
        ``("alias", input index)``, ``("none",)`` or ``("given", name)``."""
        plan = self._signature
        assert plan is not None
        written, out_given, returned = branch
        recipe = []
        for i, (n, d) in enumerate(plan.sig.outputs.items()):
            if n not in returned:
                recipe.append(("none",))
            elif d.alias is not None and d.alias in written:
                recipe.append(("alias", plan.input_names.index(d.alias)))
            elif d.buffer:
                recipe.append(("given_or_new", i, n))
            elif n in self._point.output_like:
                recipe.append(("like", i, plan.input_names.index(self._point.output_like[n])))
            else:
                recipe.append(("new", i))
        return tuple(recipe)

    def _like_output(self, call: SignatureCall, inputs: tuple) -> Any:
        """The one output like an input that is not contiguous: contiguous, or where the op
        states an ``output_layout``, in that layout."""
        if self.output_layout is None:
            return empty_from_record(call)
        _, shapes, dtypes = call.derived()
        return self._laid_out(inputs, shapes[0], dtypes[0], call.device)

    def _laid_out(self, inputs: tuple, shape: Any, dtype: Any, device: Any,
                  twin: Any = None) -> Any:
        strides = self.output_layout(inputs, shape)
        if strides is None:  # contiguous: like a contiguous ``twin`` (an input of this shape
            # and dtype), whatever the layout of the others
            return (_empty_like(twin) if twin is not None and twin.is_contiguous() else
                    torch.empty(shape, dtype=dtype, device=device))
        return torch.empty_strided(shape, strides, dtype=dtype, device=device)

    def _make_outputs(self, recipe: tuple, call: SignatureCall, inputs: tuple,
                      outs: dict | None, memo: list | None = None) -> tuple:
        m = None if memo is None else memo[0]
        default = _default_dtype()  # an integer's float math follows it: read at each call
        if m is not None and m[0] == call and m[1] is default:  # the same derivation
            shapes, dtypes, twins = m[2], m[3], m[4]
        else:
            _, shapes, dtypes = call.derived()  # one derivation for every output
            twins = _twins(call, shapes, dtypes, self._signature.sig.inputs.values())
            if memo is not None:
                memo[0] = (call, default, shapes, dtypes, twins)
        device = call.device
        result = []
        for r in recipe:
            tag = r[0]
            if tag in ("like", "new") and self.output_layout is not None:
                twin = twins[r[1]]
                result.append(self._laid_out(inputs, shapes[r[1]], dtypes[r[1]], device,
                                             None if twin is None else inputs[twin]))
            elif tag == "like":  # same shape and dtype as a (contiguous) input: the cheap path
                src = inputs[r[2]]
                result.append(_empty_like(src) if src.is_contiguous() else
                              torch.empty(shapes[r[1]], dtype=dtypes[r[1]], device=device))
            elif tag == "new":
                fmt = self.output_memory_format
                twin = twins[r[1]]
                if fmt is None and twin is not None and inputs[twin].is_contiguous():
                    result.append(_empty_like(inputs[twin]))  # half torch.empty's host time
                else:
                    result.append(torch.empty(shapes[r[1]], dtype=dtypes[r[1]], device=device)
                                  if fmt is None else
                                  torch.empty(shapes[r[1]], dtype=dtypes[r[1]], device=device,
                                              memory_format=fmt(inputs)))
            elif tag == "alias":
                result.append(inputs[r[1]])
            elif tag == "none":
                result.append(None)
            else:
                given = outs.get(r[2]) if outs else None
                result.append(given if given is not None else
                              torch.empty(shapes[r[1]], dtype=dtypes[r[1]], device=device))
        return tuple(result)

    def _sync_construction_tensors(self, call: SignatureCall) -> None:
        """Bring the construction tensors to the call's device and dtype, written back for the
        next calls. A fake or meta tensor (written by a traced, exported or shape-inference
        call) holds no values: a later call starts from the last one that did."""
        indices = None
        for name, follows in self.construction_tensors.items():
            t = getattr(self, name)
            if t is None:
                continue
            dtype = None
            if follows is not None:
                if indices is None:
                    indices = dict(zip(call.point.index_names, call.values, strict=True))
                dtype = indices.get(follows)
            if t.device == call.device and (dtype is None or t.dtype == dtype):
                continue  # serves this call as it is
            if not has_data(t):
                t = self._real_construction.get(name, t)
            else:
                self._real_construction[name] = t
            setattr(self, name, t.to(device=call.device, dtype=dtype or t.dtype))

    # --- targets (step 4) ------------------------------------------------------------------------

    def _bind_target(self, call: SignatureCall) -> bool:
        """Choose and bind the serving target. Returns True if this call bound it."""
        _not_capturing(self, call.device, "choose a target")
        with self._lock:
            if self._target_builder is not _UNRESOLVED:
                return False
            cls = type(self)
            name = self.target or targets.default_target()
            how = "explicit" if self.target else "process default" if name else "by device"
            if name is None:
                name = self._target_by_device(call.device)
            if name == targets.IN_TREE:
                if not self._installed_kernel_types and not self.delegate_types:
                    raise TargetError(f"{cls.__name__} has no in-tree kernels; choose a target "
                                      f"({', '.join(targets.targets())})")
                builder = None
            else:
                if name not in targets.targets():
                    raise TargetError(f"{cls.__name__}: unknown target {name!r}; known: "
                                      f"{', '.join([targets.IN_TREE, *targets.targets()])}")
                builder = targets.builder_for(name, cls)
                if builder is None and not self.delegate_types:
                    raise TargetError(f"target {name!r} has no builder for {cls.__name__}")
                # a composite op the target has no builder for runs its own forward; its
                # delegates are constructed with the same target (delegate_for)
            self._target_builder = builder
            self._serving_target = name
            if log.INFO:
                log.info("%s bound to target %s (%s, device %s)", cls.__name__, name, how,
                         call.device)
            return True

    def _target_by_device(self, device: Any) -> str:
        if device is None:  # no tensor inputs: the op runs where torch allocates by default
            device = torch.get_default_device()
        dtype = getattr(device, "type", None)
        for impls in self._installed_kernel_types.values():
            if any(dtype in k.devices for k in impls):
                return targets.IN_TREE
        if self.delegate_types and not self._installed_kernel_types and any(
                dtype in k.devices for d in self.delegate_types.values()
                for ks in d.kernel_types.values() for k in ks):
            # a composite op composes where its delegates' kernels run (each delegate chooses
            # its own); elsewhere a target serves it whole (the reference target runs the
            # op's own reference, not each stage's)
            return targets.IN_TREE
        cls = type(self)
        for name in targets.targets():
            devices = targets.target_devices(name)
            if (devices is None or dtype in devices) and targets.builder_for(name, cls):
                return name
        raise TargetError(f"{cls.__name__}: nothing serves device {device}: no in-tree kernel "
                          f"runs on {dtype} and no target has a builder for it")

    def _build_target_kernel(self, key: tuple, call: SignatureCall, builder: Any) -> Any:
        with self._lock:
            kernel = self._target_kernels.get(key)
            if kernel is not None:
                return kernel
            name = self._serving_target
            devices = targets.target_devices(name) if name in targets.targets() else None
            dtype = getattr(call.device, "type", None)
            if devices is not None and dtype not in devices:
                raise TargetError(f"{type(self).__name__}: target {name!r} runs on "
                                  f"{' or '.join(devices)}, not {dtype}")
            _not_capturing(self, call.device, "build a kernel")
            if log.INFO:
                log.info("%s: building a %s kernel for %s", type(self).__name__, name,
                         call.compact())
            # the builder this call was bound to: another thread's failing first call may have
            # reset the binding meanwhile; then the kernel serves this call and is not cached
            kernel = builder(self, call)
            if not callable(kernel):  # refused now, not as "'NoneType' is not callable" later
                raise TargetError(
                    f"{type(self).__name__}: the {name!r} target's builder "
                    f"{getattr(builder, '__qualname__', builder)!r} returned {kernel!r}, not a "
                    f"kernel (a callable taking the inputs, then the outputs to write)")
            if self._tune_requested:
                self._tune_target_kernel(kernel)
            if self._target_builder is builder:
                self._target_kernels[key] = kernel
            return kernel

    # --- in-tree kernel entries (step 5) ----------------------------------------------------------

    def kernel(self, interface: type[KernelInterface], spec: Any) -> Any:
        """The entry of ``interface`` for ``spec``: one lookup when cached; on a miss the
        slot's implementation is selected and its entry built once per (class, identity)."""
        entry = self._entries_by_call.get((interface, spec))
        if entry is None:
            entry = self._build_entry(interface, spec)
        return entry

    def kernel_for(self, key: Any, interface: type[KernelInterface], spec_of: Any) -> Any:
        """The entry of ``interface`` for the call spec ``spec_of()`` makes, memoised under
        ``key`` (a tuple of the facts the spec is made of): a family base's cached call is one
        lookup, and builds its typed spec only on a miss."""
        entry = self._entries_by_call.get(key)
        if entry is None:
            entry = self.kernel(interface, spec_of())
            with self._lock:
                self._entries_by_call[key] = entry
        return entry

    def index_reader(self, *names: str) -> Any:
        """``read(call) -> tuple``: the values of the index ``names`` the signature solved for
        a record of this instance's construction point (a Shape index as a tuple), in that
        order. A family base makes its readers once, in ``derive``."""
        point = self._point
        order = point.index_names
        missing = [n for n in names if n not in order]
        if missing:
            raise LookupError(f"{type(self).__name__}: {', '.join(missing)} is not an index of "
                              f"its signature; indices: {', '.join(order)}")
        derive, lazy = point.derive, point.lazy
        if not any(n in lazy for n in names):
            pick = itemgetter(*(order.index(n) for n in names))
            if len(names) == 1:
                return lambda call: (pick(derive(call)[0]),)
            return lambda call: pick(derive(call)[0])
        picks = tuple((order.index(n), lazy.get(n)) for n in names)

        def read(call: SignatureCall) -> tuple:
            values = derive(call)[0]
            out = []
            for i, sl in picks:
                v = values[i]
                if sl is not None:  # a Shape index stored as the shape it was sliced from
                    v = tuple(v[sl[1]:len(v) - sl[2]])
                out.append(v)
            return tuple(out)

        return read

    def _build_entry(self, interface: type[KernelInterface], spec: Any) -> Any:
        with self._lock:
            entry = self._entries_by_call.get((interface, spec))
            if entry is not None:
                return entry
            impls = self._installed_kernel_types.get(interface)
            if impls is None:
                raise LookupError(f"{type(self).__name__} declares no slot "
                                  f"{interface.__name__}")
            try:
                impl = select(interface, impls, spec)
            except NoKernelError as exc:  # named by the op, with what serves the call instead
                raise NoKernelError(f"{type(self).__name__}: {exc}{self._reference_hint()}") \
                    from None
            ident = (impl, impl.identity(spec))
            built = self._built_entries.setdefault(interface, {})
            entry = built.get(ident)
            if entry is None:
                # (a new spec whose entry exists, e.g. another row count the kernel serves with
                # the same program, is only a lookup and may happen under capture)
                _not_capturing(self, getattr(spec, "device", None), "build a kernel")
                if log.INFO:
                    log.info("%s: building %s for %r", type(self).__name__, impl.__name__, spec)
                entry = impl.entry_for(spec, self)
                if self._tune_requested and hasattr(entry, "request_tune"):
                    entry.request_tune()
                built[ident] = entry
            self._entries_by_call[(interface, spec)] = entry
            return entry

    def _reference_hint(self) -> str:
        """How to run a call no in-tree kernel serves, where the op has a reference."""
        if targets.builder_for(targets.REFERENCE, type(self)) is None:
            return ""
        return (f"\n{type(self).__name__} runs it on the reference target: construct the op "
                f"with target='reference'")

    def iter_kernels(self) -> Iterator[Any]:
        """Every built entry and target kernel of this op and its delegates."""
        with self._lock:  # a snapshot: other threads may be building
            mine = [e for built in self._built_entries.values() for e in built.values()]
            mine += self._target_kernels.values()
            delegates = list(self._delegates.values())
        yield from mine
        for d in delegates:
            yield from d.iter_kernels()

    # --- failure and reset (step 7) ------------------------------------------------------------

    def _reset_binding(self) -> None:
        """Reset the binding group to its initial values, recursively through delegates."""
        with self._lock:
            self._fast = None
            self._target_builder = _UNRESOLVED
            self._serving_target = None
            self._entries_by_call = {}
            self._built_entries = {}
            self._target_kernels = {}
        for d in self._delegates.values():
            d._reset_binding()

    # --- tuning -----------------------------------------------------------------------------------

    def request_tune(self) -> None:
        """Tune: entries already built get the request now (in-tree entries; target kernels
        once on each device they live on); entries built later start in tuning mode."""
        # under the lock that builds take: an entry being built either sees the flag or is
        # already in the tables (never both, never neither), and no table changes mid-loop
        with self._lock:
            self._tune_requested = True
            for built in self._built_entries.values():
                for entry in built.values():
                    if hasattr(entry, "request_tune"):
                        entry.request_tune()
            seen: set[tuple[int, Any]] = set()
            for key, kernel in self._target_kernels.items():
                device = key[0]
                if (id(kernel), device) in seen:
                    continue
                seen.add((id(kernel), device))
                self._tune_target_kernel(kernel)
            # the backward ops built so far too (those built later take the flag)
            delegates = [*self._delegates.values(), *self._backward_ops.values()]
        for d in delegates:
            d.request_tune()

    def _tune_target_kernel(self, kernel: Any) -> None:
        if hasattr(kernel, "request_tune"):
            kernel.request_tune()
        elif not self._tune_warned:
            self._tune_warned = True
            warnings.warn(f"{type(self).__name__}: the {self._serving_target} target's kernel "
                          f"cannot tune; tuning is ignored for it", RuntimeWarning, stacklevel=3)


_grad_enabled = torch._C.is_grad_enabled
#: names Op.__init__ takes or sets that are not class attributes
_RESERVED = frozenset({"target", "kernel_map", "tune"})
_empty_like = torch.empty_like
_default_dtype = torch.get_default_dtype


def _twins(call: SignatureCall, shapes: tuple, dtypes: tuple, decls: Any) -> tuple:
    """Per output, the index of the call's first present input on the call's device (one not
    declared ``device: any``, which may be a CPU scalar beside CUDA tensors) where that input
    has the output's shape and dtype, else None: a contiguous output of that shape is
    allocated like the input, which costs the host half what ``torch.empty`` of the shape
    does."""
    in_shapes = call.input_shapes
    first = next((i for i, (s, d) in enumerate(zip(in_shapes, decls, strict=True))
                  if s is not None and d.device != "any"), None)
    if first is None:
        return (None,) * len(shapes)
    s0, d0 = tuple(in_shapes[first]), call.input_dtypes[first]
    return tuple(first if s is not None and tuple(s) == s0 and d == d0 else None
                 for s, d in zip(shapes, dtypes, strict=True))


def _not_capturing(op: Op, device: Any, what: str) -> None:
    """Refuse to build while a CUDA graph is being captured: building launches work and
    allocates, which would corrupt the capture."""
    if getattr(device, "type", None) == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            f"{type(op).__name__} would {what} during CUDA graph capture, which would corrupt "
            f"the capture; call the op once with the same shapes, dtypes and device before "
            f"capturing (a warm-up call builds everything the capture replays)")


def _rebuild(cls: type[Op], params: dict, target: str | None, kernel_map: Any,
             tune: bool) -> Op:
    return cls(target=target, kernel_map=kernel_map, tune=tune, **params)


def _same(result: Any) -> Any:
    return result


def _result_getter(outputs: tuple[str, ...], returned: tuple[str, ...]) -> Any:
    """What an op's ``__call__`` applies to its full result (a tensor for one output, else a
    tuple in the entry's order): the identity when every output is returned, else the
    returned outputs (a tensor for one). Plain functions, which dynamo traces (it does not
    trace an ``operator.itemgetter``)."""
    if returned == outputs:
        return _same
    picked = tuple(outputs.index(n) for n in returned)
    if len(picked) == 1:
        (i,) = picked

        def one(result: Any) -> Any:
            return result[i]

        return one

    def some(result: Any) -> Any:
        return tuple(result[i] for i in picked)

    return some
