"""Dense GEMM: ``c = op(a) @ op(b)`` with ``op`` a transpose when ``trans_a`` / ``trans_b``.

The op is its spec entry (``specs/gemm.yaml``; the type family ``Mat`` gives ``a`` the shape
``[M, K]`` or ``[K, M]``) plus a constructor and a ``forward`` that runs the ``gemm_fwd``
slot. The kernels read row-major contiguous operands in the declared layout, so a
non-contiguous input is copied to that layout first; the call spec records whether every
operand meets the 16-byte alignment TMA needs (large calls that do not are padded into
aligned buffers, small ones run on the general kernel).
"""


from tileops.kernels.gemm import (
    GemmFwdInterface,
    GemmGemvKernel,
    GemmGeneralKernel,
    GemmHopperKernel,
    GemmPaddedKernel,
    GemmSmallMKernel,
    GemmSpec,
    m_bucket,
)
from tileops.runtime import Op

from ._dtypes import NAMES

__all__ = ["GemmFwdOp"]


#: elements per 16 bytes, by dtype: TMA needs every row a multiple of 16 bytes
_PER_16B = {dt: 16 // dt.itemsize for dt in NAMES}


class GemmFwdOp(Op):
    """``c = op(a) @ op(b)``: ``a`` is ``(M, K)`` (``(K, M)`` when ``trans_a``), ``b`` is
    ``(K, N)`` (``(N, K)`` when ``trans_b``), ``c`` is ``(M, N)``; fp32 accumulation.

    Args:
        trans_a, trans_b: whether ``a`` / ``b`` are stored transposed.
        target, kernel_map, tune: see :class:`tileops.runtime.Op`.
    """

    kernel_types = {GemmFwdInterface: (GemmHopperKernel, GemmSmallMKernel, GemmGemvKernel,
                                       GemmPaddedKernel, GemmGeneralKernel)}

    def __init__(self, *, trans_a: bool = False, trans_b: bool = False,
                 target: str | None = None, kernel_map=None, tune: bool = False) -> None:
        super().__init__(trans_a=trans_a, trans_b=trans_b, target=target,
                         kernel_map=kernel_map, tune=tune)

    def forward(self, call, a, b, c) -> None:
        # Shapes and dtype come from the record (what the signature check read); the tensors
        # are asked only what the record does not hold: layout and base pointer. Kernels
        # assume 16-byte aligned base pointers (TileLang vectorizes copies on that
        # assumption); a view starting mid-vector is copied, as a non-contiguous one is.
        if not a.is_contiguous() or a.data_ptr() % 16:
            a = a.contiguous() if not a.is_contiguous() else a.clone()
        if not b.is_contiguous() or b.data_ptr() % 16:
            b = b.contiguous() if not b.is_contiguous() else b.clone()
        # ``c`` is the op's own allocation (the spec declares no out= buffer): contiguous,
        # 16-byte aligned
        sa, sb = call.s_a, call.s_b
        if self.trans_a:
            k, m = sa
        else:
            m, k = sa
        n = sb[0] if self.trans_b else sb[1]
        dtype = call.d_a
        # stored row lengths: a's last dim, b's (N, or K when transposed) and c's N
        per = _PER_16B[dtype]
        aligned = sa[1] % per == 0 and sb[1] % per == 0 and n % per == 0
        spec = GemmSpec(call.device, m_bucket(m), n, k, NAMES[dtype], self.trans_a,
                        self.trans_b, aligned)
        self.kernel(GemmFwdInterface, spec)(a, b, c)
