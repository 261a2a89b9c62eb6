"""`python -m bench.attacks`: bench/attacks/__init__.py says what it does."""

from bench.attacks.runner import main

raise SystemExit(main())
