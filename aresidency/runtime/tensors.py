"""Which tensors the runtime can hold and copy whole (dense, strided, with memory of its own).

:meth:`ResidencyManager.register <aresidency.runtime.manager.ResidencyManager.register>`, the
loader's batches and what a source's ``load()`` returns are all checked with
:func:`tensor_problem`, so that such a tensor is refused up front with an error naming it,
rather than failing inside torch at its first copy.
"""

from __future__ import annotations

import torch

__all__ = ["tensor_problem"]


def tensor_problem(tensor: torch.Tensor) -> tuple[type[Exception], str, str] | None:
    """Why aresidency cannot hold and copy ``tensor`` whole, or None if it can (dense,
    strided, with data, nothing pending): the error's type, what the tensor is, and what to
    use instead. :meth:`ResidencyManager.register` and the loader refuse such tensors with
    it, rather than fail at their first copy."""
    if tensor.is_nested:
        return (
            TypeError,
            "a nested tensor",
            "it cannot be copied whole; use its to_padded_tensor() or its components",
        )
    if tensor.layout is not torch.strided:
        return (
            TypeError,
            f"a tensor of layout {tensor.layout}",
            "only dense (strided) tensors are copied; use .to_dense(), or its index and value "
            "tensors",
        )
    if tensor.is_quantized:
        return (
            TypeError,
            f"a quantized {tensor.dtype} tensor",
            "use its int_repr() and keep the scale and zero point beside it",
        )
    if tensor.is_meta:
        return ValueError, "a tensor on the meta device", "it has no data to copy"
    if type(tensor) is not torch.Tensor and not _has_memory(tensor):
        # A wrapper subclass (``torch.Tensor._make_wrapper_subclass``: DTensor, quantized
        # weight subclasses) computes through ``__torch_dispatch__`` and has no storage of its
        # own; torch's own error at the first copy names no value ("invalid python storage").
        return (
            TypeError,
            f"a {type(tensor).__name__}, a tensor subclass with no memory of its own (a "
            "wrapper that computes through __torch_dispatch__, as DTensor or a quantized "
            "weight subclass does)",
            "hand out the plain tensors it wraps (a DTensor's full_tensor() or "
            "to_local(), a quantized tensor's dequantize())",
        )
    # A lazily conjugated or negated view (``x.conj()`` of a complex tensor, what some ops
    # return) cannot be copied into a new buffer as it is (torch refuses the copy), so it
    # could never move: refused up front rather than at its first transfer.
    if tensor.is_conj():
        return (
            TypeError,
            "a lazy conj() view (a pending conjugation)",
            "use tensor.resolve_conj() (or tensor.conj_physical())",
        )
    if tensor.is_neg():
        return (
            TypeError,
            "a lazy negative view (the imaginary part of a conj() view)",
            "use tensor.resolve_neg()",
        )
    return None


def _has_memory(tensor: torch.Tensor) -> bool:
    """Whether a tensor subclass has memory of its own to copy (a wrapper subclass made with
    ``_make_wrapper_subclass`` has none: torch refuses its data pointer)."""
    try:
        tensor.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return False
    return True
