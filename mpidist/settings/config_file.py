"""The ``--config`` file: read as a regular UTF-8 file of a settings file's size, and parsed as TOML.

A settings file is named by the user and may be anything on disk: a named
pipe or a device would block or never end, a huge file would fill memory.
Reading it safely is a concern of its own, apart from what its keys mean
(:mod:`mpidist.settings.sources` checks those against the fields of
:class:`~mpidist.settings.config.Settings`); every failure here is a
:class:`UsageError` that names the file and says why.
"""

import os
import stat
import sys

from ..runtime.errors import UsageError
from ..runtime.text import os_reason

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

#: Largest ``--config`` file read: a settings file is a few lines.
CONFIG_BYTES = 1 << 20


def _file_kind(mode):
    """What a non-regular file is, in words, from its ``st_mode``."""
    kinds = (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a named pipe (FIFO)"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
    )
    return next((text for test, text in kinds if test(mode)), "not a regular file")


def _why_unreadable(err):
    """Why a config file could not be read, in words."""
    return os_reason(err, "no such file", "not readable (permission denied)", "not readable ({})")


def _check_regular(path, info):
    """Raise :class:`UsageError` unless ``info`` (an ``os.stat`` result) is a regular file of a sensible
    size."""
    if not stat.S_ISREG(info.st_mode):
        raise UsageError(f"--config {path}: {_file_kind(info.st_mode)}, not a TOML file")
    if info.st_size > CONFIG_BYTES:
        raise UsageError(f"--config {path}: {info.st_size} bytes; a settings file is at most {CONFIG_BYTES}")


def read_config_text(path):
    """The text of the ``--config`` file ``path``; :class:`UsageError` for anything but a readable UTF-8 file.

    The path is checked with ``os.stat`` before it is opened, so a named pipe
    or a device is refused instead of blocking or being read; it is opened
    without blocking and checked again, in case it changed in between.
    """
    try:
        _check_regular(path, os.stat(path))
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError as err:
        raise UsageError(f"--config {path}: {_why_unreadable(err)}") from None
    with os.fdopen(fd, "rb") as handle:
        _check_regular(path, os.fstat(fd))
        try:
            data = handle.read(CONFIG_BYTES + 1)
        except OSError as err:
            raise UsageError(f"--config {path}: {_why_unreadable(err)}") from None
    try:
        return data.decode("utf-8-sig")  # (a byte-order mark, as some editors write, is allowed)
    except UnicodeDecodeError as err:
        raise UsageError(
            f"--config {path}: not UTF-8 text ({err.reason}: byte 0x{data[err.start]:02x} at "
            f"offset {err.start})"
        ) from None


def read_table(path):
    """The ``--config`` file ``path`` as a TOML table (keys as written); :class:`UsageError` if it is not
    one."""
    text = read_config_text(path)
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise UsageError(f"--config {path}: not readable as TOML: {err}") from None
    except RecursionError:  # (arrays within arrays past Python's stack: no settings are so)
        raise UsageError(f"--config {path}: not settings (nested too deep to read)") from None
