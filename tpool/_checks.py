"""Input checks from tensor metadata only (no host sync), shared by the façade."""

import torch


def device_index(device: torch.device) -> int:
    """What ``Tensor.get_device()`` returns for tensors on ``device`` (-1 on the CPU)."""
    return -1 if device.type == "cpu" else (device.index or 0)


def check_vector(t, name: str, dtype: torch.dtype, device: torch.device, dev_index: int,
                 max_len: int | None = None) -> int:
    """Check ``t`` is a contiguous 1-D ``dtype`` tensor on ``device``; return its length."""
    if (
        type(t) is torch.Tensor
        and t.dtype is dtype
        and t.get_device() == dev_index
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
    if t.device != device and not (t.device.type == device.type and t.get_device() == dev_index):
        raise ValueError(f"{name}: expected device {device}, got {t.device}")
    if t.dim() != 1:
        raise ValueError(f"{name}: expected a 1-D tensor, got shape {tuple(t.shape)}")
    if not t.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous tensor (stride {t.stride()}); pass .contiguous()")
    n = t.numel()
    if max_len is not None and n > max_len:
        raise ValueError(f"{name}: expected at most {max_len} entries, got {n}")
    return n
