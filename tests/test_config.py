"""Configuration: defaults, TOML files, precedence, validation messages."""

import argparse

import pytest

from mpidist.config import Settings, add_flags, settings_from_args
from mpidist.errors import UsageError


def parse(argv):
    parser = argparse.ArgumentParser()
    add_flags(parser)
    return settings_from_args(parser.parse_args(argv))


def test_defaults_are_valid_and_auto_strategy_follows_the_rank_count():
    config = parse([])
    config.validate(4)
    assert config.with_world(1).strategy == "local"
    assert config.with_world(4).strategy == "allreduce"
    assert parse(["--strategy", "allreduce"]).with_world(1).strategy == "allreduce"


def test_toml_keys_are_flag_names_and_the_command_line_wins(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('model = "cnn"\nbatch-size = 32\nlr = 1\n')
    config = parse(["--config", str(path), "--batch-size", "16"])
    assert (config.model, config.batch_size, config.lr) == ("cnn", 16, 1.0)


@pytest.mark.parametrize("text,message", [('batch_sise = 3', "unknown setting 'batch_sise'"),
                                          ('epochs = "ten"', "epochs = 'ten' should be an int"),
                                          ('epochs = true', "should be an int"),
                                          ('epochs = ', "not readable as TOML")])
def test_bad_config_files_are_named(tmp_path, text, message):
    path = tmp_path / "bad.toml"
    path.write_text(text + "\n")
    with pytest.raises(UsageError, match=message):
        parse(["--config", str(path)])


def test_a_switch_takes_no_value_on_the_command_line_and_a_boolean_in_toml(tmp_path):
    assert parse([]).elastic is False and parse(["--elastic"]).elastic is True
    path = tmp_path / "run.toml"
    path.write_text("elastic = true\n")
    assert parse(["--config", str(path)]).elastic is True
    assert parse(["--config", str(path), "--no-elastic"]).elastic is False      # the command line wins
    path.write_text('elastic = "yes"\n')
    with pytest.raises(UsageError, match="elastic = 'yes' should be a bool"):
        parse(["--config", str(path)])


def test_missing_config_file():
    with pytest.raises(UsageError, match="no such file"):
        parse(["--config", "/nonexistent.toml"])


@pytest.mark.parametrize("flags,ranks,message", [
    (["--strategy", "gossip"], 1, "--strategy 'gossip' is not one of"),
    (["--optimizer", "lbfgs"], 1, "--optimizer 'lbfgs' is not one of"),
    (["--epochs", "0"], 1, "--epochs must be at least 1, got 0"),
    (["--batch-size", "0"], 1, "--batch-size must be at least 1"),
    (["--lr", "-1"], 1, "--lr must be positive"),
    (["--steps", "-2"], 1, "--steps must be 0 or more"),
    (["--strategy", "local"], 2, "--strategy local runs on one rank, got 2 ranks"),
    (["--resume", "auto"], 1, "--resume auto needs --checkpoint-dir"),
    (["--checkpoint-seconds", "-5"], 1, "--checkpoint-seconds must be 0 or more, got -5.0"),
    (["--nan-patience", "-1"], 1, "--nan-patience must be 0 or more, got -1"),
    (["--stall-timeout", "-1"], 1, "--stall-timeout must be 0 or more, got -1.0"),
    (["--elastic", "--strategy", "pipeline", "--stages", "2"], 4, "not with pipelines"),
    (["--elastic", "--strategy", "ps-sync", "--ps", "1", "--aggregate", "2"], 4, "backup workers"),
    (["--elastic", "--replication", "in-graph"], 2, "--replication in-graph"),
])
def test_invalid_settings_are_refused_with_their_values(flags, ranks, message):
    with pytest.raises(UsageError, match=message):
        parse(flags).validate(ranks)


def test_every_flag_has_help_and_a_default():
    import dataclasses
    for field in dataclasses.fields(Settings):
        assert field.metadata["help"] and field.default is not dataclasses.MISSING
