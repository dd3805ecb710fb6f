"""One spec per role, derived once from a validated config (the types are in `hyflow.specs`).

`hyflow config` prints these specs; the trainer hands each role its own spec and nothing else of the config.
"""

from __future__ import annotations
