"""`python -m quickdraft ...` runs the same command line as the `quickdraft` script."""

from quickdraft.cli import main

raise SystemExit(main())
