"""A small, easy MNIST look-alike written in MNIST's own file format, for tests that cannot download MNIST.

    python tests/helpers/mnist_fixture.py /tmp/fake_mnist      # then: ddp_mnist.py --data-dir /tmp/fake_mnist

It writes the four uncompressed idx files torchvision.datasets.MNIST reads, under <root>/MNIST/raw/.
An idx file is a big-endian header (magic number, then one int32 per dimension) followed by the uint8
values: magic 2051 and dims (n, 28, 28) for images, magic 2049 and dims (n,) for labels. Each image is
noise plus one bright horizontal bar whose row depends on its label, so a small model learns it quickly.
"""

import struct
import sys
from pathlib import Path

import numpy as np

IMAGE_MAGIC, LABEL_MAGIC = 2051, 2049
SIDE = 28
FILES = {"train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
         "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")}


def draw_images(labels: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """uint8 images (n, 28, 28): noise up to 60, and a bar two rows thick at rows 4 + 2*label, 5 + 2*label."""
    images = rng.integers(0, 61, size=(len(labels), SIDE, SIDE), dtype=np.uint8)
    for image, label in zip(images, labels, strict=True):
        start = int(rng.integers(2, 9))
        length = int(rng.integers(12, 19))
        row = 4 + 2 * int(label)
        image[row:row + 2, start:start + length] = rng.integers(180, 256, dtype=np.uint8)
    return images


def write_idx(path: Path, array: np.ndarray, magic: int) -> None:
    """One idx file: big-endian magic and dimensions, then the raw uint8 values."""
    header = struct.pack(f">{1 + array.ndim}i", magic, *array.shape)
    path.write_bytes(header + np.ascontiguousarray(array, dtype=np.uint8).tobytes())


def write_mnist_fixture(root: Path, n_train: int = 512, n_test: int = 128,
                        seed: int = 0) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Write train and test splits under root/MNIST/raw; returns {split: (images, labels)} as written."""
    rng = np.random.default_rng(seed)
    raw = Path(root) / "MNIST" / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    written = {}
    for split, n in (("train", n_train), ("test", n_test)):
        labels = rng.integers(0, 10, size=n, dtype=np.uint8)
        images = draw_images(labels, rng)
        image_file, label_file = FILES[split]
        write_idx(raw / image_file, images, IMAGE_MAGIC)
        write_idx(raw / label_file, labels, LABEL_MAGIC)
        written[split] = (images, labels)
    return written


if __name__ == "__main__":
    target = Path(sys.argv[1] if len(sys.argv) > 1 else "fake_mnist")
    write_mnist_fixture(target)
    print(f"wrote {target / 'MNIST' / 'raw'}")
