"""`python -m hyflow ...` = the `hyflow` command (hyflow.cli)."""

import sys

from hyflow.cli import main

sys.exit(main())
