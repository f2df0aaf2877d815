"""The MNIST look-alike the DDP walkthrough trains on (tests/helpers/mnist_fixture.py): torchvision
reads it as MNIST. The walkthroughs themselves are tests/e2e/test_tutorial_data_parallel_runs.py."""

import numpy as np

from tests.helpers.mnist_fixture import write_mnist_fixture


def test_torchvision_reads_the_fixture(tmp_path):
    from torchvision.datasets import MNIST

    written = write_mnist_fixture(tmp_path, n_train=64, n_test=16, seed=3)
    for train, split in ((True, "train"), (False, "test")):
        images, labels = written[split]
        ds = MNIST(tmp_path, train=train, download=False)
        assert tuple(ds.data.shape) == (len(labels), 28, 28) and str(ds.data.dtype) == "torch.uint8"
        assert np.array_equal(ds.data.numpy(), images)
        assert np.array_equal(ds.targets.numpy(), labels.astype(np.int64))
        image, label = ds[5]
        assert np.array_equal(np.asarray(image), images[5]) and label == labels[5]
    assert len(set(written["train"][1].tolist())) == 10  # every class present
