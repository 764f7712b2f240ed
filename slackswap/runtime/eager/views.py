"""The form a copy is held in and the views read back from it; the RNG state a recompute restores."""

from __future__ import annotations

import torch

from slackswap.runtime.copy_engines import (
    byte_view,
)


def _whole(t: torch.Tensor) -> torch.Tensor:
    """The form in which the runtime holds a copy: `t` itself when it is exactly its storage
    (contiguous from offset 0), else the whole storage flat in `t`'s dtype (one `as_strided`, so the
    views of it are one `as_strided` each too), or as bytes when `t`'s elements do not tile it. Copy
    engines move that form, and `_read` hands it back as is when autograd saved that very view."""
    storage = t.untyped_storage()
    nbytes, size = storage.nbytes(), t.element_size()
    if t.storage_offset() == 0 and t.numel() * size == nbytes and t.is_contiguous():
        return t
    if nbytes % size == 0:
        return t.as_strided((nbytes // size,), (1,), 0)
    return byte_view(storage)


def _read(held: torch.Tensor, dtype: torch.dtype, size: tuple[int, ...], stride: tuple[int, ...],
          offset: int) -> torch.Tensor:
    """The view (dtype, size, stride, offset) of a copy held in its `_whole` form: the copy itself when
    it is that view (no ATen call: the common case), one `as_strided` when only the geometry differs,
    else a view of its storage."""
    if held.dtype == dtype:
        if offset == 0 and held.shape == size and held.stride() == stride:
            return held
        return held.as_strided(size, stride, offset)
    return torch.empty(0, dtype=dtype, device=held.device).set_(held.untyped_storage(), offset, size, stride)


def _nothing_reached() -> tuple[int, int]:
    return 0, 0


def _rng_state() -> tuple[torch.Tensor, torch.Tensor | None]:
    return torch.get_rng_state(), (torch.cuda.get_rng_state() if torch.cuda.is_available() else None)
