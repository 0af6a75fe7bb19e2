"""``kvcmas bench NAME``: every narrower benchmark is a subcommand, and ``kvcmas bench`` alone is still
the replay of every method."""
from __future__ import annotations

import pytest

from kvcmas_agents.bench import cli as bench_cli
from kvcmas_agents.cli import build_parser, main


def test_kvcmas_bench_alone_is_still_the_replay_with_its_options():
    args = build_parser().parse_args(["bench", "--preset", "tiny", "--methods", "none", "prefix", "--sweep-ranks"])
    assert args.bench_name is None and args.run is bench_cli.run
    assert (args.preset, args.methods, args.sweep_ranks) == ("tiny", ["none", "prefix"], [])


@pytest.mark.parametrize("name", sorted(bench_cli.SUBCOMMANDS))
def test_each_subcommand_parses_its_options_and_runs_its_module(name, monkeypatch, capsys):
    module = bench_cli.SUBCOMMANDS[name]
    assert module.HELP and module.__doc__.startswith(f'``kvcmas bench {name}``')
    seen = []
    monkeypatch.setattr(module, "run", lambda args: seen.append(args) or 7)
    assert main(["bench", name]) == 7 and seen[0].bench_name == name
    with pytest.raises(SystemExit):
        main(["bench", name, "--help"])
    assert f"kvcmas bench {name}" in capsys.readouterr().out


def test_parts_options():
    args = build_parser().parse_args(["bench", "parts", "--preset", "quick", "--methods", "prefix", "kvcmas-copy"])
    assert (args.preset, args.trace, args.methods, args.rounds) == ("quick", "pipeline", ["prefix", "kvcmas-copy"], 1)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "parts", "--methods", "everything"])
