"""The `pdcluster` command (the console script): one parser over every subcommand, each defined next to
what it drives: `serve` (cluster/serve_cli.py), `generate`, `run-batch`, `drain` and `pd-proxy` (here), `loadtest`
(tools/loadtest/cli.py), `profile` and `plan` (tools/planner/cli.py).

Errors in what the user typed print one line to stderr and exit with status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import sys

from pdcluster.cli.drain import add_drain_parser
from pdcluster.cli.generate import add_generate_parser
from pdcluster.cli.pd_proxy import add_pd_proxy_parser
from pdcluster.cli.run_batch import add_run_batch_parser
from pdcluster.cluster.serve_cli import add_serve_parser
from pdcluster.tools.loadtest.cli import add_loadtest_parser
from pdcluster.tools.planner.cli import add_planner_parsers


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdcluster", description="Disaggregated prefill/decode LLM serving")
    sub = parser.add_subparsers(dest="command", required=True)
    add_generate_parser(sub)
    add_run_batch_parser(sub)
    add_serve_parser(sub)
    add_pd_proxy_parser(sub)
    add_loadtest_parser(sub)
    add_drain_parser(sub)
    add_planner_parsers(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ValueError as e:  # ConfigError, the engine's InvalidRequestError, UnknownModelError: what was typed
        print(f"pdcluster {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
