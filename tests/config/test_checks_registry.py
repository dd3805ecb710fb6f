"""The registration of the config checks (hyflow.config.checks): one order, conditions that gate, advisories warned
as the caller's line, and each feature's algorithm names in its own module only."""

from __future__ import annotations

import ast
import warnings
from pathlib import Path

import pytest

import hyflow
from hyflow.config import load_config, validate_config
from hyflow.config.catalog import algorithm_catalog
from hyflow.config.checks import check, registered_checks, run_checks

CHECKS = Path(hyflow.__file__).parent / "config" / "checks"
VALIDATE = Path(hyflow.__file__).parent / "config" / "validate.py"
# Literal estimator names allowed outside the estimator's own module, each with its reason.
ALLOWED_ELSEWHERE = {
    ("prime.py", "rloo"),  # PRIME's keys under rloo: verl-recipe prime's script names rloo for PRIME's estimator
}


def test_checks_run_in_one_order_and_every_feature_module_registers():
    for advisory in (False, True):
        orders = [c.order for c in registered_checks(advisory=advisory)]
        assert orders == sorted(orders) and len(set(orders)) == len(orders)
    modules = {c.run.__module__.rpartition(".")[2] for kind in (False, True) for c in registered_checks(advisory=kind)}
    files = {p.stem for p in CHECKS.glob("*.py")} - {"__init__", "model_fit"}  # model_fit runs in the trainer
    assert files == modules


def test_a_taken_order_is_refused():
    taken = registered_checks()[0]
    with pytest.raises(ValueError, match=f"check order {taken.order} of .* is taken by {taken.name}"):
        check(taken.order)(lambda cfg: [])
    assert registered_checks()[0] is taken


def test_a_check_runs_only_where_it_applies():
    spin = "algorithm.adv_estimator=spin pairs the data's answer"
    grpo = load_config(["algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=1"])
    assert not any(p.startswith(spin) for p in run_checks(grpo))
    grpo.algorithm.adv_estimator = "spin"
    assert any(p.startswith(spin) for p in run_checks(grpo))


def test_advisories_warn_as_the_callers_line():
    cfg = load_config(["algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=1"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        validate_config(cfg)
    (singleton,) = [w for w in caught if "every group is a singleton" in str(w.message)]
    assert singleton.category is UserWarning and singleton.filename == __file__


def _string_literals(path: Path) -> set[str]:
    """String constants the code compares or passes (docstrings and f-string text left out)."""
    tree = ast.parse(path.read_text())
    prose = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Expr)}
    fstrings = {id(v) for node in ast.walk(tree) if isinstance(node, ast.JoinedStr) for v in node.values}
    return {node.value for node in ast.walk(tree) if isinstance(node, ast.Constant) and isinstance(node.value, str)
            and id(node) not in prose and id(node) not in fstrings}


def test_an_algorithm_name_appears_only_in_its_own_check_module():
    names = set(algorithm_catalog().advantage_estimators)
    found = [(path.name, name) for path in [VALIDATE, *sorted(CHECKS.glob("*.py"))]
             for name in sorted(_string_literals(path) & names) if path.stem != name]
    assert set(found) == ALLOWED_ELSEWHERE, found


def test_the_driver_is_short_and_no_check_is_long():
    assert len(VALIDATE.read_text().splitlines()) <= 300
    long = [f"{path.name}:{node.name} ({node.end_lineno - node.lineno + 1} lines)"
            for path in [VALIDATE, *CHECKS.glob("*.py")] for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.FunctionDef) and node.end_lineno - node.lineno + 1 > 80]
    assert not long


def test_model_fit_raises_the_first_mismatch_between_config_and_models():
    """The trainer's checks of the loaded models (hyflow.config.checks.model_fit), with the model readers faked."""
    from hyflow.config.checks.model_fit import check_model_fit

    def fit(overrides, processor=None, judged=False, vision=True, teachers_match=True):
        def check_teachers(spec, tokenizer):
            seen.append(("teachers", [t.model.path for t in spec.teachers], tokenizer))
            if not teachers_match:
                raise ValueError("teacher's tokenizer differs")

        def is_vision_model(path, *, trust_remote_code=False):
            seen.append(("vision", path))
            return vision

        seen: list = []
        check_model_fit(load_config(["actor_rollout_ref.model.path=/policy", *overrides]), "tok", processor,
                        judged=judged, is_vision_model=is_vision_model, check_teacher_tokenizers=check_teachers)
        return seen

    assert fit([]) == []
    distill = ["distillation.enabled=true", "distillation.teacher_models.teacher_model.model_path=/teacher"]
    assert fit(distill) == [("teachers", ["/teacher"], "tok")]
    with pytest.raises(ValueError, match="teacher's tokenizer differs"):
        fit(distill, teachers_match=False)
    gae = ["algorithm.adv_estimator=gae"]
    assert fit(gae) == []  # a text policy: the critic is not asked
    assert fit(gae, processor="images") == [("vision", "/policy")]
    with pytest.raises(ValueError, match=r"critic.model.path=/critic is a text-only model, but the policy is a vision"):
        fit([*gae, "critic.model.path=/critic"], processor="images", vision=False)
    vllm = ["actor_rollout_ref.rollout.name=vllm", "+data.mm_processor_kwargs.max_pixels=12544"]
    assert fit(vllm) == []
    with pytest.raises(ValueError, match=r"data.mm_processor_kwargs with actor_rollout_ref.rollout.name=vllm"):
        fit(vllm, processor="images")
    assert fit(["reward_model.reward_manager=prime"], judged=False) == []
    fit(["reward_model.reward_manager=dapo"], judged=True)
    with pytest.raises(ValueError, match=r"reward_model.reward_manager=prime with a generative reward model"):
        fit(["reward_model.reward_manager=prime"], judged=True)
