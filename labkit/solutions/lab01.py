"""Reference answers to Lab 1's exercises."""

import os

import numpy as np

from labkit import ladder
from labkit.exercises import Answer

EX_1_1 = Answer(
    right=lambda images, epochs: epochs * images + images,
    wrong=lambda images, epochs: 2 * epochs * images,
    wrong_because="counts the raw cache as fetching every epoch, like the remote path",
)


def _flip(seed: int, epoch: int, index: int) -> bool:
    """A generator seeded by what the sample is, so any worker draws the same."""
    return bool(np.random.default_rng([seed, epoch, index]).random() < 0.5)


EX_1_2 = Answer(
    right=_flip,
    wrong=lambda seed, epoch, index: hash((seed, epoch, index, os.getpid())) % 2 == 1,
    wrong_because="mixes in the process id: the answer depends on which worker decodes the image",
)

EX_1_3 = Answer(
    right=lambda run, images, image_px: images * 3 * image_px ** 2,
    wrong=lambda run, images, image_px: ladder.dataset_bytes(run.paths[:images]),
    wrong_because="the JPEGs' size: that is the raw cache, not the transformed one",
)
