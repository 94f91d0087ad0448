"""Where a run's settings come from: ``train`` flags, a ``--config`` TOML file, keyword arguments of
``train()``.

Each source names the fields of :class:`~mpidist.settings.config.Settings`
(a flag or TOML key by its flag name, ``batch-size``; a keyword argument by
its field name, ``batch_size``), and each value is checked against its
field's type here, where the source is known, so the message says where it
came from (``--config run.toml: epochs = 'ten' should be an int``).
Precedence: defaults, then the ``--config`` file, then the command line.
"""

import argparse
import dataclasses

from ..parallel import declared_options
from ..runtime.errors import UsageError
from .config import FIELDS, Settings
from .config_file import read_table


def add_flags(parser):
    """Add one flag per :class:`Settings` field (the strategies' own in a group); unset flags stay absent."""
    strategies = parser.add_argument_group("options of the strategies (each applies to the ones it names)")
    own = declared_options()
    for f in dataclasses.fields(Settings):
        kind = (
            {"action": argparse.BooleanOptionalAction}
            if f.type is bool
            else {"type": f.type, "metavar": f.name.upper()}
        )
        if f.metadata.get("bare") is not None:
            kind.update(nargs="?", const=f.metadata["bare"])
        group = strategies if f.name in own else parser
        group.add_argument(
            f"--{Settings.flag(f.name)}",
            dest=f.name,
            default=dataclasses.MISSING,
            help=f"{f.metadata['help']} (default: {f.default!r})",
            **kind,
        )
    parser.add_argument(
        "--config",
        metavar="FILE.toml",
        default=None,
        help="TOML file whose keys are these flag names; the command line wins over it",
    )


def typed(table, where):
    """``{field name: value}`` from ``{flag or field name: value}``, each checked against its field's type.

    ``where`` starts each error message (``--config run.toml``, ``mpidist.train()``).
    """
    settings = {}
    for key, value in table.items():
        name = key.replace("-", "_")
        if name not in FIELDS:
            known = ", ".join(Settings.flag(n) for n in FIELDS)
            raise UsageError(f"{where}: unknown setting {key!r}; known settings: {known}")
        expected = FIELDS[name].type
        if expected is float and isinstance(value, int) and not isinstance(value, bool):
            value = _as_float(value, key, where)
        if not isinstance(value, expected) or (isinstance(value, bool) and expected is not bool):
            raise UsageError(
                f"{where}: {key} = {value!r} should be a{'n' if expected is int else ''} {expected.__name__}"
            )
        settings[name] = value
    return settings


def _as_float(value, key, where):
    """An int setting given for a float field, as a float; one too large for a float is refused."""
    try:
        return float(value)
    except OverflowError:
        raise UsageError(f"{where}: {key} = {value} is too large for a float") from None


def load_toml(path):
    """Settings from a TOML file, keyed by flag or field name; unknown keys are errors."""
    return typed(read_table(path), f"--config {path}")


def settings_from(settings=None, **overrides):
    """``settings`` (a :class:`Settings`, or None for the defaults) with ``overrides``, each checked."""
    if settings is not None and not isinstance(settings, Settings):
        raise UsageError(f"settings= takes an mpidist.Settings, got {type(settings).__name__}")
    base = settings or Settings()
    return dataclasses.replace(base, **typed(overrides, "mpidist.train()"))


def settings_from_args(namespace):
    """Build a :class:`Settings` from parsed flags (and their ``--config`` file)."""
    settings = load_toml(namespace.config) if getattr(namespace, "config", None) else {}
    for name in FIELDS:
        value = getattr(namespace, name, dataclasses.MISSING)
        if value is not dataclasses.MISSING:
            settings[name] = value
    return Settings(**settings)
