"""The source checkout off ``sys.path`` before a third-party import that could find our folders instead.

The project's folders install as ``pdcluster.*`` and are never imported by their bare names; but a process started in
the checkout (a Ray worker whose driver ran there: Ray puts the driver's directory on its workers' path; ``python -c``)
has the checkout on ``sys.path``, where ``kernels/`` shadows the Hugging Face ``kernels`` package that transformers
>= 5.2x imports (ImportError: cannot import name 'CUDAProperties'). Installed, this file is not in a checkout and the
call changes nothing.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

_CHECKOUT = Path(__file__).resolve().parents[1]


def drop_checkout_from_sys_path() -> None:
    if not (_CHECKOUT / "pyproject.toml").is_file():
        return
    sys.path[:] = [p for p in sys.path if Path(p or os.curdir).resolve() != _CHECKOUT]
