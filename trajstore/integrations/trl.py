"""TRL (and Qwen-VL style batches from any trainer): image fields stored per sample.

A vision-language GRPO batch (``GRPOTrainer._generate_and_score_completions``) holds every image's
patch rows concatenated: ``pixel_values`` ``[sum_patches, d]``, ``image_grid_thw`` ``[n_images, 3]``
(image ``j`` owns ``t * h * w`` rows of ``pixel_values``) and ``num_images`` (a list: images per
sample, in order; absent means one image per sample). TRL itself cuts ``pixel_values`` this way
(``trl.trainer.utils.split_pixel_values_by_grid``, called by ``_prepare_inputs``): sample ``i``'s
rows follow sample ``i - 1``'s.

``splits`` recognises such a batch by names and shapes alone (what ``Writer.append`` may look at)
and names the fields to store one slice per sample; ``Split.rows`` then reads ``image_grid_thw``
(a few integers) to give each sample's rows. The format stores each of them as a *segmented* tensor
(docs/FORMAT.md 3.7, ``segtensor``), rebuilt on read as the original concatenated tensor.

Knows nothing of torch: tensors and numpy arrays are read through ``shape``, ``ndim``, ``prod``
and ``tolist`` only.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import BatchError

__all__ = ["PIXEL_VALUES", "GRID", "NUM_IMAGES", "Split", "splits"]

PIXEL_VALUES, GRID, NUM_IMAGES = "pixel_values", "image_grid_thw", "num_images"

_FIX = ("pass the batch as the trainer built it (pixel_values holding the patch rows of every image of "
        "sample 0, then sample 1, ...), or store pixel_values as a list of per-sample tensors")


def _tensorlike(v: Any) -> bool:
    return hasattr(v, "shape") and hasattr(v, "dtype") and hasattr(v, "tolist") and getattr(v, "ndim", 0) >= 1


def _images(batch: Mapping, B: int) -> list[int] | None:
    """Images per sample: ``num_images`` checked (B non-negative ints), or one each when absent."""
    n = batch.get(NUM_IMAGES)
    if n is None:
        return [1] * B
    if not isinstance(n, list | tuple) or any(type(x) is not int or x < 0 for x in n):
        return None
    return list(n)


@dataclass(frozen=True)
class Split:
    """Field ``field`` is stored one slice of its leading dimension per sample; ``reads`` are the
    fields whose values ``rows`` reads (their device decides whether ``Writer.append`` reads them)."""

    field: str
    reads: tuple[str, ...]
    images: tuple[int, ...]  # images per sample

    def rows(self, batch: Mapping) -> list[int]:
        """Leading-dimension rows of ``field`` per sample (reads ``image_grid_thw`` for pixel_values);
        BatchError where they do not add up to the field's leading size."""
        if self.field == GRID:
            return list(self.images)
        grid = batch[GRID]
        per_image = [int(x) for x in grid.prod(-1).tolist()]
        out, j = [], 0
        for k in self.images:
            out.append(sum(per_image[j:j + k]))
            j += k
        total = int(batch[PIXEL_VALUES].shape[0])
        if sum(out) != total or any(x < 0 for x in per_image):
            raise BatchError(
                f"fields {PIXEL_VALUES!r} and {GRID!r}: image_grid_thw gives {sum(per_image)} patch rows "
                f"(t*h*w summed over its {len(per_image)} images: {per_image[:8]}{'...' if len(per_image) > 8 else ''}), "
                f"pixel_values has {total} rows (shape {list(batch[PIXEL_VALUES].shape)}); the rows of each "
                f"sample cannot be told apart; {_FIX}")
        return out


def splits(batch: Mapping, B: int) -> dict[str, Split]:
    """The fields of a Qwen-VL style batch of ``B`` samples stored per sample, from names and shapes
    only: ``pixel_values`` (when its leading size is not ``B``) split by ``image_grid_thw``, and
    ``image_grid_thw`` split by ``num_images`` (when that is not one image per sample). ``{}`` for
    other batches; BatchError where the names are there but the sizes cannot add up."""
    pv, grid = batch.get(PIXEL_VALUES), batch.get(GRID)
    if not (_tensorlike(pv) and _tensorlike(grid)):
        return {}
    images = _images(batch, B)
    n_img = int(grid.shape[0])
    if images is None or len(images) != B or sum(images) != n_img or grid.ndim != 2:
        if int(pv.shape[0]) == B and (grid.ndim != 2 or n_img == B):
            return {}  # one row per sample already: nothing to split
        got = batch.get(NUM_IMAGES)
        raise BatchError(
            f"fields {PIXEL_VALUES!r}, {GRID!r} and {NUM_IMAGES!r}: pixel_values {list(pv.shape)} holds "
            f"the patch rows of {n_img} images (image_grid_thw {list(grid.shape)}), but "
            + (f"num_images ({str(got)[:80]}) is not a list of {B} non-negative ints summing to {n_img}"
               if got is not None else f"there is no num_images and the batch has {B} samples, not {n_img}")
            + f"; {_FIX}")
    out: dict[str, Split] = {}
    if int(pv.shape[0]) != B:
        out[PIXEL_VALUES] = Split(PIXEL_VALUES, (GRID,), tuple(images))
    if any(k != 1 for k in images):
        out[GRID] = Split(GRID, (), tuple(images))
    return out
