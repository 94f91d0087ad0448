"""Where a run's model comes from: a zoo spec, a builder function, or the user's own layers.

``--model`` (and ``mpidist.train(model=...)``) takes

* a zoo name or spec: ``mlp``, ``mlp:256,256,256``, ``cnn:16,32`` (see ``python -m mpidist info --models``);
* ``package.module:function`` or ``path/to/file.py:function``: a *builder*,
  ``function(sample_shape, outputs) -> list of layers`` (or a
  :class:`~mpidist.nn.Sequential`), called on every rank with the dataset's
  per-sample shape and its output count (classes, or the regression target width);
* in Python only, the builder function itself, a list of layers, or a
  :class:`~mpidist.nn.Sequential`.

Every model has a *spec*, the string a checkpoint stores so that ``eval``,
``--resume`` and a resume under another strategy rebuild the same model.  A
builder function given in Python is recorded by where it can be imported
from again (``module:function``, or ``file.py:function`` for a function
defined in the script that was run, by its absolute path); layers given as objects cannot be
rebuilt from a string, and their checkpoints say so when loaded.

Loading a builder imports its module or runs its file (under a module name
other than ``__main__``, so a script's ``if __name__ == "__main__":`` block
does not run).  A checkpoint names that code: evaluate or resume only
checkpoints you trust, or name the builder yourself with ``--model``.
"""

import dataclasses
import importlib
import importlib.util
import inspect
import sys
from pathlib import Path

from .. import nn
from ..nn.sequential import RepeatedLayer
from ..runtime.errors import UsageError
from ..runtime.suggest import nearest

#: The spec recorded for a model given as layer objects: no string can rebuild it.
OBJECTS = "<layers given in Python>"
#: The file ``--model file.py:function`` is running to find its builder (None: none is), so that a file
#: which trains when loaded is told so instead of training (see :func:`refuse_training_while_loading`).
_loading = [None]


def refuse_training_while_loading():
    """Raise :class:`UsageError` where a builder's file is being loaded: it must define its model, not train
    it."""
    if _loading[0] is not None:
        where = _loading[0]
        raise UsageError(
            f"{where} calls mpidist.train() when it is loaded, so --model {where}:... would train "
            "twice (once as the file says, once as the command says): put that call under "
            "'if __name__ == \"__main__\":', so that loading the file only defines the model"
        )


@dataclasses.dataclass
class ModelSource:
    """A model's spec (what checkpoints store) and how to build it for a dataset."""

    spec: str
    builder: object = None  # (sample_shape, outputs) -> layers or Sequential; None for zoo specs
    layers: object = None  # a list of layers or a Sequential given as objects

    def build(self, sample_shape, outputs, xp, dtype, buffers=True):
        """The model for samples of ``sample_shape`` and ``outputs`` outputs; a mismatch is a
        :class:`UsageError`.

        ``buffers``: as :class:`~mpidist.nn.Sequential` takes it (False: a map of shapes until first used).
        """
        try:
            if self.layers is not None:
                return _as_model(self.layers, sample_shape, xp, dtype, buffers)
            if self.builder is None:
                return nn.build_model(self.spec, sample_shape, outputs, xp, dtype, buffers)
            return _as_model(
                self.builder(tuple(sample_shape), int(outputs)), sample_shape, xp, dtype, buffers
            )
        except nn.ShapeError as err:
            raise UsageError(
                f"--model {self.spec} does not fit samples of shape {tuple(sample_shape)} with "
                f"{outputs} outputs: {err}"
            ) from None
        except RepeatedLayer as err:
            raise UsageError(f"--model {self.spec}: {err}") from None


def _as_model(made, sample_shape, xp, dtype, buffers=True):
    """A builder's result (layers, or a Sequential) as a :class:`~mpidist.nn.Sequential` on ``xp``."""
    if isinstance(made, nn.Sequential):
        made = made.layers  # rebuilt here, on this run's device and dtype
    layers = list(made) if isinstance(made, (list, tuple)) else None
    if not layers or not all(isinstance(layer, nn.Layer) for layer in layers):
        raise UsageError(
            f"a model builder must return a non-empty list of mpidist.nn layers (or an "
            f"mpidist.nn.Sequential), got {type(made).__name__}"
        )
    return nn.Sequential(layers, sample_shape, xp=xp, dtype=dtype, buffers=buffers)


def resolve(model):
    """``model`` (a spec string, a builder, layers or a Sequential) as a :class:`ModelSource`.

    Raises :class:`UsageError` for a spec that names nothing buildable.
    """
    if isinstance(model, ModelSource):
        return model
    if isinstance(model, nn.Sequential) or (isinstance(model, (list, tuple)) and model):
        return ModelSource(OBJECTS, layers=model)
    if callable(model):
        return ModelSource(spec_of(model), builder=model)
    if not isinstance(model, str) or not model:
        raise UsageError(
            f"model: give a zoo name or spec, 'module:function', 'file.py:function', a builder "
            f"function, or a list of layers; got {model!r}"
        )
    if model == OBJECTS:
        raise UsageError(
            "this model was given as layer objects in Python, which a checkpoint cannot rebuild: pass "
            "the same layers as model= to mpidist.evaluate / mpidist.train, or train with a builder "
            "function so its checkpoints name it"
        )
    if ":" not in model or _is_zoo_spec(model) or _mistyped_zoo_spec(model):
        try:
            nn.parse_spec(model)
        except (KeyError, ValueError) as err:
            raise UsageError(f"--model {model!r}: {_message(err)}") from None
        return ModelSource(model)
    return ModelSource(_absolute(model), builder=load_builder(model))


def _absolute(spec):
    """``file.py:function`` with the file's absolute path: a checkpoint is evaluated from anywhere."""
    where, _, name = spec.rpartition(":")
    return f"{Path(where).expanduser().resolve()}:{name}" if where.endswith(".py") else spec


def _is_zoo_spec(spec):
    return spec.split(":", 1)[0] in nn.MODELS


def _mistyped_zoo_spec(spec):
    """Whether ``spec`` reads as a zoo name mistyped (``mpl:128,64``): a bare word close to a zoo name,
    before arguments of the zoo's kind, which no module can be (``module:function`` names a function)."""
    name, _, rest = spec.partition(":")
    return (
        name.isidentifier()
        and bool(nearest(name, nn.MODELS))
        and all(part.strip().isdigit() for part in rest.split(","))
    )


def _message(err):
    return err.args[0] if isinstance(err, KeyError) and err.args else str(err)


def load_builder(spec):
    """The function ``package.module:function`` or ``path/file.py:function`` names."""
    where, _, name = spec.rpartition(":")
    if not where or not name:
        raise UsageError(f"--model {spec!r}: give 'package.module:function' or 'path/to/file.py:function'")
    if where.endswith(".py"):
        path = Path(where).expanduser()
        if not path.is_file():
            raise UsageError(f"--model {spec}: no such file {where}")
        module_name = f"mpidist_user_model_{abs(hash(str(path.resolve())))}"
        module = sys.modules.get(module_name)
        if module is None:
            loader = importlib.util.spec_from_file_location(module_name, path)
            module = importlib.util.module_from_spec(loader)
            sys.modules[module_name] = module
            _loading[0] = where
            try:
                loader.loader.exec_module(module)
            except UsageError:  # (the file trains when loaded: its own message says so)
                del sys.modules[module_name]
                raise
            except Exception as err:
                del sys.modules[module_name]
                raise UsageError(
                    f"--model {spec}: running {where} failed: {type(err).__name__}: {err}"
                ) from None
            finally:
                _loading[0] = None
    else:
        try:
            module = importlib.import_module(where)
        except ImportError as err:
            raise UsageError(f"--model {spec}: cannot import {where} ({err})") from None
    builder = module
    for part in name.split("."):
        builder = getattr(builder, part, None)
    if not callable(builder):
        raise UsageError(f"--model {spec}: {where} has no function {name!r}")
    return builder


def spec_of(builder):
    """The spec that imports ``builder`` again: ``module:function``, ``file.py:function``, or :data:`OBJECTS`.

    A function defined in the script being run (module ``__main__``) is named by
    the script's absolute path.
    """
    name = getattr(builder, "__qualname__", "")
    module = getattr(builder, "__module__", None)
    if not name or "<" in name or module is None:  # a lambda or a function defined inside a function
        return OBJECTS
    if module == "__main__" or module.startswith("mpidist_user_model_"):
        path = inspect.getsourcefile(builder)
        return f"{Path(path).resolve()}:{name}" if path else OBJECTS
    return f"{module}:{name}"
