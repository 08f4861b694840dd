"""A padded output's fill job: what the decoder hands over for each padded token field it leaves unfilled
(``tensors.decode_padded``, ``grouped.py``), filled on the host (``decoder.fill``) or on a device
(``device/plan.py``, ``pad.py``)."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from ..numpy_view import unpack_bits

__all__ = ["FillJob"]


class FillJob(NamedTuple):
    """Rows ``r0:r1`` of a padded output to fill from one chunk's values: ``src`` (raw bits) at the
    positions of ``mask``, with ``off`` the row offsets into ``src``; the other positions get
    ``pad``, or ``pv`` (offsets, raw bits) of the recorded padded values. ``starts``: each row's
    first valid position (one run per row: a right or left padded mask), None if not known;
    ``mask`` is None where ``starts`` tells it (a deferred job: ``decoder.fill`` builds its rows). ``shift`` >= 0:
    ``src`` is a bool column's bitmap, its first value bit ``shift`` (``codec/late.py``; ``unbits``)."""

    out: torch.Tensor
    mask: torch.Tensor | None
    src: torch.Tensor
    off: np.ndarray
    pad: int
    r0: int
    r1: int
    pv: tuple[np.ndarray, torch.Tensor] | None
    starts: np.ndarray | None = None
    shift: int = -1

    def unbits(self) -> FillJob:
        """The job, its values unpacked on the host where ``src`` is a bitmap."""
        if self.shift < 0:
            return self
        n = int(self.off[self.r1] - self.off[self.r0])
        return self._replace(src=torch.from_numpy(unpack_bits(self.src.numpy(), self.shift, n)), shift=-1)
