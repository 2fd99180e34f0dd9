"""`python -m pdcluster.cli ...`: the `pdcluster` command (how tests and ServeProcess start it)."""

import sys

from pdcluster.cli.main import main

if __name__ == "__main__":  # imported (not run) by tests/test_runtime_dependencies.py, like every module
    sys.exit(main())
