"""`serve --config FILE.yaml`, as `vllm serve --config` reads it: a YAML mapping of flag names (``port: 8000``,
``max-model-len: 4096``, ``enable-prefix-caching: true``; ``_`` or ``-``) to values, spliced in before the command
line's own flags so that a flag typed there wins. ``model:`` is the model unless the command line names one.

Values become flags as vLLM makes them: true -> the switch, false -> its ``--no-`` form where the flag has one
(else left out), a list -> the flag with each item, a mapping -> its JSON (``hf-overrides: {...}``), null -> left
out. A key that is not a flag of `serve` is an error naming the file and the key, not argparse's "unrecognized
arguments" about a flag the user never typed.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from pdcluster.engine.config import ConfigError


def config_path(argv: list[str]) -> str | None:
    """The value of ``--config`` in ``argv`` (``--config F`` or ``--config=F``); None without one."""
    for i, arg in enumerate(argv):
        if arg == "--config":
            if i + 1 >= len(argv):
                raise ConfigError("--config: give a YAML file")
            return argv[i + 1]
        if arg.startswith("--config="):
            return arg.split("=", 1)[1]
    return None


def expand_config_file(argv: list[str], parser: argparse.ArgumentParser, default_model: str) -> list[str]:
    """``argv`` (a subcommand's arguments, without its name) with the flags of its ``--config`` file before them;
    ``argv`` itself without one. ConfigError for a file that cannot be read, is not a YAML mapping, or names a key
    that is not a flag."""
    path = config_path(argv)
    if path is None:
        return argv
    import yaml  # only with --config

    try:
        data = yaml.safe_load(Path(path).read_text())
    except OSError as e:
        raise ConfigError(f"--config {path}: cannot read it: {e.strerror or e}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"--config {path}: not YAML: {str(e).splitlines()[0]}") from None
    if data is None:
        return argv
    if not isinstance(data, dict):
        raise ConfigError(f"--config {path}: want a mapping of flag names to values, got a {type(data).__name__}")
    actions = parser._option_string_actions  # argparse's own table of every flag
    flags: list[str] = []
    for key, value in data.items():
        name = str(key).strip().lstrip("-").replace("_", "-")
        if name == "config":
            raise ConfigError(f"--config {path}: a config file cannot name another (config: {value})")
        if name == "model":
            if not _names_model(argv, parser, default_model) and value is not None:
                flags += ["--model", str(value)]
            continue
        flag = f"--{name}"
        action = actions.get(flag)
        if action is None:
            raise ConfigError(f"--config {path}: {key!r} is not a flag of `pdcluster serve` (see --help)")
        flags += _as_flags(flag, action, value, path)
    return flags + argv


def _names_model(argv: list[str], parser: argparse.ArgumentParser, default_model: str) -> bool:
    known, _ = parser.parse_known_args(argv)
    return known.model_tag is not None or known.model != default_model


def _as_flags(flag: str, action: argparse.Action, value, path: str) -> list[str]:
    if value is None:
        return []
    if isinstance(value, bool):
        if value:
            return [flag] if action.nargs == 0 else [flag, "true"]
        if isinstance(action, argparse.BooleanOptionalAction):
            return [f"--no-{flag[2:]}"]
        if action.nargs == 0:
            return []
        return [flag, "false"]
    if action.nargs == 0:
        raise ConfigError(f"--config {path}: {flag[2:]} is a switch: give true or false, got {value!r}")
    if isinstance(value, list):
        items = [json.dumps(v) if isinstance(v, (dict, list)) else str(v) for v in value]
        if isinstance(action, argparse._AppendAction):  # a flag given once per item (--middleware a --middleware b)
            return [token for item in items for token in (flag, item)]
        return [flag, *items]
    if isinstance(value, dict):
        return [flag, json.dumps(value)]
    return [flag, str(value)]
