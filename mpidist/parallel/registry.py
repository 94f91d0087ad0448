"""Strategies by name, the settings each one declares, and the splits of the mesh's axes.

A strategy is one module plus one registration: its class carries its
``name``, the :class:`Option` objects of the settings only it (and its
subclasses) use, and classmethods that check those settings against the
world, turn them into constructor arguments, and say whose data each rank
reads (see :class:`~mpidist.parallel.base.Strategy`).  :mod:`mpidist.settings`
makes one flag, TOML key and keyword argument of :func:`mpidist.train` per
declared option (:mod:`~mpidist.settings.config`), and refuses an option set for
a strategy that does not use it (:mod:`~mpidist.settings.validation`), so neither
the settings nor the set-up of a run name strategies one by one.

Registering a strategy: decorate its class with :func:`register` in its
module, and import that module in :mod:`mpidist.parallel`.  A family that
splits the model over an axis of the mesh (the tensor parts) registers its
split the same way (:func:`register_split`).
"""

import dataclasses

#: name -> strategy class, in registration order (the order of ``--strategy``'s choices).
STRATEGIES = {}


@dataclasses.dataclass(frozen=True)
class Option:
    """A setting a strategy declares: a field of :class:`~mpidist.settings.config.Settings` and a ``train``
    flag.

    Args:
        name: the field name (``micro_batches``; the flag is ``--micro-batches``).
        default: its value when not given; also its type (int, float, str or bool).
        help: the flag's help text.
        choices: the values allowed, where only some are.
        why: why the other strategies refuse it, where that is not plain (said when they do).
    """

    name: str
    default: object
    help: str
    choices: tuple = None
    why: str = ""

    @property
    def type(self):
        return type(self.default)


def register(cls):
    """Class decorator: make ``cls`` the strategy ``--strategy cls.name`` runs."""
    if cls.name in STRATEGIES:
        raise ValueError(
            f"a strategy named {cls.name!r} is registered already ({STRATEGIES[cls.name].__name__})"
        )
    STRATEGIES[cls.name] = cls
    return cls


def declared_options():
    """``{name: (Option, [names of the strategies that use it])}`` over every registered strategy."""
    found = {}
    for name, cls in STRATEGIES.items():
        for option in cls.options:
            found.setdefault(option.name, (option, []))[1].append(name)
    return found


#: mesh axis -> the class that splits a model over that axis where it has several parts, registered by the
#: family that owns the split (:mod:`mpidist.parallel.tensor`), so that the strategies that compose with it
#: reach it through the core (:func:`~mpidist.parallel.parts.split_over`) and never import that family.
SPLITS = {}


def register_split(axis):
    """Class decorator: make the class the split of the mesh axis ``axis`` (``cls(model, mesh, writes,
    buffers)``)."""

    def register_class(cls):
        if axis in SPLITS:
            raise ValueError(f"the {axis!r} axis has a split already ({SPLITS[axis].__name__})")
        SPLITS[axis] = cls
        return cls

    return register_class
