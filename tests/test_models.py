"""Where models come from: zoo specs, builders named by module or file, objects; and their specs."""

import numpy as np
import pytest

from mpidist import nn
from mpidist.runtime.errors import UsageError
from mpidist.settings import models


def test_zoo_specs_set_widths_and_name_themselves():
    source = models.resolve("mlp:7,5")
    model = source.build((8, 8), 3, np, np.float64)
    assert source.spec == "mlp:7,5"
    assert [layer.units for layer in model.layers if isinstance(layer, nn.Dense)] == [7, 5, 3]


@pytest.mark.parametrize(
    "spec,message",
    [
        ("mlp:0", "positive integers"),
        ("linear:3", "takes no arguments"),
        ("resnet", "not in the zoo"),
        ("", "give a zoo name"),
        ("no_such_module_here:f", "cannot import"),
        ("json:no_such_function", "has no function"),
    ],
)
def test_a_spec_that_builds_nothing_is_a_usage_error_naming_it(spec, message):
    with pytest.raises(UsageError, match=message):
        models.resolve(spec)


def test_a_builder_file_is_loaded_without_running_its_main_block_and_recorded_by_absolute_path(
    tmp_path, monkeypatch
):
    script = tmp_path / "mine.py"
    script.write_text(
        "from mpidist import nn\n"
        "def build(shape, outputs):\n"
        "    return [nn.Flatten(), nn.Dense(outputs)]\n"
        "if __name__ == '__main__':\n"
        "    raise SystemExit('the main block ran')\n"
    )
    monkeypatch.chdir(tmp_path)
    source = models.resolve("mine.py:build")
    assert source.spec == f"{script.resolve()}:build"
    assert source.build((4,), 2, np, np.float32).num_params == 10
    assert models.spec_of(source.builder) == source.spec  # the same spec again from the function


def test_functions_are_recorded_where_they_can_be_imported_again_and_lambdas_as_objects():
    assert models.spec_of(np.linalg.norm).endswith(":norm")
    assert models.spec_of(lambda shape, outputs: []) == models.OBJECTS

    def inner(shape, outputs):
        return []

    assert models.spec_of(inner) == models.OBJECTS
    with pytest.raises(UsageError, match="cannot rebuild"):
        models.resolve(models.OBJECTS)


def test_a_builder_that_returns_no_layers_says_what_it_must_return():
    with pytest.raises(UsageError, match="must return a non-empty list of mpidist.nn layers"):
        models.resolve(lambda shape, outputs: "oops").build((4,), 2, np, np.float32)
