"""Call errors: the caller's fault. (A bad spec raises :class:`tileops.spec.SpecError`.)

Every call error has the same fixed structure, pinned by tests::

    GemmFwdOp: argument b does not match the signature
      expected: b: Tensor[T, [K, N]]  (declared Mat[trans_b, K, N])
      seen:     b: bf16[2048, 512]
      because:  K bound to 4096 by a.shape[1], but b.shape[0] is 2048
      call:     a: bf16[128, 4096], b: bf16[2048, 512]
      bound:    M = 128, K = 4096, T = bfloat16
      spec:     gemm.yaml:19 (GemmFwdOp.signature.inputs.b)
"""

from __future__ import annotations

from typing import Any

__all__ = ["ConstructionError", "SignatureCallError", "SignatureIndexError"]


class SignatureCallError(ValueError):
    """A call that does not match the op's signature."""

    def __init__(
        self,
        op: str,
        argument: str,
        expected: str,
        seen: str,
        because: str,
        call: str,
        bound: dict[str, Any],
        spec: str,
        role: str = "argument",
    ) -> None:
        self.op = op
        self.argument = argument
        self.expected = expected
        self.seen = seen
        self.because = because
        self.call = call
        self.bound = dict(bound)
        self.spec = spec
        bound_text = ", ".join(f"{k} = {_fmt(v)}" for k, v in bound.items()) or "(nothing)"
        lines = [
            f"{op}: {role} {argument} does not match the signature",
            f"  expected: {expected}",
            f"  seen:     {seen}",
            f"  because:  {because}",
            f"  call:     {call}",
            f"  bound:    {bound_text}",
            f"  spec:     {spec}",
        ]
        super().__init__("\n".join(lines))


class SignatureIndexError(SignatureCallError, IndexError):
    """A call whose ``dim`` is out of range for its tensor's rank: an ``IndexError`` as well,
    as torch raises for one, so ``except IndexError`` catches it as it catches torch's."""


class ConstructionError(SignatureCallError):
    """Construction params that do not match the signature (checked in ``__init__``)."""

    def __init__(self, op: str, argument: str, expected: str, seen: str, because: str,
                 call: str, bound: dict[str, Any], spec: str) -> None:
        super().__init__(op, argument, expected, seen, because, call, bound, spec,
                         role="construction param")


def _fmt(v: Any) -> str:
    if isinstance(v, tuple):
        return "[" + ", ".join(map(str, v)) + "]"
    return str(v)
