"""Text as a character-level language-modelling dataset: windows of character ids, labelled by the next ones.

A text is cut, in order, into train, val and test parts (so no window spans
two splits, and the test text follows everything trained on); each part
becomes windows of ``window`` characters.  Window ``i`` of a split is ``x =
ids[s:s + window]`` with ``y = ids[s + 1:s + window + 1]``: the label at each
position is the next character (classification at every position, labels
``(N, window)``).  Training windows start every ``stride`` characters (they
overlap for ``stride < window``: each character is seen at several positions);
val and test windows do not overlap, so each character of those parts is
predicted once.  The classes are the text's distinct characters in code-point
order, named by themselves (``space``, ``U+000A`` and so on for whitespace and
control characters).

The named source ``lee-text`` is the Lee background corpus that gensim ships
(``gensim/test/test_data/lee_background.cor``: 300 news articles of the
Australian Broadcasting Corporation, one per line, 360,082 characters, used by
Lee, Pincombe and Welsh, 2005, and by gensim's tutorials), read from the
installed package without importing it.
"""

import importlib.util
from pathlib import Path

import numpy as np

from ..runtime.errors import UsageError

WINDOW = 64  # characters per sample
STRIDE = 16  # between training windows
PARTS = (("train", 0.8), ("val", 0.1), ("test", 0.1))
LEE = ("gensim", "test/test_data/lee_background.cor")
LEE_SOURCE = (
    "gensim's test data lee_background.cor: the Lee background corpus (Lee, Pincombe & Welsh, 2005), "
    "300 ABC news articles, 360,082 characters; character-level language modelling, windows of "
    f"{WINDOW} characters (training windows every {STRIDE}), y = the next character at each position; "
    "train/val/test the first 80% / next 10% / last 10% of the text"
)


def char_name(char):
    """A class name for ``char``: itself where it is visible, else ``space`` or its code point
    (``U+000A``)."""
    if char == " ":
        return "space"
    return char if char.isprintable() and not char.isspace() else f"U+{ord(char):04X}"


def windows(ids, window, stride):
    """``(x, y)``: windows of ``ids`` starting every ``stride``, each labelled by the ids one position on."""
    count = (len(ids) - 1 - window) // stride + 1
    if count < 1:
        return None
    starts = np.arange(count) * stride
    index = starts[:, None] + np.arange(window)
    return ids[index], ids[index + 1]


def text_splits(text, window=WINDOW, stride=STRIDE, where="text"):
    """``(splits, class names)``: train, val and test windows of ``text`` (see the module's docstring)."""
    if window < 1 or stride < 1:
        raise UsageError(f"{where}: windows of {window} characters every {stride}: both must be at least 1")
    chars = sorted(set(text))
    if len(chars) < 2:
        raise UsageError(f"{where}: {len(chars)} distinct character(s); a language model needs at least 2")
    codes = np.full(max(map(ord, chars)) + 1, -1, dtype=np.int64)
    codes[[ord(char) for char in chars]] = np.arange(len(chars))
    ids = codes[np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)]
    dtype = np.uint8 if len(chars) <= 256 else np.int32
    splits, begin = {}, 0
    for index, (split, fraction) in enumerate(PARTS):
        end = len(ids) if index == len(PARTS) - 1 else begin + int(round(fraction * len(ids)))
        made = windows(ids[begin:end], window, stride if split == "train" else window)
        if made is None:
            raise UsageError(
                f"{where}: {len(ids):,} characters leave the {split} split ({end - begin:,} of them) "
                f"no window of {window + 1} (a window and the character after it)"
            )
        splits[split] = (made[0].astype(dtype), made[1].astype(dtype))
        begin = end
    return splits, [char_name(char) for char in chars]


def package_file(package, relative):
    """The path of ``relative`` inside installed ``package``, found without importing it.

    Raises ImportError where the package is not installed (the caller names the
    install command) and UsageError where an installed package lacks the file.
    """
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):  # ValueError: a module set to None in sys.modules, or without a spec
        spec = None
    if spec is None:
        raise ImportError(f"no module named {package!r}")
    locations = list(spec.submodule_search_locations or [])
    for location in locations:
        path = Path(location) / relative
        if path.is_file():
            return path
    raise UsageError(
        f"the installed {package} ({', '.join(map(str, locations)) or spec.origin}) has no "
        f"{relative}: reinstall it (pip install --force-reinstall '{package}')"
    )


def lee_text(seed=0):
    """``(splits, num_classes, facts)`` of the ``lee-text`` source (``seed`` is unused: the windows are in
    order)."""
    path = package_file(*LEE)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise UsageError(f"{path}: cannot be read as UTF-8 text ({err})") from None
    splits, names = text_splits(text, where=str(path))
    return splits, len(names), {"class_names": names}
