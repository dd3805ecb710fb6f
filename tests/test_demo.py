"""The demos (`make demo`, `make demo-tools`, `make demo-openai`) end to end at a few steps: they tell their story in five stages,
export the RL-trained model as a Hugging Face directory, and the transformers lines their summary prints load it
and generate (the printed lines themselves are executed)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
TRY_IT = "try the RL-trained model with transformers"


# the demos measure their summary's accuracy on N_TEST held-out prompts here (default 100-200): the tests check
# what the demo does, not how well the tiny model answers
N_TEST = "16"


def run_demo(script: Path, out: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    proc = subprocess.run([sys.executable, str(script), "--out", str(out), *args], capture_output=True, text=True,
                          timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def printed_lines(stdout: str) -> str:
    """The indented Python lines after the summary's 'try the RL-trained model' line (they end the output)."""
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if TRY_IT in line) + 1
    code = lines[start:]
    assert code and all(line.startswith("    ") for line in code), code
    return textwrap.dedent("\n".join(code))


def check_demo_output(proc: subprocess.CompletedProcess, out: Path) -> dict:
    for stage in range(1, 6):
        assert f"== {stage}/5 " in proc.stdout
    both = proc.stdout + proc.stderr
    assert "Loading weights" not in both and "Writing model shards" not in both  # transformers' bars are off
    assert "wall time: " in proc.stdout and " min " in proc.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["model"] == str(out / "model")
    assert (out / "model" / "config.json").exists() and (out / "init_model").is_dir()
    return summary


def run_printed_lines(code: str, model_dir: Path) -> tuple[str, dict]:
    """Execute the printed lines as a user would paste them; returns what they print and their namespace."""
    assert json.dumps(str(model_dir)) in code  # the lines load this run's model
    namespace: dict = {}
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        exec(compile(code, "<printed by the demo>", "exec"), namespace)
    return printed.getvalue(), namespace


@pytest.mark.slow
def test_quickstart_exports_the_rl_model_and_its_printed_lines_load_and_generate(tmp_path):
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    out = tmp_path / "quickstart"
    proc = run_demo(EXAMPLES / "quickstart" / "run.py", out, "--sft-steps", "30", "--rl-steps", "2", "--n-test", N_TEST)
    summary = check_demo_output(proc, out)
    assert summary["sft_steps"] == 30 and summary["rl_steps"] == 2
    # a 2-step run still validates after its last step (test_freq 20) and checkpoints there (save_freq = steps)
    # the summary's accuracy is over the --n-test held-out prompts, validated before RL and after its last step
    assert len((out / "grpo" / "generations" / "val_step_2.jsonl").read_text().splitlines()) == int(N_TEST)
    assert f"(greedy decoding, {N_TEST} held-out prompts)" in proc.stdout
    assert (out / "grpo" / "global_step_2").is_dir()
    assert 0.0 <= summary["accuracy_after_rl"] <= 1.0
    # the demo's own point, plotted: the answer-line rate and the accuracy at each validation (steps 0 and 2)
    assert f"plots: {out / 'plots' / 'answer_line.png'} (answer line and accuracy)" in proc.stdout
    assert (out / "plots" / "answer_line.png").read_bytes().startswith(b"\x89PNG")

    code = printed_lines(proc.stdout)
    assert code.startswith("from transformers import AutoModelForCausalLM, AutoTokenizer\n")
    # the README shows the same lines for the default output folder
    section = (ROOT / "README.md").read_text().split("## The quickstart (`make demo`)", 1)[1].split("\n## ", 1)[0]
    readme_code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    assert code.replace(json.dumps(str(out / "model")), '"runs/quickstart/model"').strip() == readme_code.strip()
    printed, ns = run_printed_lines(code, out / "model")
    assert isinstance(ns["model"], PreTrainedModel) and isinstance(ns["tok"], PreTrainedTokenizerBase)
    assert ns["inputs"]["input_ids"].shape[0] == 1
    assert printed.endswith("\n")  # the decoded continuation (a barely trained model's text) was printed
    generated = ns["model"].generate(**ns["inputs"], max_new_tokens=4, do_sample=False)
    assert generated.shape[1] > ns["inputs"]["input_ids"].shape[1]  # it generates new tokens


@pytest.mark.slow
def test_tools_demo_exports_the_rl_model_and_its_printed_lines_run(tmp_path):
    out = tmp_path / "tools"
    proc = run_demo(EXAMPLES / "tools" / "run.py", out, "--sft-steps", "20", "--rl-steps", "1", "--n-test", N_TEST)
    summary = check_demo_output(proc, out)
    assert summary["rl_steps"] == 1 and (out / "grpo" / "global_step_1").is_dir()

    printed, ns = run_printed_lines(printed_lines(proc.stdout), out / "model")
    assert ns["tools"][0]["function"]["name"] == "calculator"
    prompt = ns["tok"].decode(ns["inputs"]["input_ids"][0])
    assert "calculator" in prompt.split("<|im_start|>user")[0]  # the tool schemas precede the question
    assert printed.endswith("\n")


@pytest.mark.slow
def test_openai_agent_demo_trains_the_client_agent_through_the_endpoint(tmp_path):
    """examples/openai_agent: the OpenAI-client agent's episodes are the samples; its score is the reward."""
    out = tmp_path / "openai"
    proc = run_demo(EXAMPLES / "openai_agent" / "run.py", out, "--sft-steps", "20", "--rl-steps", "1", "--n-test",
                    N_TEST)
    for stage in range(1, 6):
        assert f"== {stage}/5 " in proc.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["rl_steps"] == 1 and summary["sft_steps"] == 20 and (out / "model" / "config.json").exists()
    assert 0.0 <= summary["accuracy_after_rl"] <= 1.0
    assert summary["requests_per_episode_after_sft"] >= 1.0  # every episode asked the policy at least once
    metrics = [json.loads(line) for line in (out / "grpo" / "metrics.jsonl").read_text().splitlines()]
    trained = next(row for row in metrics if "actor/pg_loss" in row)
    assert trained["openai/requests/mean"] >= 1.0 and trained["openai/errors/mean"] == 0.0
    assert "gain from RL:" in proc.stdout and "calculator calls per episode" in proc.stdout


@pytest.mark.slow
def test_the_vision_language_demo_exports_a_model_that_plain_transformers_runs_on_a_picture(tmp_path):
    out = tmp_path / "multimodal"
    proc = run_demo(EXAMPLES / "multimodal" / "run.py", out, "--sft-steps", "20", "--rl-steps", "2", "--n-test", N_TEST)
    summary = check_demo_output(proc, out)
    assert summary["sft_steps"] == 20 and summary["rl_steps"] == 2
    assert (out / "model" / "preprocessor_config.json").exists()  # the image processor travels with the model
    assert (out / "grpo" / "generations" / "val_step_2.jsonl").exists()
    assert "asked about a blue square drawn just now, it answers: " in proc.stdout
    code = printed_lines(proc.stdout)
    assert code.startswith("from PIL import Image\nfrom transformers import AutoImageProcessor, "
                           "AutoModelForImageTextToText, AutoTokenizer\n")
    assert "hyflow" not in code  # plain transformers
    printed, namespace = run_printed_lines(code, out / "model")
    assert namespace["out"].shape[1] > namespace["ids"].shape[1]  # it generated
    assert repr(printed.strip()) in proc.stdout  # the demo ran the same lines
    assert int((namespace["ids"] == namespace["model"].config.image_token_id).sum()) == 4  # a 56x56 picture
