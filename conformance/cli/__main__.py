"""`python -m conformance.cli`: the same as the `rosetta` command."""

import sys

from conformance.cli import main

sys.exit(main())
