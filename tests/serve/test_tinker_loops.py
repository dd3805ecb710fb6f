"""The two Tinker-SDK loops under examples/tinker (shaped like tinker-cookbook's recipes/sl_loop.py and
rl_loop.py, importing nothing of hyflow) learn through `hyflow serve`, each beside a frozen control (lr = 0,
same seeds).

Margins, measured over seeds 0-9 on this tiny model (seed 0 runs here):
- SL: the last step's loss / the first step's: 0.492-0.521 trained; the control's is exactly 1.0 (no update, no
  sampling). Bar: < 0.8.
- RL (share of even token ids; 12 iterations x 2 prompts x 8 samples): the last 4 iterations' mean reward, trained
  minus control: 0.430-0.523 (trained reaches 1.0 every seed); the control's own last-4 mean is 0.458-0.570
  (SD 0.033), so a frozen policy beats the bar of 0.3 only by a ~6-SD draw of the difference of two controls.
  ppo and cispo gave the same figures (one update per batch: the ratio is 1, inside the clip).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

tinker = pytest.importorskip("tinker")
pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "tinker"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"tinker_example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def service(tiny_model_dir, tmp_path_factory):
    from hyflow.serve import start

    _, url, keys, stop = start(str(tiny_model_dir), name="tiny", port=0,
                               store=tmp_path_factory.mktemp("serve_loops"))
    yield url, keys[0]
    stop()


def _quiet(*_):
    pass


def test_the_examples_import_nothing_of_hyflow():
    for name in ("sl_loop", "rl_loop"):
        text = (EXAMPLES / f"{name}.py").read_text()
        assert "import hyflow" not in text and "from hyflow" not in text


def test_the_sl_loop_learns_and_a_frozen_control_does_not(service):
    sl = _load("sl_loop")
    trained = sl.main(*service, "tiny", steps=20, seed=0, log=_quiet)
    control = sl.main(*service, "tiny", steps=20, lr=0.0, seed=0, log=_quiet)
    assert control[-1] == pytest.approx(control[0], rel=1e-6)
    assert trained[0] == pytest.approx(control[0], rel=1e-6)
    assert trained[-1] / trained[0] < 0.8, trained


def test_the_rl_loop_raises_the_reward_over_a_frozen_control(service):
    rl = _load("rl_loop")
    trained = rl.main(*service, "tiny", seed=0, log=_quiet)
    control = rl.main(*service, "tiny", seed=0, lr=0.0, log=_quiet)
    # same seeds, the same weights at the first iteration: the same samples, but for a rare flip where the two
    # prompts' calls were decoded in one batch in one run and apart in the other (padding moves the last bits)
    assert abs(trained[0] - control[0]) <= 0.05
    assert np.mean(trained[-4:]) - np.mean(control[-4:]) > 0.3, (trained, control)
