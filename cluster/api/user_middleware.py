"""`serve --middleware module.Name` (vLLM's flag, given once per middleware): the operator's own ASGI middleware
around the API (request logging to their system, a tenant header, an auth scheme of their own).

Each name is imported as vLLM imports it: a class is added as ASGI middleware (``app.add_middleware(cls)``), an
``async def (request, call_next)`` as an HTTP middleware; anything else is refused. They are added last, so they
are the outermost layers, as in vLLM: they see every request before the API key is checked and every answer after
ours is made (a refusal included). The names are checked at start-up, before the model loads (one line naming the
flag), and every API process of ``--api-servers N`` imports them itself (the module must be importable there: on
``PYTHONPATH`` or installed).
"""

from __future__ import annotations

import importlib
import inspect

FLAG = "--middleware"


def load_middleware(qualname: str):
    """(``"class"`` or ``"http"``, the object) that ``qualname`` names; ValueError naming the flag otherwise."""
    module_name, _, attr = qualname.rpartition(".")
    if not module_name or not attr:
        raise ValueError(f"{FLAG} {qualname!r}: want module.Name (a class or an async function of that module)")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # ImportError, or whatever the module raised while it was imported
        raise ValueError(f"{FLAG} {qualname}: cannot import {module_name}: {type(e).__name__}: {e}") from None
    try:
        found = getattr(module, attr)
    except AttributeError:
        raise ValueError(f"{FLAG} {qualname}: module {module_name} has no {attr}") from None
    if inspect.isclass(found):
        return "class", found
    if inspect.iscoroutinefunction(found):
        return "http", found
    raise ValueError(f"{FLAG} {qualname}: a {type(found).__name__}, not a middleware: want an ASGI middleware class "
                     "or an async function (request, call_next)")


def install_user_middleware(app, qualnames: tuple[str, ...]) -> None:
    """Each of ``qualnames`` around ``app``, in the order given (the last the outermost, as Starlette stacks them)."""
    for qualname in qualnames:
        kind, found = load_middleware(qualname)
        if kind == "class":
            app.add_middleware(found)
        else:
            app.middleware("http")(found)
