"""What each scanned image is for: training, regularisation (prior preservation) or validation.

- **Validation** images are held out: validation concepts whole, and `data.validation_fraction` of the
  training concepts' images, chosen by a hash of each image's content (`hold_out`) - so the same images are
  held out whatever the seed, the file order or the number of processes.
- **Regularisation** images are balanced as kohya's sd-scripts balances them: each epoch holds as many
  regularisation items as training items (`epoch_items`: the regularisation images in turn, each as often as
  its concept's repeats allow before any repeats, then around again), and the sampler mixes the two evenly
  into every global batch of a bucket that holds both (`sampler.BucketBatchSampler`, `groups`).
"""
from __future__ import annotations

import hashlib
from typing import Protocol, Sequence, TypeVar


class ScannedImage(Protocol):
    """What the roles read of a scanned image (`concepts.ImageRecord`, which scanning the concepts then
    hands here: so this module needs nothing of the scan)."""
    content_hash: str
    role: str
    repeats: int


Image = TypeVar("Image", bound=ScannedImage)

TRAIN, REGULARISATION = 0, 1
"""Item groups the sampler balances (`item_groups`)."""


def hold_out(training: Sequence[Image], fraction: float) -> tuple[list[Image], list[Image]]:
    """(kept for training, held out for validation): the `fraction` of images whose content hash ranks first
    (at least one when the fraction is above 0, and never all of them)."""
    if fraction <= 0 or len(training) < 2:
        return list(training), []
    count = min(len(training) - 1, max(1, round(fraction * len(training))))
    rank = sorted(range(len(training)),
                  key=lambda i: (hashlib.sha256(f"validation:{training[i].content_hash}".encode()).hexdigest(), i))
    held = set(rank[:count])
    return ([r for i, r in enumerate(training) if i not in held], [r for i, r in enumerate(training) if i in held])


def epoch_items(images: Sequence[ScannedImage]) -> list[int]:
    """Indexes into `images` of one epoch's items: each training image `repeats` times (in image order), then
    as many regularisation items as training items."""
    items = [i for i, image in enumerate(images) if image.role == "train" for _ in range(image.repeats)]
    regularisation = [i for i, image in enumerate(images) if image.role == "regularisation"]
    if not regularisation:
        return items
    # Round robin over the images, each up to its repeats: so a regularisation set larger than the training set
    # leaves out repeats before it leaves out any image, and a smaller one is gone around again.
    turns = [i for turn in range(max(images[i].repeats for i in regularisation))
             for i in regularisation if images[i].repeats > turn]
    wanted = len(items)
    return items + [turns[k % len(turns)] for k in range(wanted)]


def item_groups(images: Sequence[ScannedImage], item_images: Sequence[int]) -> list[int] | None:
    """Each item's group (TRAIN or REGULARISATION) for the sampler; None without regularisation items."""
    groups = [REGULARISATION if images[i].role == "regularisation" else TRAIN for i in item_images]
    return groups if REGULARISATION in groups else None
