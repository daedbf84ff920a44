"""`python -m conformance.cli`: the same as the `rosetta` command."""

import sys

from conformance.cli import console_main

sys.exit(console_main())
