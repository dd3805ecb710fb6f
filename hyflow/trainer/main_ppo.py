"""`python -m hyflow.trainer.main_ppo KEY=VALUE ...`: verl's habit (`python3 -m verl.trainer.main_ppo ...`) for
`hyflow train`. It takes the same arguments: verl's overrides (`+key=value` and `~key` included), Hydra's
`--config-path` / `--config-name`, and `--help`. A verl command line ports by changing `verl` to `hyflow` here.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    """Run `hyflow train` with `argv` (default: the command line's arguments); returns its exit status."""
    from hyflow.cli import main as cli_main

    return cli_main(["train", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
