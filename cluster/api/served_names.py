"""The names the base model is served under: vLLM's ``--served-model-name NAME [NAME ...]``.

A request's ``model`` may be any of them, and GET /v1/models lists each; answers and the metrics' ``model_name``
label give the first (vLLM's ``model_name()``), whichever one the request named. ``args.served_model_name`` stays
that first name (a string), so code that names the model once reads it as before; the others are
``args.served_model_aliases``.

Imports only the standard library (the CLI parsers import it before any server starts).
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable, Sequence


class _ServedNames(argparse.Action):
    """``--served-model-name A B C``: ``served_model_name`` = "A", ``served_model_aliases`` = ("B", "C")."""

    def __call__(self, parser, namespace, values, option_string=None):
        namespace.served_model_name, namespace.served_model_aliases = values[0], tuple(values[1:])


def add_served_model_name_arg(parser, help: str) -> None:
    """``--served-model-name NAME [NAME ...]`` on ``parser`` (a parser or an argument group)."""
    parser.add_argument("--served-model-name", nargs="+", action=_ServedNames, default=None, metavar="NAME",
                        help=help)
    parser.set_defaults(served_model_aliases=())  # a group's defaults are its parser's


def check_served_names(names: Sequence[str], lora_names: Iterable[str] = ()) -> tuple[str, ...]:
    """``names`` as a tuple; ValueError naming --served-model-name for an empty name, one given twice, or one that is
    also a LoRA adapter's name (a request naming it could mean either)."""
    if isinstance(names, str):
        raise TypeError(f"served names: want a sequence of names, got the string {names!r}")
    names = tuple(names)
    if not names:
        raise ValueError("--served-model-name: give at least one name")
    for name in names:
        if not name or not name.strip():
            raise ValueError(f"--served-model-name: the names must not be empty, got {list(names)!r}")
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ValueError(f"--served-model-name: {repeated[0]!r} is given twice; give each name once")
    clash = sorted(set(names) & set(lora_names))
    if clash:
        raise ValueError(f"--served-model-name: {clash[0]!r} is also a LoRA adapter's name (--lora-modules); a "
                         "request naming it would be ambiguous: rename one of them")
    return names


def answered_name(model: str | None, served_names: tuple[str, ...]) -> str:
    """The ``model`` a response gives to a request that named ``model`` (already checked by check_model): the
    adapter's own name for a LoRA adapter, else the first served name, whichever alias was named (vLLM's
    model_name())."""
    return served_names[0] if model is None or model in served_names else model
