"""`hyflow serve` as a user starts it: the lines it prints (URL, a generated key), loopback only unless told,
a Tinker SDK loop against the printed URL and key, and SIGTERM ends it cleanly."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

tinker = pytest.importorskip("tinker")

_BESIDE = Path(sys.executable).parent / "hyflow"
HYFLOW = str(_BESIDE) if _BESIDE.exists() else shutil.which("hyflow") or str(_BESIDE)


def test_a_non_loopback_host_needs_allow_remote(tiny_model_dir):
    result = subprocess.run([HYFLOW, "serve", "--model", str(tiny_model_dir), "--host", "0.0.0.0"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "--allow-remote" in result.stderr and "other machines" in result.stderr


def test_a_key_that_the_sdk_would_refuse_is_refused_at_start(tiny_model_dir):
    result = subprocess.run([HYFLOW, "serve", "--model", str(tiny_model_dir), "--api-key", "secret"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "must start with 'tml-'" in result.stderr


@pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")
def test_serve_prints_its_url_and_key_and_stops_on_sigterm(tiny_model_dir, tmp_path):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([HYFLOW, "serve", "--model", str(tiny_model_dir), "--name", "tiny", "--port", "0",
                             "--store", str(tmp_path / "store")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        lines = []
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and not any("TINKER_API_KEY" in line for line in lines):
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
        text = "".join(lines)
        url = re.search(r"export TINKER_BASE_URL=(\S+)", text).group(1)
        key = re.search(r"export TINKER_API_KEY=(\S+)", text).group(1)
        assert url.startswith("http://127.0.0.1:") and key.startswith("tml-hyflow-")
        assert "generated for this start" in text
        from tinker import types

        client = tinker.ServiceClient(base_url=url, api_key=key)
        tc = client.create_lora_training_client(base_model="tiny", rank=2, seed=0).result()
        datum = types.Datum(model_input=types.ModelInput.from_ints([5, 6, 7]),
                            loss_fn_inputs={"target_tokens": [6, 7, 8], "weights": [1.0, 1.0, 1.0]})
        assert tc.forward_backward([datum], "cross_entropy").result().metrics["loss:sum"] > 0
        assert tc.save_state("cli").result().path.endswith("/weights/cli")
        assert list((tmp_path / "store" / "runs").glob("*/weights/cli/adapter.safetensors"))
        client.close("success").result(timeout=60)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            _, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    assert proc.returncode == 143, err
    assert "stopping after" in err


def test_python_dash_m_hyflow_is_the_command():
    result = subprocess.run([sys.executable, "-m", "hyflow", "serve", "--help"], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0 and "--allow-remote" in result.stdout and "tinker" in result.stdout
