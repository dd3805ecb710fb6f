"""The README's Python API example runs exactly as written (in a temporary working directory)."""

import os
import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


@pytest.mark.slow
def test_python_api_example_runs(tmp_path, capsys):
    text = README.read_text()
    section = text.split("## Python API", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    assert len(code.strip().splitlines()) < 30
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        exec(compile(code, "README.md", "exec"), {"__name__": "readme_example"})
    finally:
        os.chdir(cwd)
    printed = capsys.readouterr().out
    assert "critic/score/mean" in printed and "val-core/hyflow/arithmetic/" in printed
    assert (tmp_path / "runs/api/grpo/metrics.jsonl").exists()
