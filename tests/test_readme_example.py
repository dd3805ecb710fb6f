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


def test_multi_turn_tool_example_loads_and_runs(tmp_path, monkeypatch):
    """The README's tool class and YAML, as written: the YAML loads the class, the tool answers a call."""
    import asyncio

    from hyflow.tools import load_tools

    section = README.read_text().split("## Multi-turn rollouts with tools", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    yaml = re.search(r"```yaml\n(.*?)```", section, re.S).group(1)
    module = re.search(r"class_name: (\w+)\.", yaml).group(1)
    (tmp_path / f"{module}.py").write_text(code)
    (tmp_path / "tools.yaml").write_text(yaml)
    monkeypatch.syspath_prepend(str(tmp_path))
    (tool,) = load_tools(tmp_path / "tools.yaml")
    assert tool.name == "word_count" and tool.config["timeout"] == 10

    async def use():
        instance, _ = await tool.create(create_kwargs={})
        return await tool.execute(instance, {"text": "three little words"})

    response, reward, _ = asyncio.run(use())
    assert response.text == "3" and reward == 0.0
