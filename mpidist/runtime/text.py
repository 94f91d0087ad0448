"""Text that came from a file, made safe to print.

A dataset's ``name`` attribute, a checkpoint's settings or an exception
message quoting a file can hold escape sequences that clear the terminal or
forge a line such as ``mpidist: done``.  Everything read from a file is
printed through :func:`printable`, which shows control characters as
Python escapes and keeps the rest as it is.
"""

LONGEST = 200   # characters of one untrusted value shown in a message


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
    """A value read from a file, for a message: ``'ten'``, ``2.5``, ``an array of shape (2,)``, ``missing``."""
    if value is None:
        return "missing"
    if hasattr(value, "shape") and getattr(value, "shape", ()) != ():
        return f"an array of shape {tuple(value.shape)}"
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, bytes):
        value = value.decode("utf-8", "replace")
    return printable(repr(value))
