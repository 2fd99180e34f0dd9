"""`vllm serve` command lines, run as they are: the model as a positional argument (``serve Qwen/Qwen3-0.6B``) and the
flags of vLLM's that need nothing here, accepted with one line saying why (a deployment's manifest carries them;
refusing them would fail the first start for nothing). Flags with a meaning here are real flags elsewhere
(``--enable-prefix-caching``: cluster/engine_args.py; ``--chat-template``, ``--generation-config``: serve_cli.py).
"""

from __future__ import annotations

import argparse
import sys

from pdcluster.engine.config import ConfigError

# dest -> (flag, why it changes nothing here)
NO_OP_FLAGS = {
    "trust_remote_code": ("--trust-remote-code", "no model code is downloaded or run: an architecture served here is "
                                                 "built in, any other is refused by name"),
    "disable_log_requests": ("--disable-log-requests", "requests are not logged one by one"),
    "enable_log_requests": ("--enable-log-requests", "requests are not logged one by one (the /metrics histograms "
                                                     "and each request's id in the workers' logs are)"),
    "disable_log_stats": ("--disable-log-stats", "engine statistics are served on /metrics, not logged"),
    "enable_chunked_prefill": ("--enable-chunked-prefill", "prompts are always prefilled in chunks "
                                                           "(--prefill-chunk-size)"),
    "enable_prompt_tokens_details": ("--enable-prompt-tokens-details", "usage always gives "
                                                                       "prompt_tokens_details.cached_tokens"),
}


def add_vllm_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                        help="the model, as `vllm serve MODEL` takes it (the same as --model)")
    g = parser.add_argument_group("vLLM flags accepted without effect (each says why when given)")
    for dest, (flag, why) in NO_OP_FLAGS.items():
        g.add_argument(flag, dest=dest, action="store_true", help=why)


def apply_vllm_flags(args: argparse.Namespace, default_model: str) -> None:
    """The positional model into --model (given twice, differently: a ConfigError), and a line for each no-op."""
    if args.model_tag is not None:
        if args.model not in (default_model, args.model_tag):
            raise ConfigError(f"the model is given twice, as {args.model_tag!r} and --model {args.model!r}: give it "
                              "once")
        args.model = args.model_tag
    for dest, (flag, why) in NO_OP_FLAGS.items():
        if getattr(args, dest, False):
            print(f"pdcluster serve: {flag}: accepted, no effect ({why})", file=sys.stderr, flush=True)
