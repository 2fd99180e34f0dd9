"""The `pdcluster` command (the console script): one parser over every subcommand, each defined next to
what it drives: `serve` (cluster/serve_cli.py), `generate`, `run-batch`, `drain`, `kv-events`, `update-weights` and
`pd-proxy` (here), `loadtest`
(tools/loadtest/cli.py), `profile` and `plan` (tools/planner/cli.py).

Errors in what the user typed print one line to stderr and exit with status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import sys

from pdcluster.cli.config_file import expand_config_file
from pdcluster.cli.drain import add_drain_parser
from pdcluster.cli.json_args import expand_dotted_json_args
from pdcluster.cli.kv_events import add_kv_events_parser
from pdcluster.cli.update_weights import add_update_weights_parser
from pdcluster.cli.generate import add_generate_parser
from pdcluster.cli.pd_proxy import add_pd_proxy_parser
from pdcluster.cli.run_batch import add_run_batch_parser
from pdcluster.cluster.engine_args import DEFAULT_MODEL
from pdcluster.cluster.serve_cli import add_serve_parser
from pdcluster.tools.loadtest.cli import add_loadtest_parser
from pdcluster.tools.planner.cli import add_planner_parsers


def build_parser() -> argparse.ArgumentParser:
    return _build_parsers()[0]


def _build_parsers() -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    """The command's parser and its `serve` subparser (which --config files are checked against)."""
    parser = argparse.ArgumentParser(prog="pdcluster", description="Disaggregated prefill/decode LLM serving")
    sub = parser.add_subparsers(dest="command", required=True)
    add_generate_parser(sub)
    add_run_batch_parser(sub)
    serve_parser = add_serve_parser(sub)
    add_pd_proxy_parser(sub)
    add_loadtest_parser(sub)
    add_drain_parser(sub)
    add_kv_events_parser(sub)
    add_update_weights_parser(sub)
    add_planner_parsers(sub)
    return parser, serve_parser


def main(argv: list[str] | None = None) -> int:
    parser, serve_parser = _build_parsers()
    argv = list(sys.argv[1:] if argv is None else argv)
    command = parser._subparsers._group_actions[0].choices.get(argv[0]) if argv else None
    if command is not None:
        try:
            if argv[0] == "serve":  # vLLM's --config FILE.yaml: its flags go before the typed ones, which win
                argv = ["serve", *expand_config_file(argv[1:], serve_parser, DEFAULT_MODEL)]
            # vLLM's --json-flag.key value
            argv = [argv[0], *expand_dotted_json_args(argv[1:], command)]
        except ValueError as e:
            print(f"pdcluster {argv[0]}: error: {e}", file=sys.stderr)
            return 2
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ValueError as e:  # ConfigError, the engine's InvalidRequestError, UnknownModelError: what was typed
        print(f"pdcluster {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
