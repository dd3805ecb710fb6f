"""Role specs: what each role (actor, reference, critic, reward model, rollout, SFT) is built from.

The config layer (`hyflow.config.roles`) derives one spec per role, once, from the validated config; workers and
the training engine (`TrainEngine.from_spec`) receive their spec and never see the whole config. Specs are plain
frozen dataclasses of plain values, so this module imports nothing of hyflow and every layer may import it.
"""

from __future__ import annotations
