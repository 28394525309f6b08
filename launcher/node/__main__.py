"""`python -m launcher.node`: the per-node process (see `launcher.node.process`)."""

from launcher.node.process import main

raise SystemExit(main())
