"""hyflow.interactions: BaseInteraction and the verl-format YAML loader."""

from __future__ import annotations

import asyncio
import sys
import textwrap

import pytest

from hyflow.interactions import BaseInteraction, initialize_interactions_from_config, load_interactions
from hyflow.interactions.registry import default_interaction_name

INTERACTIONS = '''
from hyflow.interactions import BaseInteraction


class Gsm8kInteraction(BaseInteraction):
    """Says "try again" until the answer is right, at most `max_turns` times."""

    def __init__(self, config):
        super().__init__(config)
        self.state = {}
        self.finalized = []

    async def start_interaction(self, instance_id=None, ground_truth=None, **kwargs):
        instance_id = await super().start_interaction(instance_id)
        self.state[instance_id] = {"ground_truth": ground_truth, "turns": 0}
        return instance_id

    async def generate_response(self, instance_id, messages, **kwargs):
        state = self.state[instance_id]
        state["turns"] += 1
        answer = messages[-1]["content"]
        if answer == state["ground_truth"]:
            return True, "Correct!", 1.0, {"turns": state["turns"]}
        done = state["turns"] >= self.config["max_turns"]
        return done, "Try again.", 0.0, {}

    async def calculate_score(self, instance_id=None, **kwargs):
        return 1.0 if self.state[instance_id]["turns"] == 1 else 0.5

    async def finalize_interaction(self, instance_id=None, **kwargs):
        self.finalized.append(instance_id)
        del self.state[instance_id]


class Echo(BaseInteraction):
    pass


class NotAnInteraction:
    pass
'''


@pytest.fixture
def module(tmp_path, monkeypatch):
    (tmp_path / "my_interactions.py").write_text(INTERACTIONS)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "my_interactions"
    sys.modules.pop("my_interactions", None)


def write_yaml(tmp_path, text):
    path = tmp_path / "interaction.yaml"
    path.write_text(textwrap.dedent(text))
    return path


def test_default_name_derivation():
    assert default_interaction_name("pkg.mod.Gsm8kInteraction") == "gsm8k"
    assert default_interaction_name("pkg.mod.Echo") == "echo"
    assert default_interaction_name("dir/file.py:MathTutorInteraction") == "mathtutor"
    assert default_interaction_name("pkg.Interaction") == "interaction"


def test_yaml_loads_interactions_and_runs_a_conversation(tmp_path, module):
    path = write_yaml(
        tmp_path,
        f"""
        interaction:
          - class_name: {module}.Gsm8kInteraction
            config: {{max_turns: 2}}
          - name: parrot
            class_name: {module}.Echo
    """,
    )
    interactions = initialize_interactions_from_config(path)
    assert load_interactions is initialize_interactions_from_config
    assert list(interactions) == ["gsm8k", "parrot"]
    gsm8k, parrot = interactions["gsm8k"], interactions["parrot"]
    assert (gsm8k.name, gsm8k.config) == ("gsm8k", {"max_turns": 2, "name": "gsm8k"})
    assert (parrot.name, parrot.config) == ("parrot", {"name": "parrot"}) and isinstance(
        parrot, BaseInteraction
    )

    async def conversation():
        instance_id = await gsm8k.start_interaction(None, ground_truth="72", name="gsm8k")
        messages = [{"role": "user", "content": "How many?"}, {"role": "assistant", "content": "70"}]
        assert await gsm8k.generate_response(instance_id, messages) == (False, "Try again.", 0.0, {})
        messages += [{"role": "user", "content": "Try again."}, {"role": "assistant", "content": "72"}]
        assert await gsm8k.generate_response(instance_id, messages) == (True, "Correct!", 1.0, {"turns": 2})
        assert await gsm8k.calculate_score(instance_id) == 0.5
        await gsm8k.finalize_interaction(instance_id)
        assert gsm8k.finalized == [instance_id] and gsm8k.state == {}

        # The base class's defaults.
        own_id = await parrot.start_interaction()
        assert len(own_id) == 32 and await parrot.start_interaction("given") == "given"
        assert await parrot.generate_response(own_id, messages) == (True, "", 0.0, {})
        assert await parrot.calculate_score(own_id) == 0.0
        assert await parrot.finalize_interaction(own_id) is None

    asyncio.run(conversation())


def test_base_interaction_default_name():
    assert BaseInteraction({}).name == "interaction_agent"
    assert BaseInteraction({"name": "judge"}).name == "judge"


def loader_error(tmp_path, text):
    path = write_yaml(tmp_path, text)
    with pytest.raises(ValueError) as info:
        load_interactions(path)
    assert str(path) in str(info.value)
    return str(info.value)


def test_duplicate_names_are_an_error(tmp_path, module):
    message = loader_error(
        tmp_path,
        f"""
        interaction:
          - class_name: {module}.Gsm8kInteraction
            config: {{max_turns: 1}}
          - name: gsm8k
            class_name: {module}.Echo
    """,
    )
    assert "interaction[1]: interaction[0] and interaction[1] are both named 'gsm8k'" in message
    assert "unique `name:`" in message


def test_loader_errors(tmp_path, module):
    with pytest.raises(ValueError, match=r"missing\.yaml does not exist"):
        load_interactions(tmp_path / "missing.yaml")
    assert "no top-level `interaction:` list" in loader_error(
        tmp_path, "interactions:\n  - class_name: a.B\n"
    )
    assert "interaction[0]: missing `class_name`" in loader_error(tmp_path, "interaction:\n  - name: x\n")
    message = loader_error(tmp_path, f"interaction:\n  - class_name: {module}.Gsm8k\n")
    assert "has no class 'Gsm8k'" in message and "Gsm8kInteraction" in message
    message = loader_error(tmp_path, f"interaction:\n  - class_name: {module}.NotAnInteraction\n")
    assert "is not a BaseInteraction" in message and "subclass hyflow.interactions.BaseInteraction" in message
    message = loader_error(tmp_path, "interaction:\n  - class_name: no_such_module_xyz.Foo\n")
    assert "cannot import module 'no_such_module_xyz'" in message
    assert "`name` must be a non-empty string" in loader_error(
        tmp_path, f"interaction:\n  - name: 3\n    class_name: {module}.Echo\n"
    )
