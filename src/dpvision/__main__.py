"""Entry point for ``python -m dpvision``."""

from dpvision.cli import main

raise SystemExit(main())
