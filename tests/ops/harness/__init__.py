"""The spec-driven harness: every op the shipped specs list as implemented, tested by existing.

Nothing here names an op. The ops are the ``status: implemented`` entries of the shipped specs
(``tileops.ops.SPEC_DIR``) and their classes exported from :mod:`tileops.ops`; the calls are
the entries' workloads (:mod:`tileops.ops.workloads`) and calls derived from the signatures. An
op added tomorrow gets, without a line of test code:

- ``test_numerics``: every workload (scaled down) through the ``reference`` target on CPU,
  against the op's float64 reference, with the effects the spec declares;
- ``test_bad_inputs``: the bad-input corpus derived from the signature (``_corpus``): every
  refusal names the op and the argument and leaves the op usable; views must work;
- ``test_compile``: ``torch.compile(fullgraph=True)`` holds only the op's own node;
- ``test_fake``: output shapes and dtypes under FakeTensorMode, on meta and traced equal the
  spec's inference, on every workload at full size;
- ``test_cuda`` (``cuda``-marked): the in-tree kernels on every full-size workload, and CUDA
  graph capture and replay.

The helpers are in ``_harness`` (ops, cases, tolerances, the float64 reference, the spec's
own inference, the known defects) and ``_corpus`` (the bad calls).
"""
