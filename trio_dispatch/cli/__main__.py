"""`python -m trio_dispatch.cli`: the `trio-dispatch` command."""

from . import main

raise SystemExit(main())
