"""Session-wide test setup.

TRITON_INTERPRET must be set before triton is first imported (FIELD_NOTES), so it is set here, at the
very top, before any test module imports a kernel. Ray and model caches are pointed at per-session
temp dirs so tests never write into the user's home.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
