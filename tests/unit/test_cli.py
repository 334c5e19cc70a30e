"""ashl.cli: the options, parsing and checks ``ashl.train`` and ``ashl.bench e2e`` share
(pure functions, in process)."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ashl import cli
from ashl.emulation import DEFAULT_LINK, Link
from ashl.strategies import CHECKPOINTING, STRATEGIES

factors = st.floats(min_value=1.0, max_value=1e12, allow_nan=False, allow_infinity=False)
below_one = st.one_of(st.floats(max_value=1.0, exclude_max=True, allow_nan=False),
                      st.just(float("nan")), st.just(float("inf")))


# ---------------------------------------------------------------- slowdown factors
@given(st.lists(factors, min_size=1, max_size=16))
def test_factors_round_trip_exactly_through_their_text(values):
    text = cli.format_factors(values)
    assert cli.parse_factors("--compute-slowdown", text) == values
    assert " " not in text and len(text.split(",")) == len(values)


def test_factors_are_short_where_they_can_be():
    assert cli.format_factors([1.0, 1.0, 2.0, 4.0]) == "1,1,2,4"
    assert cli.format_factors([1.5, 3.25]) == "1.5,3.25"
    assert cli.parse_factors("--x", " 1, 2 ,4") == [1.0, 2.0, 4.0]
    assert cli.parse_factors("--x", None) == []


@given(st.lists(factors, max_size=5), below_one, st.lists(factors, max_size=5))
def test_a_factor_below_one_or_not_finite_is_named(before, bad, after):
    text = ",".join(map(repr, [*before, bad, *after]))
    with pytest.raises(cli.OptionError) as e:
        cli.parse_factors("--link-slowdown", text)
    message = str(e.value)
    assert message.startswith(f"--link-slowdown {text!r}: ") and "finite factor >= 1" in message
    assert "\n" not in message


@pytest.mark.parametrize("text,item", [("1,x,2", "x"), ("1,,2", ""), ("2,", ""), ("1;2", "1;2")])
def test_a_malformed_item_is_named(text, item):
    with pytest.raises(cli.OptionError) as e:
        cli.parse_factors("--compute-slowdown", text)
    assert str(e.value).startswith(f"--compute-slowdown {text!r}: {item!r} is not a number")
    assert "e.g. 1,1,2,4" in str(e.value)


@given(st.lists(factors, max_size=8), st.integers(min_value=1, max_value=8))
def test_a_list_may_be_shorter_than_the_run_never_longer(values, ranks):
    text = cli.format_factors(values)
    if len(values) <= ranks:
        cli.check_factor_count("--compute-slowdown", text, values, ranks)
        return
    with pytest.raises(cli.OptionError) as e:
        cli.check_factor_count("--compute-slowdown", text, values, ranks)
    assert str(e.value) == (f"--compute-slowdown {text!r} lists {len(values)} factors but the "
                            f"run has {ranks} rank{'s' if ranks != 1 else ''}")


# ---------------------------------------------------------------- the link
@given(st.floats(min_value=0, max_value=10), st.floats(min_value=1, max_value=1e12))
def test_a_link_parses_from_its_two_numbers(latency, bandwidth):
    assert cli.parse_link(f"{latency!r},{bandwidth!r}") == Link(latency, bandwidth)


def test_no_link_is_the_default_one():
    assert cli.parse_link(None) == DEFAULT_LINK


@pytest.mark.parametrize("text,needle", [("0.001", "LATENCY_S,BYTES_PER_S"),
                                         ("1,2,3", "LATENCY_S,BYTES_PER_S"),
                                         ("a,b", "LATENCY_S,BYTES_PER_S"),
                                         ("0.001,0", "bandwidth"), ("-1,1e6", "latency"),
                                         ("nan,1e6", "latency")])
def test_a_bad_link_is_named(text, needle):
    with pytest.raises(cli.OptionError) as e:
        cli.parse_link(text)
    assert str(e.value).startswith(f"--link-base {text!r}: ") and needle in str(e.value)


# ---------------------------------------------------------------- strategies, dataset
def test_strategies():
    assert cli.check_strategy("ashl") == "ashl"
    with pytest.raises(cli.OptionError, match=r"^--strategy 'sgd': unknown strategy \(known: ashl"):
        cli.check_strategy("sgd")
    assert cli.parse_strategies(None, ["bsp"]) == ["bsp"]
    assert cli.parse_strategies(" ashl, bsp ,", []) == ["ashl", "bsp"]
    for text, needle in ((",", "no strategy named"), ("ashl,nope", "unknown 'nope'"),
                         ("bsp,bsp", "named twice")):
        with pytest.raises(cli.OptionError, match=f"^--strategies {text!r}: .*{needle}"):
            cli.parse_strategies(text, [])


@given(st.lists(st.sampled_from(STRATEGIES), min_size=1, unique=True))
def test_any_list_of_known_strategies_parses_in_order(names):
    assert cli.parse_strategies(",".join(names), []) == names


def test_dataset_specs(tmp_path):
    assert cli.check_dataset_spec("digits") == (1, 8, 8)
    assert cli.check_dataset_spec("Synthetic:200") == (1, 8, 8)
    assert cli.check_dataset_spec(f"cifar10:{tmp_path}") == (3, 32, 32)
    assert cli.check_dataset_spec("cifar10:/no/such/dir", must_exist=False) == (3, 32, 32)
    assert cli.check_dataset_spec("mnist") == (1, 28, 28)
    for spec, needle in (("emnist", "unknown dataset"), ("digits:1", "no argument"),
                         ("mnist:x", "no argument"),
                         ("synthetic:x", "integer"), ("synthetic:19", "N >= 20"),
                         ("cifar10", "cifar10:DIR"), ("cifar10:/no/such/dir", "does not exist")):
        with pytest.raises(cli.OptionError) as e:
            cli.check_dataset_spec(spec)
        assert str(e.value).startswith(f"--dataset {spec!r}: ") and needle in str(e.value)


# ---------------------------------------------------------------- the shared options
def parser(**defaults):
    p = cli.OneLineParser(prog="prog")
    cli.add_run_options(p, **{"max_seconds": 60.0, "target_accuracy": None, **defaults})
    return p


def test_each_cli_keeps_its_own_defaults():
    a = parser(max_seconds=120.0, target_accuracy=None).parse_args([])
    b = parser(max_seconds=60.0, target_accuracy=0.93).parse_args([])
    assert (a.max_seconds, a.target_accuracy) == (120.0, None)
    assert (b.max_seconds, b.target_accuracy) == (60.0, 0.93)
    for args in (a, b):
        assert (args.model, args.dataset, args.seed, args.batch_size, args.lr) == \
            ("mlp", "digits", 0, 32, 0.05)
        assert args.compute_slowdown is args.link_slowdown is args.link_base is None
        assert args.eval_every is None and args.step_time is None
    assert cli.check_run_options(a) == (1, 8, 8)
    c = parser(model="mnistnet", dataset="mnist", step_time=0.08).parse_args([])
    assert (c.model, c.dataset, c.step_time) == ("mnistnet", "mnist", 0.08)
    assert cli.check_run_options(c) == (1, 28, 28)


@pytest.mark.parametrize("argv,needle", [
    (["--max-seconds", "0"], "--max-seconds 0: "), (["--max-seconds", "nan"], "--max-seconds nan"),
    (["--target-accuracy", "93"], "--target-accuracy 93: must be in (0, 1]"),
    (["--target-accuracy", "0"], "--target-accuracy 0"),
    (["--batch-size", "0"], "--batch-size 0"), (["--lr", "-1"], "--lr -1"),
    (["--lr", "inf"], "--lr inf"), (["--seed", "-1"], "--seed -1"),
    (["--eval-every", "-1"], "--eval-every -1"), (["--dataset", "emnist"], "--dataset 'emnist'"),
    (["--step-time", "-0.1"], "--step-time -0.1: "), (["--step-time", "inf"], "--step-time inf"),
])
def test_bad_shared_values_are_named(argv, needle):
    with pytest.raises(cli.OptionError) as e:
        cli.check_run_options(parser().parse_args(argv))
    assert str(e.value).startswith(needle), str(e.value)


def test_one_line_errors(capsys):
    p = parser()
    with pytest.raises(SystemExit) as e:
        p.parse_args(["--lr", "fast"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err == "prog: error: argument --lr: invalid float value: 'fast' (see --help)\n"
    with pytest.raises(SystemExit) as e, p.checking():
        raise cli.OptionError("--x 1: first line\nsecond line")
    assert e.value.code == 2
    assert capsys.readouterr().err == "prog: error: --x 1: first line (see --help)\n"
    assert cli.error_line("a b", "m\nn") == "a b: error: m"


def test_subcommand_parsers_are_one_line_too(capsys):
    p = cli.OneLineParser(prog="top")
    sub = p.add_subparsers(dest="command", required=True)
    cli.add_run_options(sub.add_parser("run"), max_seconds=1.0, target_accuracy=None)
    with pytest.raises(SystemExit):
        p.parse_args(["run", "--seed", "x"])
    assert capsys.readouterr().err.startswith("top run: error: argument --seed: ")


def test_help_names_every_shared_option():
    text = parser(factors_default="DEFAULT-TEXT", link_base_note="; NOTE").format_help()
    for option in ("--model", "--dataset", "--compute-slowdown", "--link-slowdown", "--link-base",
                   "--target-accuracy", "--max-seconds", "--seed", "--batch-size", "--lr",
                   "--eval-every", "--step-time"):
        assert option in text
    assert text.count("DEFAULT-TEXT") == 2 and "; NOTE" in text


# ---------------------------------------------------------------- checkpoints (ashl.train)
def ckpt_args(*argv, strategy="ashl"):
    p = cli.OneLineParser(prog="prog")
    p.add_argument("--strategy", default=strategy)
    cli.add_checkpoint_options(p)
    return p.parse_args(list(map(str, argv)))


def test_checkpoints_are_off_unless_a_directory_is_given():
    args = ckpt_args()
    cli.check_checkpoint_options(args)
    assert (args.checkpoint_dir, args.checkpoint_every, args.resume) == (None, None, False)


def test_a_checkpoint_directory_gets_the_default_interval(tmp_path):
    args = ckpt_args("--checkpoint-dir", tmp_path / "new")     # created later, by the run
    cli.check_checkpoint_options(args)
    assert args.checkpoint_every == cli.CHECKPOINT_EVERY > 0
    assert cli.checkpoint_path(str(tmp_path)) == str(tmp_path / cli.CHECKPOINT_FILE)


@pytest.mark.parametrize("every", ["0", "-1", "nan", "inf"])
def test_the_interval_must_be_positive_seconds(tmp_path, every):
    with pytest.raises(cli.OptionError, match=rf"^--checkpoint-every {every}: .*> 0"):
        cli.check_checkpoint_options(ckpt_args("--checkpoint-dir", tmp_path,
                                               "--checkpoint-every", every))


@pytest.mark.parametrize("argv,option", [(["--resume"], "--resume"),
                                         (["--checkpoint-every", "5"], "--checkpoint-every")])
def test_resume_and_interval_need_a_directory(argv, option):
    with pytest.raises(cli.OptionError, match=f"^{option}: needs --checkpoint-dir"):
        cli.check_checkpoint_options(ckpt_args(*argv))


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_only_strategies_that_checkpoint_take_a_directory(tmp_path, strategy):
    args = ckpt_args("--checkpoint-dir", tmp_path, strategy=strategy)
    if strategy in CHECKPOINTING:
        cli.check_checkpoint_options(args)
        return
    with pytest.raises(cli.OptionError, match=f"^--strategy '{strategy}' does not checkpoint"):
        cli.check_checkpoint_options(args)


def test_the_checkpointing_list_is_the_strategies_that_implement_it():
    from ashl.strategies import strategy_class
    from ashl.strategies.base import Strategy
    assert set(CHECKPOINTING) == {
        name for name in STRATEGIES
        if strategy_class(name).save_checkpoint is not Strategy.save_checkpoint
        and strategy_class(name).load_checkpoint is not Strategy.load_checkpoint}


def test_the_directory_must_be_one(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(cli.OptionError, match=f"^--checkpoint-dir '{f}': exists and is not"):
        cli.check_checkpoint_options(ckpt_args("--checkpoint-dir", f))


def test_resume_needs_a_checkpoint_in_the_directory(tmp_path):
    for directory, why in ((tmp_path, "holds no checkpoint"), (tmp_path / "no", "does not exist")):
        with pytest.raises(cli.OptionError) as e:
            cli.check_checkpoint_options(ckpt_args("--checkpoint-dir", directory, "--resume"))
        assert str(e.value).startswith(f"--resume: --checkpoint-dir '{directory}' {why}")
    (tmp_path / cli.CHECKPOINT_FILE).write_bytes(b"")   # its contents: the strategy's check
    cli.check_checkpoint_options(ckpt_args("--checkpoint-dir", tmp_path, "--resume"))


def test_the_step_time_option_wins_over_the_environment(monkeypatch):
    from argparse import Namespace

    from ashl.train import default_eval_every, step_time
    monkeypatch.setenv("ASHL_EMULATE_STEP_TIME", "0.5")
    assert step_time(Namespace(step_time=None)) == 0.5
    assert step_time(Namespace(step_time=0.02)) == 0.02
    assert step_time(Namespace(step_time=0.0)) is None     # 0: real speed, whatever the env
    monkeypatch.delenv("ASHL_EMULATE_STEP_TIME")
    assert step_time(Namespace(step_time=None)) is None
    assert [default_eval_every(d) for d in ("digits", "MNIST", "cifar10:/x")] == [0.25, 1.0, 10.0]


# ------------------------------------------------------------------------- --overlap
def test_overlap_is_the_strategys_default_unless_given():
    assert parser().parse_args([]).overlap is None      # on for ashl, off for the others
    assert parser().parse_args(["--overlap"]).overlap is True
    assert parser().parse_args(["--overlap", "--no-overlap"]).overlap is False
    assert "--overlap" in parser().format_help() and "--no-overlap" in parser().format_help()


@pytest.mark.parametrize("strategy", ["ashl", "ssp", "asp", "adsp", "async-localsgd"])
def test_overlap_is_for_the_parameter_server_strategies(strategy):
    cli.check_overlap(strategy)


@pytest.mark.parametrize("strategy", ["bsp", "ashl-sync", "localsgd", "diloco"])
def test_overlap_of_a_synchronous_strategy_is_named(strategy):
    with pytest.raises(cli.OptionError, match=f"--overlap: strategy {strategy} "):
        cli.check_overlap(strategy)


def test_the_benchmark_passes_overlap_only_to_the_strategies_that_take_it():
    from ashl.bench import e2e
    p = cli.OneLineParser(prog="e2e")
    e2e.add_arguments(p)
    args = p.parse_args(["--overlap"])
    for strategy, expected in (("ashl", True), ("asp", True), ("bsp", False),
                               ("localsgd", False), ("ashl+nesterov(0.7, 0.5)", True)):
        cmd = e2e.train_command(args, strategy, "run", [1.0] * 4, [1.0] * 4)
        assert ("--overlap" in cmd) is expected, (strategy, cmd)
    args = p.parse_args(["--no-overlap"])
    assert "--overlap" not in e2e.train_command(args, "ashl", "run", [1.0] * 4, [1.0] * 4)
