"""`python -m attncc ...`: the command line, as the `attncc` console script runs it."""
from .tools.cli import main

raise SystemExit(main())
