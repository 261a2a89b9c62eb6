"""`python -m bench.federation ARGS`: the benchmark's command line (cli.py)."""

import sys

from bench.federation.cli import main

sys.exit(main())
