"""`python -m trio_dispatch`: the `trio-dispatch` command."""

from .cli import main

raise SystemExit(main())
