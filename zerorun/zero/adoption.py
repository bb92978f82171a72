"""Which autograd gradients the reducer (``reducer.py``) may take as a bucket's full gradient without a copy.

Note [Adopted gradient]: at stages 2-3 a bucket that is exactly one parameter (no other parameter, no padding)
takes autograd's gradient of it as its full gradient, without a pool buffer or a copy, when that tensor is
the parameter's alone: strided, contiguous, in the reduce dtype, not a view, spanning its whole storage, and
the only tensor on that storage (``torch_internals.sole_owner``). AccumulateGrad hands over as ``p.grad`` the
very tensor autograd computed whenever no other Python reference holds it, even when it shares its storage
with tensors autograd still needs: the gradients of parameters used through ``torch.cat`` are slices of one
tensor, two parameters whose views were added share one gradient, and a broadcast add hands a view of the
incoming gradient that the other operand's backward still reads. Those are copied, as are the gradients of
padded buckets and buckets of several parameters; once the hook sets ``p.grad`` to ``None`` the reducer is
the only user of an adopted one and the reduce-scatter may write into it. A parameter larger than a bucket is a
bucket of its own (``flat.pack``), so this is the case of the largest ones (a GPT's embedding and LM head),
whose gradient existed twice at their backward (autograd's and the pooled copy). A second accumulation in
the same backward (reentrant checkpointing) is added into it. It is dropped, not pooled, after its reduction.
"""

from __future__ import annotations

import torch

from zerorun.zero.flat import FlatBuffer
from zerorun.zero.torch_internals import sole_owner


def adoptable(buf: FlatBuffer, grad: torch.Tensor, reduce_dtype: torch.dtype) -> bool:
    """Note [Adopted gradient]: whether ``grad``, autograd's gradient of a parameter of ``buf``, can be the
    bucket's full gradient itself (``buf`` is that one parameter, unpadded; ``grad`` is the parameter's alone,
    in ``reduce_dtype``)."""
    return (len(buf.params) == 1 and buf.unpadded_numel == buf.numel
            and grad.layout == torch.strided and grad.dtype == reduce_dtype and grad.device == buf.device
            and grad.is_contiguous() and not grad._is_view() and grad.storage_offset() == 0
            and grad.untyped_storage().nbytes() == grad.nbytes and sole_owner(grad))
