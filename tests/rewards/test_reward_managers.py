"""Reward managers on hand-made batches: placement of scores, extras, failures counted, DAPO overlong penalty."""

import logging
import time

import pytest
import torch

from hyflow.batch import Batch
from hyflow.rewards.managers import make_reward_manager


def make_batch(tokenizer, responses, lengths=None, R=16):
    rows = []
    for text in responses:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"][:R]
        rows.append(ids)
    lengths = lengths or [len(r) for r in rows]
    resp = torch.full((len(rows), R), tokenizer.pad_token_id)
    mask = torch.zeros((len(rows), R), dtype=torch.long)
    for i, (ids, n) in enumerate(zip(rows, lengths)):
        resp[i, : len(ids)] = torch.tensor(ids)
        mask[i, :n] = 1
    return Batch({"responses": resp, "response_mask": mask},
                 {"data_source": ["src"] * len(rows), "ground_truth": [str(i) for i in range(len(rows))],
                  "extra_info": [{"i": i} for i in range(len(rows))]})


def exact(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": float(solution_str.strip() == ground_truth), "acc": solution_str.strip() == ground_truth,
            "pred": solution_str.strip()}


@pytest.mark.parametrize("workers", [0, 2])
def test_naive_places_score_at_last_valid_token(tiny_tokenizer, workers):
    batch = make_batch(tiny_tokenizer, ["0", "5", "2"])
    result = make_reward_manager("naive", tiny_tokenizer, compute_score=exact, num_workers=workers)(batch)
    lengths = batch["response_mask"].sum(-1)
    assert result.scores == [1.0, 0.0, 1.0]
    for i, n in enumerate(lengths.tolist()):
        row = result.token_level_scores[i]
        assert row[n - 1] == result.scores[i] and row.sum() == result.scores[i]
    assert result.extra["acc"] == [True, False, True] and result.extra["pred"] == ["0", "5", "2"]
    assert result.metrics["reward/acc/mean"] == pytest.approx(2 / 3)
    assert result.metrics["reward/errors"] == 0


def test_reward_file_raising_every_third_call_does_not_stop_scoring(tmp_path, tiny_tokenizer, caplog):
    from hyflow.rewards.custom import load_custom_reward_function

    path = tmp_path / "my_reward.py"
    path.write_text(
        "calls = 0\n"
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):\n"
        "    global calls\n"
        "    calls += 1\n"
        "    if calls % 3 == 0:\n"
        "        raise ValueError('flaky scorer')\n"
        "    return {'score': 1.0, 'bonus': 0.5}\n"
    )
    fn = load_custom_reward_function(path, "compute_score")
    batch = make_batch(tiny_tokenizer, [str(i) for i in range(10)])
    manager = make_reward_manager("naive", tiny_tokenizer, compute_score=fn, num_workers=1)
    with caplog.at_level(logging.WARNING):
        result = manager(batch)
    assert result.metrics["reward/errors"] == 3  # calls 3, 6, 9
    assert result.scores == [0.0 if (i + 1) % 3 == 0 else 1.0 for i in range(10)]
    assert sum("flaky scorer" in r.getMessage() for r in caplog.records) == 1  # logged once, with the sample
    assert "solution_str" in caplog.records[0].getMessage()


def test_hanging_scorer_times_out(tiny_tokenizer):
    def slow(data_source, solution_str, ground_truth, extra_info=None):
        if solution_str == "1":
            time.sleep(30)
        return 1.0

    batch = make_batch(tiny_tokenizer, ["0", "1", "2"])
    start = time.monotonic()
    result = make_reward_manager("naive", tiny_tokenizer, compute_score=slow, num_workers=1, timeout_s=0.5)(batch)
    assert time.monotonic() - start < 10
    assert result.scores == [1.0, 0.0, 1.0] and result.metrics["reward/timeouts"] == 1


def test_bad_return_values_count_as_errors(tiny_tokenizer):
    batch = make_batch(tiny_tokenizer, ["0", "1"])
    result = make_reward_manager("naive", tiny_tokenizer, compute_score=lambda **kw: "oops", num_workers=0,
                                 max_error_fraction=1.0)(batch)
    assert result.scores == [0.0, 0.0] and result.metrics["reward/errors"] == 2


def test_batch_manager_one_call(tiny_tokenizer):
    seen = []

    def batch_fn(data_sources, solution_strs, ground_truths, extra_infos, scale=1.0):
        seen.append(len(solution_strs))
        return [scale * float(s == g) for s, g in zip(solution_strs, ground_truths)]

    batch = make_batch(tiny_tokenizer, ["0", "9", "2"])
    result = make_reward_manager("batch", tiny_tokenizer, compute_score=batch_fn, num_workers=0,
                                 reward_kwargs={"scale": 2.0})(batch)
    assert seen == [3] and result.scores == [2.0, 0.0, 2.0]
    wrong = make_reward_manager("batch", tiny_tokenizer, compute_score=lambda **kw: [1.0], num_workers=0,
                                max_error_fraction=1.0)(batch)
    assert wrong.scores == [0.0, 0.0, 0.0] and wrong.metrics["reward/errors"] == 3


def test_dapo_overlong_penalty(tiny_tokenizer):
    # max 16 tokens, buffer 4: no penalty up to 12, linear to -factor at 16
    batch = make_batch(tiny_tokenizer, ["0"] * 4, lengths=[10, 12, 14, 16])
    manager = make_reward_manager("dapo", tiny_tokenizer, compute_score=lambda **kw: 1.0, num_workers=0,
                                  max_response_length=16, overlong_buffer={"len": 4, "penalty_factor": 1.0})
    result = manager(batch)
    assert result.scores == pytest.approx([1.0, 1.0, 0.5, 0.0])
    assert result.extra["overlong"] == [False, False, True, True]
    with pytest.raises(ValueError, match="overlong_buffer.len"):
        make_reward_manager("dapo", tiny_tokenizer, compute_score=lambda **kw: 1.0, max_response_length=16,
                            overlong_buffer={"len": 0})(batch)


@pytest.mark.parametrize("name", ["dapo", "naive"])
def test_verl_overlong_buffer_cfg_applies_the_penalty(tiny_tokenizer, name):
    """verl's DAPO recipe: +reward_model.reward_kwargs.overlong_buffer_cfg.* and max_resp_len (arguments of its DAPO
    manager) give the same penalty as reward_model.overlong_buffer, and never reach the scorer."""
    seen = []

    def scorer(**kw):
        seen.append(sorted(kw))
        return 1.0

    batch = make_batch(tiny_tokenizer, ["0"] * 4, lengths=[10, 12, 14, 16])
    manager = make_reward_manager(name, tiny_tokenizer, compute_score=scorer, num_workers=0, max_response_length=64,
                                  overlong_buffer={"enable": False, "len": 0, "penalty_factor": 1.0, "log": False},
                                  reward_kwargs={"overlong_buffer_cfg": {"enable": True, "len": 4,
                                                                         "penalty_factor": 1.0, "log": False},
                                                 "max_resp_len": 16})
    result = manager(batch)
    assert result.scores == pytest.approx([1.0, 1.0, 0.5, 0.0])
    assert "reward/overlong_penalty/mean" in result.metrics
    assert all("overlong_buffer_cfg" not in keys and "max_resp_len" not in keys for keys in seen)


def test_overlong_penalty_set_twice_differently_is_an_error(tiny_tokenizer):
    with pytest.raises(ValueError, match=r"set twice .* len \(4 vs 8\)"):
        make_reward_manager("dapo", tiny_tokenizer, compute_score=lambda **kw: 1.0, max_response_length=16,
                            overlong_buffer={"enable": True, "len": 4},
                            reward_kwargs={"overlong_buffer_cfg": {"enable": True, "len": 8}})


def test_unknown_manager():
    with pytest.raises(ValueError, match="unknown reward manager 'naïve'"):
        make_reward_manager("naïve", None)
