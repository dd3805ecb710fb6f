"""The generative judge (hyflow.rewards.judge): verl's template and score rule, a configurable pattern, failures as
Outcomes that count toward max_error_fraction, template fields, mixing with a rule scorer, and a tiny model served
by the hf engine as the judge."""

from __future__ import annotations

import pytest
import torch

from hyflow.batch import Batch
from hyflow.rewards.judge import (
    VERL_JUDGE_TEMPLATE,
    GenerativeJudge,
    JudgeRewardManager,
    JudgeSampling,
    engine_generate,
    load_template,
)
from hyflow.rewards.managers import RewardFunctionError


class ScriptedJudge:
    """A `generate` that answers each prompt with the next scripted text and records what it was asked."""

    def __init__(self, tokenizer, outputs):
        self.tokenizer, self.outputs = tokenizer, list(outputs)
        self.prompts, self.sampling = [], None

    def __call__(self, prompt_ids, sampling):
        self.prompts.extend(self.tokenizer.decode(ids) for ids in prompt_ids)
        self.sampling = sampling
        answers, self.outputs = self.outputs[: len(prompt_ids)], self.outputs[len(prompt_ids):]
        return [self.tokenizer(text, add_special_tokens=False)["input_ids"] for text in answers]


def sample(solution="x = 4", question="2 + 2?", **extra):
    return {"data_source": "src", "solution_str": solution, "ground_truth": "4", "prompt_str": question,
            "extra_info": extra}


def test_verl_rule_reads_integer_after_last_blank_line(tiny_tokenizer):
    fake = ScriptedJudge(tiny_tokenizer, ["The solution is right.\n\n7", "9", "Reasoning.\n\n 3 \n"])
    judge = GenerativeJudge(tiny_tokenizer, fake, sampling=JudgeSampling(temperature=0.0, max_new_tokens=16))
    outcomes = judge.score([sample(), sample(), sample()])
    assert [o.value["score"] for o in outcomes] == [7.0, 9.0, 3.0]
    assert outcomes[0].value["genrm_response"] == "The solution is right.\n\n7"
    assert fake.sampling == JudgeSampling(temperature=0.0, max_new_tokens=16)
    # verl's default template, filled, inside the judge's chat template with the generation prompt
    expected = VERL_JUDGE_TEMPLATE.format(problem="2 + 2?", solution="x = 4")
    assert fake.prompts[0] == f"<|im_start|>user\n{expected}<|im_end|>\n<|im_start|>assistant\n"
    assert "Problem:\n2 + 2?\n\nSolution:\nx = 4\n" in expected and expected.endswith("single number (integer).")


def test_unparsable_and_out_of_range_outputs_are_failed_outcomes_naming_the_text(tiny_tokenizer):
    fake = ScriptedJudge(tiny_tokenizer, ["I think it is seven", "Good.\n\n11", "7.5", "Good.\n\n10"])
    judge = GenerativeJudge(tiny_tokenizer, fake, score_range=(1, 10))
    unparsable, out_of_range, not_integer, ok = judge.score([sample()] * 4)
    assert not unparsable.ok and "I think it is seven" in unparsable.error and "no score" in unparsable.error
    assert not out_of_range.ok and "11 is outside score_range [1, 10]" in out_of_range.error
    assert not not_integer.ok and "'7.5'" in not_integer.error  # verl's rule reads an integer
    assert ok.ok and ok.value["score"] == 10.0


def test_score_pattern_takes_the_last_match_and_normalizes(tiny_tokenizer):
    fake = ScriptedJudge(tiny_tokenizer, ["Score: 2 at first; final Score: 8.5", "no verdict", "Score: 1"])
    judge = GenerativeJudge(tiny_tokenizer, fake, score_pattern=r"Score:\s*([0-9.]+)", score_range=(0, 10),
                            normalize=True)
    last, missing, low = judge.score([sample()] * 3)
    assert last.value["score"] == pytest.approx(0.85)
    assert not missing.ok and "no match of score_pattern" in missing.error and "no verdict" in missing.error
    assert low.value["score"] == pytest.approx(0.1)
    with pytest.raises(ValueError, match="score_range"):
        GenerativeJudge(tiny_tokenizer, fake, normalize=True)


def test_template_fields_from_a_file_reach_the_prompt(tiny_tokenizer, tmp_path):
    path = tmp_path / "judge.txt"
    path.write_text("Q={question} | P={prompt} | A={response} | GT={ground_truth} | DS={data_source} | "
                    "HINT={extra_info[hint]} | {{literal}}\nVerdict:")
    fake = ScriptedJudge(tiny_tokenizer, ["\n\n5"])
    judge = GenerativeJudge(tiny_tokenizer, fake, template_path=path, system_prompt="Be strict.")
    (outcome,) = judge.score([sample(solution="four", question="2+2", hint="count")])
    assert outcome.value["score"] == 5.0
    assert fake.prompts[0] == ("<|im_start|>system\nBe strict.<|im_end|>\n<|im_start|>user\nQ=2+2 | P=2+2 | A=four | "
                               "GT=4 | DS=src | HINT=count | {literal}\nVerdict:<|im_end|>\n<|im_start|>assistant\n")


def test_unknown_template_field_is_an_error_naming_it_and_the_fix(tiny_tokenizer):
    with pytest.raises(ValueError, match=r"unknown field\(s\) \{answer\}.*\{ground_truth\}.*literal braces"):
        load_template("Is {answer} right? {solution}")
    with pytest.raises(ValueError, match="positional field"):
        load_template("{} {solution}")
    with pytest.raises(ValueError, match="not a valid str.format template"):
        load_template("{solution")
    with pytest.raises(ValueError, match="give the judge's prompt template once"):
        load_template("{solution}", "file.txt")


def test_missing_extra_info_key_fails_only_that_sample(tiny_tokenizer):
    fake = ScriptedJudge(tiny_tokenizer, ["\n\n6"])
    judge = GenerativeJudge(tiny_tokenizer, fake, template="{solution} hint: {extra_info[hint]}")
    missing, present = judge.score([sample(), sample(hint="h")])
    assert not missing.ok and "'hint'" in missing.error and "extra_info" in missing.error
    assert present.value["score"] == 6.0 and len(fake.prompts) == 1


def test_generate_failure_and_long_prompts_are_failed_outcomes(tiny_tokenizer):
    def broken(prompt_ids, sampling):
        raise RuntimeError("engine is asleep")

    outcomes = GenerativeJudge(tiny_tokenizer, broken).score([sample(), sample()])
    assert all(not o.ok and "engine is asleep" in o.error for o in outcomes)
    fake = ScriptedJudge(tiny_tokenizer, ["\n\n4"])
    judge = GenerativeJudge(tiny_tokenizer, fake, template="{solution}", max_prompt_length=12)
    long, short = judge.score([sample(solution="word " * 40), sample(solution="ok")])
    assert not long.ok and "max_prompt_length=12" in long.error
    assert short.value["score"] == 4.0


def rollout_batch(tokenizer, questions, responses, R=12):
    prompt_rows = [tokenizer(q, add_special_tokens=False)["input_ids"] for q in questions]
    P = max(len(r) for r in prompt_rows)
    prompts = torch.full((len(questions), P), tokenizer.pad_token_id)
    resp = torch.full((len(questions), R), tokenizer.pad_token_id)
    mask = torch.zeros((len(questions), P + R), dtype=torch.long)
    for i, (q, text) in enumerate(zip(prompt_rows, responses)):
        ids = tokenizer(text, add_special_tokens=False)["input_ids"][:R]
        prompts[i, P - len(q):] = torch.tensor(q)
        resp[i, : len(ids)] = torch.tensor(ids)
        mask[i, P - len(q): P + len(ids)] = 1
    return Batch({"prompts": prompts, "responses": resp, "attention_mask": mask, "response_mask": mask[:, P:]},
                 {"data_source": ["src"] * len(questions), "ground_truth": ["4"] * len(questions),
                  "extra_info": [{}] * len(questions)})


def exact(data_source, solution_str, ground_truth, extra_info=None):
    return float(solution_str.strip() == ground_truth)


def test_manager_mixes_judge_and_rule_with_weights(tiny_tokenizer):
    batch = rollout_batch(tiny_tokenizer, ["2+2=", "3+1=", "1+1="], ["4", "5", "4"])
    fake = ScriptedJudge(tiny_tokenizer, ["\n\n10", "\n\n2", "\n\n6"])
    judge = GenerativeJudge(tiny_tokenizer, fake, template="Q: {question} A: {solution}", use_chat_template=False,
                            score_range=(0, 10), normalize=True)
    manager = JudgeRewardManager(tiny_tokenizer, exact, judge=judge, judge_weight=0.5, rule_weight=2.0,
                                 num_workers=0)
    result = manager(batch)
    assert result.scores == pytest.approx([0.5 * 1.0 + 2.0, 0.5 * 0.2, 0.5 * 0.6 + 2.0])
    assert result.extra["judge"] == pytest.approx([1.0, 0.2, 0.6]) and result.extra["rule"] == [1.0, 0.0, 1.0]
    assert result.extra["judge/genrm_response"] == ["\n\n10", "\n\n2", "\n\n6"]
    assert result.metrics["reward/judge/mean"] == pytest.approx(0.6) and result.metrics["reward/errors"] == 0
    # the question the judge saw is the decoded prompt (no extra_info["question"], no raw_prompt here)
    assert fake.prompts[1].startswith("Q: 3+1= A: 5")
    last = batch["response_mask"].sum(-1) - 1
    assert result.token_level_scores[torch.arange(3), last].tolist() == pytest.approx(result.scores)


def test_judge_failures_count_toward_max_error_fraction(tiny_tokenizer):
    batch = rollout_batch(tiny_tokenizer, ["a", "b", "c", "d"], ["4", "4", "4", "4"])
    judge = GenerativeJudge(tiny_tokenizer, ScriptedJudge(tiny_tokenizer, ["\n\n3", "no idea", "\n\n5", "\n\n9"]),
                            use_chat_template=False)
    result = JudgeRewardManager(tiny_tokenizer, judge=judge, max_error_fraction=0.5)(batch)
    assert result.scores == [3.0, 0.0, 5.0, 9.0] and result.metrics["reward/errors"] == 1
    judge = GenerativeJudge(tiny_tokenizer, ScriptedJudge(tiny_tokenizer, ["x", "y", "z", "\n\n9"]),
                            use_chat_template=False)
    with pytest.raises(RewardFunctionError, match=r"GenerativeJudge failed on 3 of 4 samples.*judge: the judge's output has no "
                                                  r"score.*'x'"):
        JudgeRewardManager(tiny_tokenizer, judge=judge, max_error_fraction=0.5)(batch)


def greedy_reference(model, ids, max_new_tokens, eos_token_id):
    """Greedy decoding by full forward passes, one prompt at a time (no cache, no padding)."""
    ids = list(ids)
    new = []
    for _ in range(max_new_tokens):
        with torch.no_grad():
            logits = model(torch.tensor([ids + new])).logits[0, -1]
        token = int(logits.argmax())
        new.append(token)
        if token == eos_token_id:
            break
    return new


def test_tiny_model_on_the_hf_engine_is_a_judge(tiny_model_dir, tiny_tokenizer):
    from hyflow.models.loading import load_causal_lm
    from hyflow.rollout.base import SamplingParams
    from hyflow.rollout.hf import HFRolloutEngine

    model = load_causal_lm(str(tiny_model_dir), dtype="float32")
    engine = HFRolloutEngine(model, eos_token_id=tiny_tokenizer.eos_token_id, pad_token_id=tiny_tokenizer.pad_token_id)
    generate = engine_generate(engine, tiny_tokenizer.pad_token_id, SamplingParams)
    # the random tiny model repeats a prompt's last token: a digit there makes it "write a score"
    judge = GenerativeJudge(tiny_tokenizer, generate, template="{question} {solution}", use_chat_template=False,
                            sampling=JudgeSampling(do_sample=False, max_new_tokens=4), score_pattern=r"\d")
    samples = [sample(solution="12+30=42", question="12+30"), sample(solution="no", question="1+1"),
               sample(solution="seven is 7", question="3+4"), sample(solution="8", question="x")]
    prompt_ids = [judge.tokenize(judge.render(s)) for s in samples]
    assert len({len(ids) for ids in prompt_ids}) > 1  # left-padded into one engine call
    outcomes = judge.score(samples)
    for ids, outcome in zip(prompt_ids, outcomes):
        expected = tiny_tokenizer.decode(greedy_reference(model, ids, 4, tiny_tokenizer.eos_token_id),
                                         skip_special_tokens=True)
        if outcome.ok:
            assert outcome.value["genrm_response"] == expected
            assert outcome.value["score"] == float(expected.strip()[-1])
        else:  # no digit written: the failure quotes what the judge wrote
            assert repr(expected) in outcome.error
    assert sum(o.ok for o in outcomes) >= 2 and sum(not o.ok for o in outcomes) >= 1
