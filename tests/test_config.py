"""Configuration: defaults, TOML files, precedence, validation messages."""

import argparse
import dataclasses
import os

import pytest

from mpidist.parallel import STRATEGIES
from mpidist.parallel.registry import Option
from mpidist.runtime.errors import UsageError
from mpidist.settings.config import FIELDS, Settings, _make_settings
from mpidist.settings.sources import add_flags, settings_from, settings_from_args
from mpidist.settings.validation import INT_LIMIT


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


@pytest.mark.parametrize(
    "text,message",
    [
        ("batch_sise = 3", "unknown setting 'batch_sise'"),
        ('epochs = "ten"', "epochs = 'ten' should be an int"),
        ("epochs = true", "should be an int"),
        ("epochs = ", "not readable as TOML"),
    ],
)
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
    assert parse(["--config", str(path), "--no-elastic"]).elastic is False  # the command line wins
    path.write_text('elastic = "yes"\n')
    with pytest.raises(UsageError, match="elastic = 'yes' should be a bool"):
        parse(["--config", str(path)])


def test_missing_config_file():
    with pytest.raises(UsageError, match="no such file"):
        parse(["--config", "/nonexistent.toml"])


@pytest.mark.parametrize(
    "flags,ranks,message",
    [
        (["--strategy", "gossip"], 1, "--strategy 'gossip' is not one of"),
        (["--optimizer", "lbfgs"], 1, "--optimizer 'lbfgs' is not one of"),
        (["--epochs", "0"], 1, "--epochs must be at least 1, got 0"),
        (["--batch-size", "0"], 1, "--batch-size must be at least 1"),
        (["--lr", "-1"], 1, r"--lr must be a finite positive number, got -1\.0"),
        (["--steps", "-2"], 1, "--steps must be 0 or more"),
        (["--strategy", "local"], 2, "--strategy local runs on one rank, got 2 ranks"),
        (
            ["--resume", "auto", "--run-dir", ""],
            1,
            r"--resume auto needs --checkpoint-dir \(or a --run-dir\)",
        ),
        (
            ["--checkpoint-seconds", "-5"],
            1,
            "--checkpoint-seconds must be a finite number of seconds, 0 or more, got -5.0",
        ),
        (["--nan-patience", "-1"], 1, "--nan-patience must be 0 or more, got -1"),
        (
            ["--stall-timeout", "-1"],
            1,
            "--stall-timeout must be a finite number of seconds, 0 or more, got -1.0",
        ),
        (
            ["--elastic", "--strategy", "pipeline", "--stages", "2"],
            2,
            "make 1 replica: a lost stage would end the run; run 4 ranks or more",
        ),
        (["--elastic", "--strategy", "ps-sync", "--ps", "1", "--aggregate", "2"], 4, "backup workers"),
        (["--elastic", "--replication", "in-graph"], 2, "--replication in-graph"),
        (
            ["--tensor", "2", "--strategy", "ps-sync", "--ps", "1"],
            4,
            "applies to --strategy allreduce and pipeline only, not ps-sync: the parts of a tensor group",
        ),
        (["--tensor", "2", "--strategy", "local-sgd"], 4, "local-sgd's workers step apart"),
        (["--tensor", "2"], 3, r"--tensor 2 does not divide the 3 ranks"),
        (
            ["--tensor", "2", "--strategy", "pipeline", "--stages", "2"],
            6,
            r"--stages 2 x --tensor 2 does not divide the 6",
        ),
        (["--tensor", "0"], 2, "--tensor must be at least 1, got 0"),
        (["--tensor", "2", "--elastic"], 4, "--tensor 2 does not combine with --elastic"),
        (["--tensor", "2", "--shard", "optimizer"], 4, "--tensor 2 does not combine with --shard optimizer"),
        (["--elastic", "--exchange", "shared-memory"], 2, "shared-memory does not survive a lost worker"),
        (["--exchange", "shared-memory", "--compress", "fp16"], 2, "nothing for --compress fp16 to compress"),
        (
            ["--strategy", "ps-sync", "--ps", "1", "--exchange", "mpi"],
            3,
            "--exchange mpi applies to --strategy allreduce",
        ),
    ],
)
def test_invalid_settings_are_refused_with_their_values(flags, ranks, message):
    with pytest.raises(UsageError, match=message):
        parse(flags).validate(ranks)


def test_every_flag_has_help_and_a_default():
    import dataclasses

    for field in dataclasses.fields(Settings):
        assert field.metadata["help"] and field.default is not dataclasses.MISSING


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--lr", "inf"], r"^--lr must be a finite positive number, got inf$"),
        (["--lr", "nan"], r"^--lr must be a finite positive number, got nan$"),
        (["--lr", "0"], r"^--lr must be a finite positive number, got 0\.0$"),
        (["--momentum", "nan"], r"^--momentum must be a finite number in \[0, 1\), got nan$"),
        (["--momentum", "1"], r"^--momentum must be a finite number in \[0, 1\), got 1\.0$"),
        (["--momentum", "-0.1"], r"^--momentum must be a finite number in \[0, 1\), got -0\.1$"),
        (
            ["--stall-timeout", "nan"],
            r"^--stall-timeout must be a finite number of seconds, 0 or more, got nan; use 0 ",
        ),
        (["--stall-timeout", "inf"], r"^--stall-timeout must be .*, got inf; use 0 for no limit$"),
        (
            ["--checkpoint-seconds", "nan"],
            r"^--checkpoint-seconds must be a finite number .*, got nan \(0 = no ",
        ),
        (["--checkpoint-seconds", "inf"], r"^--checkpoint-seconds must be a finite number .*, got inf"),
        (["--bucket-mb", "inf"], r"^--bucket-mb must be a finite positive number of MiB, .*, got inf$"),
        (["--bucket-mb", "nan"], r"^--bucket-mb must be a finite positive number of MiB, .*, got nan$"),
        (["--bucket-mb", "1e30"], r"^--bucket-mb must be .* at most 4398046511104, got 1e\+30$"),
        (
            ["--seed", "-1"],
            r"^--seed must be 0 or more, got -1 \(numpy's random generators take no negative seeds\)$",
        ),
        (["--ps", "-1"], r"^--ps must be 0 or more, got -1$"),
        (["--eval-every", "-1"], r"^--eval-every must be 0 or more, got -1$"),
        (["--keep", "-1"], r"^--keep must be 0 or more, got -1$"),
    ],
)
def test_non_finite_and_out_of_range_numbers_are_refused(flags, message):
    with pytest.raises(UsageError, match=message):
        parse(flags).validate(1)


@pytest.mark.parametrize(
    "name",
    [
        "steps",
        "epochs",
        "batch_size",
        "seed",
        "log_every",
        "eval_every",
        "checkpoint_every",
        "keep",
        "nan_patience",
    ],
)
def test_int_settings_too_large_for_int64_are_refused(name):
    flag = "--" + name.replace("_", "-")
    parse([flag, str(INT_LIMIT)]).validate(1)  # the limit itself is allowed
    for value in (INT_LIMIT + 1, 2**63, 10**30):
        with pytest.raises(UsageError, match=rf"^{flag} must be at most {INT_LIMIT}, got {value}$"):
            parse([flag, str(value)]).validate(1)


def test_every_float_field_is_checked_for_finiteness_the_strategies_own_included(monkeypatch):
    """A float option a strategy declares gets the finiteness rule without naming it anywhere."""
    floats = [f for f in dataclasses.fields(Settings) if f.type is float]
    assert {"lr", "momentum", "stall_timeout", "checkpoint_seconds", "bucket_mb"} <= {f.name for f in floats}
    for field in floats:
        for value in (float("nan"), float("inf"), float("-inf")):
            with pytest.raises(
                UsageError, match=rf"^--{field.name.replace('_', '-')} must be .*, got {value}"
            ):
                dataclasses.replace(Settings(), **{field.name: value}).validate(1)

    class Declaring(STRATEGIES["allreduce"]):
        name = "declaring"
        options = (Option("ratio", 0.5, "a float only this strategy reads"), Option("count", 3, "an int"))

    monkeypatch.setitem(STRATEGIES, "declaring", Declaring)
    extended = _make_settings()
    with pytest.raises(UsageError, match=r"^--ratio must be a finite number, got nan$"):
        extended(strategy="declaring", ratio=float("nan")).validate(1)
    with pytest.raises(UsageError, match=rf"^--count must be at most {INT_LIMIT}, got {2**63}$"):
        extended(strategy="declaring", count=2**63).validate(1)
    extended(strategy="declaring", ratio=-1e300, count=-5).validate(1)  # no range beyond that: the strategy's


@pytest.mark.parametrize("name", [name for name, f in FIELDS.items() if f.type is int])
def test_every_int_field_is_bounded_by_int64(name):
    """Strategies' options (stages, micro_batches, staleness, ...) included: none may overflow an int64."""
    with pytest.raises(
        UsageError, match=rf"^--{name.replace('_', '-')} must be at most {INT_LIMIT}, got {2**64}$"
    ):
        dataclasses.replace(Settings(), **{name: 2**64}).validate(8)


@pytest.mark.parametrize(
    "overrides,message",
    [
        ({"lr": float("nan")}, r"^--lr must be a finite positive number, got nan$"),
        ({"momentum": float("inf")}, r"^--momentum must be a finite number in \[0, 1\), got inf$"),
        ({"seed": -3}, r"^--seed must be 0 or more, got -3"),
        ({"steps": 2**80}, rf"^--steps must be at most {INT_LIMIT}, got {2**80}$"),
        ({"lr": 10**400}, r"^mpidist\.train\(\): lr = 1000.* is too large for a float$"),
    ],
)
def test_keyword_arguments_pass_the_same_checks(overrides, message):
    with pytest.raises(UsageError, match=message):
        settings_from(None, **overrides).validate(1)


def test_a_settings_object_with_a_non_number_is_refused_not_a_type_error():
    with pytest.raises(UsageError, match=r"^--lr must be a float, got '0\.1'$"):
        Settings(lr="0.1").validate(1)


@pytest.mark.parametrize(
    "text,message",
    [
        ("lr = nan", r"--lr must be a finite positive number, got nan$"),
        ("lr = inf", r"--lr must be a finite positive number, got inf$"),
        ("momentum = -inf", r"--momentum must be a finite number in \[0, 1\), got -inf$"),
        ("stall-timeout = +inf", r"--stall-timeout must be .*, got inf; use 0 for no limit$"),
        ("bucket-mb = nan", r"--bucket-mb must be a finite positive number of MiB, .*, got nan$"),
        ("seed = -1", r"--seed must be 0 or more, got -1"),
        ("steps = 9223372036854775807", rf"--steps must be at most {INT_LIMIT}, got 9223372036854775807$"),
    ],
)
def test_toml_values_pass_the_same_checks(tmp_path, text, message):
    path = tmp_path / "run.toml"
    path.write_text(text + "\n")
    with pytest.raises(UsageError, match=message):
        parse(["--config", str(path)]).validate(1)


def test_a_toml_integer_too_large_for_a_float_field_is_named(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text("lr = " + "9" * 400 + "\n")
    with pytest.raises(UsageError, match=rf"^--config {path}: lr = 9+ is too large for a float$"):
        parse(["--config", str(path)])


def test_a_utf8_config_with_a_byte_order_mark_is_read(tmp_path):
    path = tmp_path / "run.toml"
    path.write_bytes(b"\xef\xbb\xbfepochs = 2\n")
    assert parse(["--config", str(path)]).epochs == 2


@pytest.mark.parametrize(
    "data", [b"\xff\xfe lr = 1\n", "lr = 1 # caf\u00e9\n".encode("latin-1"), "lr = 1\n".encode("utf-16")]
)
def test_a_config_file_that_is_not_utf8_is_named(tmp_path, data):
    path = tmp_path / "run.toml"
    path.write_bytes(data)
    with pytest.raises(UsageError, match=rf"^--config {path}: not UTF-8 text \(invalid .* at offset \d+\)$"):
        parse(["--config", str(path)])


def test_a_config_path_that_is_a_directory_is_named(tmp_path):
    with pytest.raises(UsageError, match=rf"^--config {tmp_path}: a directory, not a TOML file$"):
        parse(["--config", str(tmp_path)])


def test_a_config_path_that_is_a_fifo_is_refused_without_blocking(tmp_path):
    """Opening a named pipe for reading would wait for a writer forever: it is refused before it is opened."""
    fifo = tmp_path / "run.toml"
    os.mkfifo(fifo)
    with pytest.raises(UsageError, match=rf"^--config {fifo}: a named pipe \(FIFO\), not a TOML file$"):
        parse(["--config", str(fifo)])


def test_a_config_path_under_a_regular_file_is_named(tmp_path):
    path = tmp_path / "file"
    path.write_text("epochs = 2\n")
    with pytest.raises(UsageError, match=r"a part of its path is a file, not a directory$"):
        parse(["--config", str(path / "run.toml")])


def test_a_device_or_an_oversized_config_file_is_refused(tmp_path):
    with pytest.raises(UsageError, match=r"^--config /dev/null: a character device, not a TOML file$"):
        parse(["--config", "/dev/null"])
    path = tmp_path / "big.toml"
    path.write_bytes(b"#" * (2 << 20))
    with pytest.raises(UsageError, match=r"bytes; a settings file is at most \d+$"):
        parse(["--config", str(path)])


def test_an_unreadable_config_file_is_named(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text("epochs = 2\n")
    path.chmod(0)
    try:
        if os.access(path, os.R_OK):
            pytest.skip("this user (root) reads files whatever their permissions")
        with pytest.raises(UsageError, match=rf"^--config {path}: not readable \(permission denied\)$"):
            parse(["--config", str(path)])
    finally:
        path.chmod(0o644)


def test_strategies_declare_what_the_loop_set_up_and_settings_once_named_them_for():
    """auto's choice, a mode's name in messages, how clipped steps add up: each strategy says, nobody
    branches."""
    from mpidist.parallel import STRATEGIES
    from mpidist.parallel.ps.backup import BackupWorkersStrategy

    aggregate = Settings(strategy="ps-sync", ps=1, aggregate=1)
    assert STRATEGIES["ps-sync"].variant(aggregate, 3) is BackupWorkersStrategy
    assert BackupWorkersStrategy.title(aggregate) == "ps-sync with --aggregate"
    assert STRATEGIES["ps-sync"].title(aggregate) == "ps-sync"
    assert STRATEGIES["ps-async"].clipped_steps([2, 3, 0]) == 5  # each worker clips its own pushes
    assert BackupWorkersStrategy.clipped_steps([2, 3, 0]) == 3  # the ps ranks decide together
    assert STRATEGIES["local-sgd"].clipped_steps([]) == 0
    ranks = {name: cls.auto_rank(Settings(ps=1, stages=2), 4) for name, cls in STRATEGIES.items()}
    assert ranks == {
        "local": None,
        "allreduce": 3,
        "ps-sync": 0,
        "ps-async": None,
        "pipeline": 1,
        "local-sgd": None,
    }
    assert STRATEGIES["local"].auto_rank(Settings(), 1) == 2


def test_a_pipeline_of_one_stage_on_several_ranks_is_refused_with_the_stage_counts_that_fit():
    """Issue 63, item 9: ``--strategy pipeline`` without ``--stages`` ran "1 stages x 4 replicas"."""
    from mpidist.settings.validation import check_for

    said = (
        "--strategy pipeline on 4 ranks needs --stages P, the ranks that hold one replica's layers in turn: "
        "with --stages 1 every replica runs all its layers at once and no pipeline runs (that is --strategy "
        "allreduce); give --stages 2 or 4"
    )
    with pytest.raises(UsageError) as refused:
        check_for(Settings(strategy="pipeline"), 4)
    assert str(refused.value) == said
    with pytest.raises(UsageError, match=r"\(that is --strategy allreduce --tensor 2\); give --stages 3$"):
        check_for(Settings(strategy="pipeline", tensor=2), 6)
    check_for(Settings(strategy="pipeline", stages=2), 4)
    check_for(Settings(strategy="pipeline"), 1)  # (one process: plan's calibration runs it so)


def test_a_config_nested_past_pythons_stack_is_refused_in_one_line(tmp_path):
    from mpidist.settings.config_file import read_table

    (tmp_path / "deep.toml").write_text("a = " + "[" * 5000 + "]" * 5000 + "\n")
    with pytest.raises(UsageError, match="not settings \\(nested too deep to read\\)"):
        read_table(str(tmp_path / "deep.toml"))
