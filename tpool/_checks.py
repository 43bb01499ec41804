"""Input checks from tensor metadata only (no host sync), shared by the façade."""

import numbers

import torch

_Tensor, _int32 = torch.Tensor, torch.int32  # module globals: read on every hot-path call
# ``t.stride() == (1,)``: 1-D and contiguous in one metadata call. It misses only 1-D
# tensors of at most one element with another stride; those take the full check.
_UNIT_STRIDE = (1,)


def i32_len(t, device: torch.device) -> int:
    """Length of ``t`` if it is a plain 1-D contiguous int32 tensor on ``device``, else -1.

    The valid case of every hot-path input, in one condition; on -1 the caller runs
    :func:`check_vector`, which raises naming the expected and the actual value (or
    accepts the rare valid tensor this misses, see ``_UNIT_STRIDE``).
    """
    if type(t) is _Tensor and t.dtype is _int32 and t.device == device and t.stride() == _UNIT_STRIDE:
        return t.numel()
    return -1


def check_size(v, name: str) -> int:
    """A buffer length given by the caller: a non-negative integer (numpy integers too), as int."""
    if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 0:
        raise ValueError(f"{name}: expected a non-negative int, got {v!r}")
    return int(v)


def check_vector(t, name: str, dtype: torch.dtype, device: torch.device, max_len: int | None = None) -> int:
    """Check ``t`` is a contiguous 1-D ``dtype`` tensor on ``device``; return its length.

    Raises ``ValueError`` naming the expected and the actual value. The common
    (valid) case is one short condition: it runs on every hot-path call.
    """
    if (
        type(t) is torch.Tensor
        and t.dtype is dtype
        and t.device == device
        and t.dim() == 1
        and t.is_contiguous()
    ):
        n = t.numel()
        if max_len is None or n <= max_len:
            return n
        raise ValueError(f"{name}: expected at most {max_len} entries, got {n}")
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype is not dtype:
        raise ValueError(f"{name}: expected dtype {dtype}, got {t.dtype}")
    if t.device != device:
        raise ValueError(f"{name}: expected device {device}, got {t.device}")
    if t.dim() != 1:
        raise ValueError(f"{name}: expected a 1-D tensor, got shape {tuple(t.shape)}")
    if not t.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous tensor, got stride {t.stride()}; pass .contiguous()")
    n = t.numel()
    if max_len is not None and n > max_len:
        raise ValueError(f"{name}: expected at most {max_len} entries, got {n}")
    return n
