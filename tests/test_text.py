"""Text as a character-level language-modelling dataset: windows, next-character labels, splits in text
order."""

import importlib.util
import sys

import h5py
import numpy as np
import pytest

from conftest import ROOT, mpidist

from mpidist import data
from mpidist.runtime.errors import UsageError
from mpidist.tools import text
from mpidist.tools.ingest import ingest

HAS_GENSIM = importlib.util.find_spec("gensim") is not None


def decoded(ids, names):
    chars = [{"space": " ", "U+000A": "\n"}.get(name, name) for name in names]
    return "".join(chars[i] for i in ids)


def test_windows_are_labelled_by_the_next_character_and_the_splits_follow_the_text_in_order():
    corpus = "".join(f"line {i}: the quick brown fox.\n" for i in range(40))
    splits, names = text.text_splits(corpus, window=8, stride=4)
    assert names == sorted(names, key=lambda name: {"space": " ", "U+000A": "\n"}.get(name, name))
    assert names[:2] == ["U+000A", "space"] and len(set(names)) == len(set(corpus))
    x, y = splits["train"]
    assert x.shape[1:] == y.shape[1:] == (8,) and x.dtype == np.uint8
    np.testing.assert_array_equal(x[:, 1:], y[:, :-1])  # y is x one character on
    assert decoded(x[0], names) == corpus[:8] and decoded(y[0], names) == corpus[1:9]
    assert decoded(x[1], names) == corpus[4:12]  # training windows every 4
    cut = int(round(0.8 * len(corpus)))
    assert decoded(splits["val"][0][0], names) == corpus[cut : cut + 8]  # val follows train, test follows val
    val_x = splits["val"][0]
    assert decoded(val_x[1], names) == corpus[cut + 8 : cut + 16]  # val windows do not overlap
    assert decoded(splits["test"][1][-1], names)[-1] in corpus[-9:]


def test_a_text_too_short_or_of_one_character_is_refused_naming_the_split():
    with pytest.raises(UsageError, match="leave the val split .* no window of 9"):
        text.text_splits("abcdefghij" * 5, window=8, stride=4)
    with pytest.raises(UsageError, match="1 distinct character"):
        text.text_splits("aaaa" * 100)


def test_class_names_are_the_characters_or_their_code_points():
    assert [text.char_name(c) for c in "a \n\t\u00e9\x00"] == [
        "a",
        "space",
        "U+000A",
        "U+0009",
        "\u00e9",
        "U+0000",
    ]


def test_a_missing_package_is_an_import_error():
    with pytest.raises(ImportError):
        text.package_file("no_such_package_here", "data.txt")


def test_ingest_without_gensim_names_the_install_command_and_writes_nothing(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "gensim", None)  # importing (or finding) it now fails
    with pytest.raises(
        UsageError, match="source 'lee-text' needs the package 'gensim': pip install 'gensim'"
    ):
        ingest("lee-text", tmp_path / "lee.h5")
    assert not (tmp_path / "lee.h5").exists()


def test_standardising_token_ids_is_refused_before_anything_is_read(tmp_path):
    """Standardised character ids become negative and fractional numbers an Embedding would misread."""
    with pytest.raises(UsageError, match="ingest lee-text --standardize: its samples are token ids"):
        ingest("lee-text", tmp_path / "lee.h5", standardize=True)
    assert not list(tmp_path.iterdir())


def test_a_gensim_without_the_corpus_is_one_line_and_exit_code_2(tmp_path):
    """A package called gensim that lacks its test data (a stripped install): named, nothing written."""
    (tmp_path / "fake" / "gensim").mkdir(parents=True)
    (tmp_path / "fake" / "gensim" / "__init__.py").write_text("raise RuntimeError('never imported')\n")
    done, _ = mpidist(
        1, "ingest", "lee-text", str(tmp_path / "lee.h5"), env={"PYTHONPATH": f"{tmp_path / 'fake'}:{ROOT}"}
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().count("\n") == 0 and "has no test/test_data/lee_background.cor" in done.stderr
    assert "never imported" not in done.stderr and not (tmp_path / "lee.h5").exists()


def test_a_corpus_that_is_not_utf8_is_refused_naming_the_file(monkeypatch, tmp_path):
    (tmp_path / "lee_text_fake_pkg").mkdir()
    (tmp_path / "lee_text_fake_pkg" / "corpus.txt").write_bytes(b"caf\xe9 " * 100)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(text, "LEE", ("lee_text_fake_pkg", "corpus.txt"))
    with pytest.raises(UsageError, match=r"corpus.txt: cannot be read as UTF-8 text"):
        ingest("lee-text", tmp_path / "lee.h5")
    assert not (tmp_path / "lee.h5").exists()


@pytest.mark.skipif(
    not HAS_GENSIM, reason="the lee-text source reads gensim's test data (the datasets extra)"
)
def test_lee_text_ingests_into_train_val_and_test_windows_of_64_labelled_per_position(tmp_path):
    written = ingest("lee-text", tmp_path / "lee.h5")
    info = data.inspect(written)
    assert info.sizes == {"train": 18001, "val": 562, "test": 562} and info.num_classes == 81
    assert (info.sample_shape, info.target_shape) == ((64,), (64,))
    with h5py.File(written) as handle:
        x, y = handle["train/x"][:2], handle["train/y"][:2]
    assert decoded(x[0], info.class_names).startswith("Hundreds of people have been forced to vacate")
    np.testing.assert_array_equal(x[:, 1:], y[:, :-1])
    assert "windows of 64 characters" in info.source
