"""Text that came from a file, made safe to print; names and paths given, made safe to use.

A dataset's ``name`` attribute, a checkpoint's settings or an exception
message quoting a file can hold escape sequences that clear the terminal or
forge a line such as ``mpidist: done``.  Everything read from a file is
printed through :func:`printable`, which shows control characters as
Python escapes and keeps the rest as it is.

Names and paths a user gives must be UTF-8 text (:func:`check_utf8`), and a
label that becomes part of a file name is made safe first (:func:`file_label`).
"""

import os
import re

from .errors import UsageError

LONGEST = 200  # characters of one untrusted value shown in a message
#: What a file name built from a label (a dataset's name) keeps: letters, digits, ``_``, ``.`` and ``-``.
LABEL_CHARACTERS = re.compile(r"[^\w.-]+")
LABEL_LENGTH = 60  # characters of a label in a file name (at most 240 bytes of UTF-8: a name's limit is 255)


def os_reason(err, missing, denied, other="{}"):
    """An OSError's reason in words, without the path (the message names it already).

    ``missing`` and ``denied`` say what a missing path and a refused permission
    mean where the error happened; ``other`` formats any other error's text.
    """
    if isinstance(err, FileNotFoundError):
        return missing
    if isinstance(err, NotADirectoryError):
        return "a part of its path is a file, not a directory"
    if isinstance(err, PermissionError):
        return denied
    return other.format(err.strerror or err)


def printable(value, limit=LONGEST):
    """``str(value)`` with control and other non-printing characters escaped, cut to ``limit`` characters."""
    text = str(value)
    out = []
    for char in text:
        if char.isprintable() or char == " ":
            out.append(char)
        else:
            out.append(char.encode("unicode_escape").decode("ascii"))
    shown = "".join(out)
    return shown if len(shown) <= limit else shown[:limit] + "..."


def shown(value):
    """A value read from a file, for a message: ``'ten'``, ``2.5``, ``an array of shape (2,)``,
    ``missing``."""
    if value is None:
        return "missing"
    if hasattr(value, "shape") and getattr(value, "shape", ()) != ():
        return f"an array of shape {tuple(value.shape)}"
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, bytes):
        value = value.decode("utf-8", "replace")
    return printable(repr(value))


def check_utf8(value, what, absolute=False):
    """Refuse ``value`` (a name or path a user gave) where it is not UTF-8 text.

    Linux allows any bytes but ``/`` and NUL in a file name; Python hands
    such bytes over as lone surrogates (``\\udcff`` for byte 0xff), which
    cannot be printed, sent to the other ranks, stored in an HDF5 attribute
    or a TOML file.  They are refused here, before anything is made, with the
    bytes shown.

    Args:
        value: a str or path-like (anything else passes).
        what: how the message names it: ``"--run-dir"``, ``"predict --output"``.
        absolute: ``value`` is a path, checked also as the absolute path it stands for (where it is
            relative), so that a working directory whose name is not UTF-8 is refused too.
    """
    if not isinstance(value, (str, os.PathLike)):
        return
    text = os.fspath(value)
    if isinstance(text, bytes):
        text = os.fsdecode(text)
    candidates = [text]
    if absolute and text and not os.path.isabs(text):
        try:
            candidates.append(os.path.abspath(text))
        except OSError:  # (the working directory is gone: whatever uses the path will say so)
            pass
    for candidate in candidates:
        try:
            candidate.encode("utf-8")
        except UnicodeEncodeError:
            where = (
                ""
                if candidate is text
                else f" (its absolute path {_bytes_shown(candidate)} is not: the working "
                "directory's name is not UTF-8)"
            )
            raise UsageError(
                f"{what} {_bytes_shown(text)}: not UTF-8 text{where}; mpidist takes names and paths "
                "in UTF-8: rename it, or give another"
            ) from None


def _bytes_shown(text):
    """A str that may hold undecodable bytes (as surrogates), shown as its bytes: ``r\\xff``."""
    try:
        raw = text.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:  # (a surrogate no file name decodes to: given in Python)
        raw = text.encode("utf-8", "backslashreplace")
    return printable(repr(raw)[2:-1])


def file_label(name, default="dataset"):
    """``name`` (a label: a dataset's name) as a part of a file name: no ``/``, no ``..``, no control
    characters.

    What is not a letter, a digit, ``_``, ``.`` or ``-`` becomes ``-``; leading
    dots and dashes go (no hidden file, no option), and it is cut to
    :data:`LABEL_LENGTH` characters.  ``default`` where nothing is left.
    """
    label = LABEL_CHARACTERS.sub("-", str(name)).lstrip(".-")[:LABEL_LENGTH].rstrip(".-")
    return label or default
