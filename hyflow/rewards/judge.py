"""A generative reward model (a judge, verl's GenRM): a language model reads each sample and writes its score.

Per sample i, with the judge's own tokenizer:

    text_i   = template.format(problem=..., solution=..., ground_truth=..., data_source=..., extra_info=...)
    ids_i    = judge_tokenizer(chat_template([system?, {"role": "user", "content": text_i}], generation prompt))
    output_i = decode(generate([ids_1, ..., ids_N], sampling)[i])
    score_i  = parse(output_i)

`generate` is any callable ``generate(prompt_ids: list[list[int]], sampling: JudgeSampling) -> list[list[int]]``
(the new token ids of each prompt, in order); `engine_generate` makes one from a hyflow rollout engine (hf or
vllm), so the judge is just another engine. One call scores the whole batch, so the engine decodes it together.

The default template is the one verl's reward loop documents and tests for a GenRM
(`docs/advance/reward_loop.rst`, `tests/experimental/reward_loop/reward_fn.py`: GRM_PROMPT_TEMPLATE, a 1-10
score as a single integer), and the default parsing is verl's: the text after the last blank line, stripped,
read as an integer, ``int(output.split("\\n\\n")[-1].strip())``. Differences from verl, all on failure: verl
scores an unparsable output 0; here it is a failed `Outcome` whose error quotes the output, so it counts toward
`reward_model.max_error_fraction` like any reward failure (and scores 0 below it). With `score_range` set (verl's
template asks for 1..10), a score outside it fails the same way. `score_pattern` (a regex) replaces verl's rule:
its last match in the output is the score (group 1 when the pattern has a group, else the whole match).

Template fields (Python `str.format`, literal braces doubled): `problem` / `question` / `prompt` (the question the
policy answered: `extra_info["question"]` when the row has it, as in verl's example, else the last user message
of `raw_prompt`, else the decoded prompt tokens), `solution` / `response` (the policy's decoded response),
`ground_truth`, `data_source`, `extra_info` (the row's dict: ``{extra_info[answer]}``). An unknown field is an
error when the judge is built, naming the field and the known ones.

Mixing with rule scorers: `JudgeRewardManager` scores a batch with the judge and, when weighted in, the run's
rule reward function, and adds them with weights, ``score_i = sum_c w_c * s_c,i``, as `WeightedRewards` does for
reward functions (each component's score is also an extra under its name, so `reward/<name>/mean` is logged).
A judge is not a per-sample reward function: it runs on an engine, one batched call for all samples, in this
process (a forked scoring process must not hold a model).
"""

from __future__ import annotations

import math
import re
import string
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from hyflow.batch import Batch
from hyflow.rewards.custom import normalize_score
from hyflow.rewards.managers import NaiveRewardManager, RewardResult
from hyflow.rewards.pool import Outcome, run_calls

# verl's GRM_PROMPT_TEMPLATE (tests/experimental/reward_loop/reward_fn.py, docs/advance/reward_loop.rst), verbatim
# (the trailing space after "problem." included).
VERL_JUDGE_TEMPLATE = (
    "You are given a problem and a proposed solution.\n"
    "\n"
    "Problem:\n"
    "{problem}\n"
    "\n"
    "Solution:\n"
    "{solution}\n"
    "\n"
    "Please evaluate how well the solution addresses the problem. \n"
    "Give a score from 1 to 10, where:\n"
    "- 1 means the solution is completely irrelevant or incorrect.\n"
    "- 5 means the solution is partially correct but incomplete or not well reasoned.\n"
    "- 10 means the solution is fully correct, well-reasoned, and directly solves the problem.\n"
    "\n"
    "Only output the score as a single number (integer)."
)

TEMPLATE_FIELDS = ("problem", "question", "prompt", "solution", "response", "ground_truth", "data_source",
                   "extra_info")


@dataclass(frozen=True)
class JudgeSampling:
    """How the judge samples (verl's `reward_model.rollout.{temperature, top_p, top_k, do_sample,
    response_length}`; defaults are verl's). The field names are `hyflow.rollout.base.SamplingParams`'s."""

    max_new_tokens: int = 2048
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    do_sample: bool = True
    seed: int | None = None


GenerateFn = Callable[[list[list[int]], JudgeSampling], list[list[int]]]


def template_fields(template: str) -> list[str]:
    """The field names a `str.format` template uses (``{extra_info[x]}`` and ``{a.b}`` count as their base); a
    ValueError for a malformed template or a positional field."""
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as exc:
        raise ValueError(f"the judge template is not a valid str.format template ({exc}); write a literal brace "
                         "as {{ or }}") from None
    names = []
    for _, field, _, _ in parsed:
        if field is None:
            continue
        base = re.split(r"[.\[]", field, maxsplit=1)[0]
        if not base or base.isdigit():
            raise ValueError(f"the judge template has a positional field {{{field}}}; name it, one of "
                             f"{', '.join(TEMPLATE_FIELDS)} (write a literal brace as {{{{ or }}}})")
        names.append(base)
    return names


def load_template(template: str | None = None, template_path: str | Path | None = None) -> str:
    """The judge's prompt template: `template` (a string), the text of `template_path`, or verl's default.

    Every field must be one of TEMPLATE_FIELDS: otherwise a ValueError names the field, the known ones and how
    to write literal braces."""
    if template is not None and template_path is not None:
        raise ValueError("give the judge's prompt template once: as a string (template) or a file (template_path)")
    if template_path is not None:
        path = Path(template_path).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"judge prompt template file {str(path)!r} does not exist")
        template = path.read_text()
    if template is None:
        template = VERL_JUDGE_TEMPLATE
    fields = template_fields(template)
    unknown = sorted(set(fields) - set(TEMPLATE_FIELDS))
    if unknown:
        raise ValueError(f"the judge template uses unknown field(s) {', '.join('{' + f + '}' for f in unknown)}; "
                         f"the known fields are {', '.join('{' + f + '}' for f in TEMPLATE_FIELDS)} (a key of the "
                         "row's extra_info is {extra_info[key]}); rename the field, or write literal braces as "
                         "{{ and }}")
    return template


def parse_verl_score(output: str) -> float:
    """verl's rule: ``int(output.split("\\n\\n")[-1].strip())``; a ValueError quoting that text (cut to 80
    characters) when it is not an integer or is too large for a float (a 400-digit integer)."""
    text = output.split("\n\n")[-1].strip()
    try:
        return float(int(text))
    except ValueError:
        raise ValueError(f"{_shown(text, 80)!r} is not an integer") from None
    except OverflowError:
        raise ValueError(f"{_shown(text, 80)!r} is an integer too large for a float") from None


def _shown(text: str, limit: int = 300) -> str:
    """`text`, its middle cut when longer than `limit` characters (a judge's output quoted in an error)."""
    return text if len(text) <= limit else text[: limit // 2] + " ... " + text[-(limit // 2):]


def prompt_text(extra_info, raw_prompt, decoded_prompt: str | None) -> str:
    """The question the policy answered: `extra_info["question"]`, else the last user message of `raw_prompt`
    (a chat list or a string), else `decoded_prompt`, else ""."""
    if isinstance(extra_info, dict) and extra_info.get("question") is not None:
        return str(extra_info["question"])
    if isinstance(raw_prompt, str):
        return raw_prompt
    if raw_prompt is not None:
        users = [m for m in list(raw_prompt) if dict(m).get("role") == "user"]
        if users:
            content = dict(users[-1]).get("content")
            if isinstance(content, str):
                return content
            # multimodal content parts: their text
            return "".join(part.get("text", "") for part in content or [] if isinstance(part, dict))
    return decoded_prompt or ""


def sample_questions(batch: Batch, tokenizer) -> list[str]:
    """`prompt_text` of every sample of a rollout batch: its `extra_info`, `raw_prompt` and, decoded with the
    policy's `tokenizer` (special tokens skipped), the valid tokens of its `prompts`."""
    infos = list(batch["extra_info"]) if "extra_info" in batch else [None] * len(batch)
    raw = list(batch["raw_prompt"]) if "raw_prompt" in batch else [None] * len(batch)
    questions = []
    for i, (info, messages) in enumerate(zip(infos, raw)):
        decoded = None
        if not (isinstance(info, dict) and info.get("question") is not None) and messages is None \
                and "prompts" in batch and "attention_mask" in batch:
            ids, mask = batch["prompts"][i], batch["attention_mask"][i, : batch["prompts"].shape[1]].bool()
            decoded = tokenizer.decode(ids[mask].tolist(), skip_special_tokens=True)
        questions.append(prompt_text(info, messages, decoded))
    return questions


class GenerativeJudge:
    """Scores samples by asking a language model (see the module docstring).

    `tokenizer` is the judge's; `generate` turns prompt token-id lists into generated token-id lists
    (`engine_generate`). `system_prompt` (optional) is sent as a system message before the user message.
    `use_chat_template=False` tokenises the filled template as it is. `max_prompt_length` (verl's
    `reward_model.rollout.prompt_length`): a longer judge prompt fails that sample instead of being cut.
    `score_range=(lo, hi)`: a score outside it fails the sample; `normalize=True` then maps it to
    (score - lo) / (hi - lo) in [0, 1], so it mixes with 0/1 rule scores on one scale.
    """

    def __init__(self, tokenizer, generate: GenerateFn, *, template: str | None = None,
                 template_path: str | Path | None = None, sampling: JudgeSampling | None = None,
                 score_pattern: str | None = None, score_range: tuple[float, float] | None = None,
                 normalize: bool = False, system_prompt: str | None = None, use_chat_template: bool = True,
                 max_prompt_length: int | None = None) -> None:
        self.tokenizer = tokenizer
        self.generate = generate
        self.template = load_template(template, template_path)
        self.sampling = sampling or JudgeSampling()
        self.score_pattern = re.compile(score_pattern) if score_pattern else None
        if score_range is not None:
            lo, hi = (float(v) for v in score_range)
            if not lo < hi:
                raise ValueError(f"the judge's score_range must be (low, high) with low < high, got {score_range}")
            score_range = (lo, hi)
        if normalize and score_range is None:
            raise ValueError("normalize=True maps the judge's score range to [0, 1]: give score_range=(low, high) "
                             "too (verl's template asks for 1..10)")
        self.score_range, self.normalize = score_range, normalize
        self.system_prompt = system_prompt
        self.use_chat_template = use_chat_template
        if use_chat_template and not getattr(tokenizer, "chat_template", None):
            raise ValueError(f"the judge's tokenizer ({getattr(tokenizer, 'name_or_path', '?')!r}) has no chat "
                             "template; add one to its tokenizer_config.json or build the judge with "
                             "use_chat_template=False (the filled template is then tokenised as it is)")
        self.max_prompt_length = max_prompt_length

    # ------------------------------------------------------------------ prompt
    def render(self, sample: dict) -> str:
        """The filled template of one sample: a dict with `solution_str` and optionally `prompt_str`,
        `ground_truth`, `data_source`, `extra_info` (the keys of verl's reward-function call)."""
        problem = sample.get("prompt_str") or ""
        solution = sample.get("solution_str") or ""
        extra_info = sample.get("extra_info")
        values = {"problem": problem, "question": problem, "prompt": problem, "solution": solution,
                  "response": solution, "ground_truth": sample.get("ground_truth"),
                  "data_source": sample.get("data_source"), "extra_info": extra_info if extra_info is not None else {}}
        try:
            return self.template.format(**values)
        except (KeyError, IndexError, AttributeError, TypeError) as exc:
            keys = sorted(values["extra_info"]) if isinstance(values["extra_info"], dict) else []
            raise KeyError(f"the judge template reads {exc.args[0]!r} of a field, and this sample has none "
                           f"({type(exc).__name__}; its extra_info has keys {keys}); add it to the dataset rows' "
                           "extra_info or remove it from the template") from None

    def tokenize(self, text: str) -> list[int]:
        """Token ids of one judge prompt: the chat template with the generation prompt, or the text as it is."""
        if not self.use_chat_template:
            return list(self.tokenizer(text, add_special_tokens=True)["input_ids"])
        messages = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        messages.append({"role": "user", "content": text})
        rendered = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return list(self.tokenizer(rendered, add_special_tokens=False)["input_ids"])

    # ------------------------------------------------------------------ score
    def parse(self, output: str) -> float:
        """The score written in `output` (verl's rule, or the last match of `score_pattern`); a ValueError naming
        the text when there is none or it is out of range."""
        shown = _shown(output)
        if self.score_pattern is None:
            try:
                score = parse_verl_score(output)
            except ValueError as exc:
                raise ValueError(f"the judge's output has no score: verl's rule reads an integer after the last "
                                 f"blank line, and {exc}; the output was {shown!r}") from None
        else:
            matches = list(self.score_pattern.finditer(output))
            if not matches:
                raise ValueError(f"the judge's output has no match of score_pattern {self.score_pattern.pattern!r}: "
                                 f"{shown!r}")
            last = matches[-1]
            text = last.group(1) if self.score_pattern.groups else last.group(0)
            try:
                score = float(text)
            except (TypeError, ValueError, OverflowError):
                raise ValueError(f"score_pattern {self.score_pattern.pattern!r} matched {_shown(str(text), 80)!r}, "
                                 f"not a number, in the judge's output {shown!r}") from None
        if not math.isfinite(score):
            raise ValueError(f"the judge's score {score} is not finite; output {shown!r}")
        if self.score_range is not None:
            lo, hi = self.score_range
            if not lo <= score <= hi:
                raise ValueError(f"the judge's score {score:g} is outside score_range [{lo:g}, {hi:g}]; output "
                                 f"{shown!r}")
            if self.normalize:
                score = (score - lo) / (hi - lo)
        return score

    def score(self, samples: Sequence[dict]) -> list[Outcome]:
        """One Outcome per sample, value ``{"score": s, "genrm_response": output}`` (verl's extra key), or the
        error: a template field the sample lacks, a prompt over `max_prompt_length`, an unparsable or out-of-range
        output, or `generate` failing (every sample then carries its error)."""
        outcomes: list[Outcome | None] = [None] * len(samples)
        prompts, rows = [], []
        for i, sample in enumerate(samples):
            try:
                ids = self.tokenize(self.render(sample))
            except KeyError as exc:
                outcomes[i] = Outcome(error=str(exc.args[0]))
                continue
            if self.max_prompt_length is not None and len(ids) > self.max_prompt_length:
                outcomes[i] = Outcome(error=f"the judge prompt has {len(ids)} tokens, more than max_prompt_length="
                                            f"{self.max_prompt_length} (reward_model.rollout.prompt_length); raise "
                                            "it or shorten the template / responses")
                continue
            prompts.append(ids)
            rows.append(i)
        if prompts:
            try:
                generated = self.generate(prompts, self.sampling)
                if len(generated) != len(prompts):
                    raise ValueError(f"the judge's generate returned {len(generated)} outputs for {len(prompts)} "
                                     "prompts")
            except Exception as exc:  # the engine failed: every sample of the call records it
                error = f"the judge's generate failed: {type(exc).__name__}: {exc}"
                for i in rows:
                    outcomes[i] = Outcome(error=error)
                return outcomes
            for i, ids in zip(rows, generated):
                try:
                    output = self.tokenizer.decode(list(ids), skip_special_tokens=True)
                except Exception as exc:  # ids the judge's tokenizer cannot decode: this sample only
                    outcomes[i] = Outcome(error=f"the judge's output cannot be decoded: {type(exc).__name__}: "
                                                f"{_shown(str(exc), 200)}")
                    continue
                try:
                    outcomes[i] = Outcome(value={"score": self.parse(output), "genrm_response": output})
                except Exception as exc:  # any output that is no score fails its sample, never the batch
                    message = str(exc) if isinstance(exc, ValueError) else (
                        f"the judge's output is no score ({type(exc).__name__}: {_shown(str(exc), 200)}); output "
                        f"{_shown(output)!r}")
                    outcomes[i] = Outcome(error=message)
        return outcomes


def engine_generate(engine, pad_token_id: int, make_params: Callable) -> GenerateFn:
    """A judge's `generate` from a rollout engine (`engine.generate(prompts: Batch, params) -> Batch`, hf or vllm).

    The prompts are left-padded into `input_ids` / `attention_mask` (what every engine reads) and generated with
    ``make_params(n=1, calculate_log_probs=False, **asdict(sampling))``; `make_params` is
    `hyflow.rollout.base.SamplingParams` (passed in: the rewards layer imports nothing of the rollout layer).
    Each output is `responses[i]` up to its `response_mask` length (the stop token included; it is decoded
    with special tokens skipped)."""

    def generate(prompt_ids: list[list[int]], sampling: JudgeSampling) -> list[list[int]]:
        rows = [torch.tensor(list(ids), dtype=torch.long) for ids in prompt_ids]
        input_ids = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=int(pad_token_id),
                                                    padding_side="left")
        attention_mask = torch.nn.utils.rnn.pad_sequence([torch.ones_like(r) for r in rows], batch_first=True,
                                                         padding_value=0, padding_side="left")
        params = make_params(n=1, calculate_log_probs=False, **asdict(sampling))
        out = engine.generate(Batch({"input_ids": input_ids, "attention_mask": attention_mask}), params)
        lengths = out["response_mask"].sum(-1).tolist()
        return [row[: int(n)].tolist() for row, n in zip(out["responses"], lengths)]

    return generate


def combine_outcomes(components: dict[str, list[Outcome]], weights: dict[str, float]) -> list[Outcome]:
    """Per sample, ``{"score": sum_c weights[c] * score_c, c: score_c, "c/key": extra, ...}`` over the components
    (each a list of Outcomes, one per sample), as `WeightedRewards` adds reward functions. A sample fails when
    any component failed on it; its error names the component."""
    names = list(components)
    if set(names) != set(weights):
        raise ValueError(f"combine_outcomes: components {sorted(names)} and weights {sorted(weights)} differ")
    lengths = {len(outcomes) for outcomes in components.values()}
    if len(lengths) > 1:
        raise ValueError(f"combine_outcomes: the components score different numbers of samples {sorted(lengths)}")
    combined = []
    for per_sample in zip(*(components[name] for name in names)):
        total, extras, failed = 0.0, {}, None
        for name, outcome in zip(names, per_sample):
            if outcome.ok:
                try:
                    score, extra = normalize_score(outcome.value)
                except (TypeError, ValueError) as exc:
                    outcome = Outcome(error=str(exc))
            if not outcome.ok:
                failed = failed or Outcome(error=f"{name}: {outcome.error or 'timed out'}",
                                           timed_out=outcome.timed_out)
                continue
            total += weights[name] * score
            extras[name] = score
            extras.update({f"{name}/{key}": value for key, value in extra.items()})
        combined.append(failed or Outcome(value={"score": total, **extras}))
    return combined


class JudgeRewardManager(NaiveRewardManager):
    """A reward manager whose score is a judge's, optionally mixed with the rule reward function's:
    ``score = judge_weight * judge + rule_weight * rule`` per sample (rule_weight = 0: the judge alone, and the
    reward function is not called). Everything else is `naive`'s: the score sits on the last model token, a
    sample either part failed on counts toward `max_error_fraction`, extras `judge`, `rule`,
    `judge/genrm_response` are columns and numeric ones metrics; DAPO's overlong penalty applies when enabled.

    The judge sees each sample's question (`prompt_text`: extra_info["question"], the `raw_prompt` column, or the
    decoded prompt tokens), its decoded response, ground truth, data source and extra_info."""

    streams = False  # the judge scores a whole batch in one engine call: no sample-by-sample path

    def __init__(self, tokenizer, compute_score: Callable | None = None, *, judge: GenerativeJudge,
                 judge_weight: float = 1.0, rule_weight: float = 0.0, **kwargs) -> None:
        super().__init__(tokenizer, compute_score, **kwargs)
        weights = {"judge": float(judge_weight), "rule": float(rule_weight)}
        if not all(math.isfinite(w) for w in weights.values()):
            raise ValueError(f"the judge's and the rule's weights must be finite numbers, got {weights}")
        self.judge, self.rule = judge, self.compute_score
        self.compute_score = judge  # what the manager's errors name (the failure itself names judge or rule)
        self.weights = {name: w for name, w in weights.items() if w != 0.0 or name == "judge"}

    def __call__(self, batch: Batch) -> RewardResult:
        texts, lengths = self.decode_responses(batch)
        calls = [
            {"data_source": ds, "solution_str": text, "ground_truth": gt, "extra_info": info, **self.reward_kwargs}
            for ds, text, gt, info in zip(self._column(batch, "data_source"), texts, self._ground_truths(batch),
                                          self._column(batch, "extra_info", {}))
        ]
        questions = sample_questions(batch, self.tokenizer)
        components = {"judge": self.judge.score([{**call, "prompt_str": q} for call, q in zip(calls, questions)])}
        if "rule" in self.weights:
            components["rule"] = run_calls(self.rule, calls, num_workers=self.num_workers,
                                           timeout_s=self.timeout_s)
        return self._finish(batch, combine_outcomes(components, self.weights), calls, lengths)
