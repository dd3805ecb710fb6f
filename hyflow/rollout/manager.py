"""The agent loop's manager: one rollout's trajectories on a worker's engine, and verl's rollout Batch from them.

`AgentLoopManager.generate(prompts, params)` replaces a bare `engine.generate` call (the actor worker calls it on
its share of the prompts). Each of the B x n samples runs the agent loop its row's `agent_name` names
(`hyflow.rollout.agent_loop`: the loops' contract and registry); the trajectories are driven by a
`RolloutStream` (`hyflow.rollout.stream`: submit every prompt, advance until all are finished, close: the
synchronous case of the asynchronous stream), and `assemble` builds the Batch from their outputs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np
import torch

from hyflow.batch import Batch
from hyflow.models.vision import row_position_ids
from hyflow.rollout.agent_loop import (
    AGENT_LOOP_KWARGS,
    AGENT_LOOPS,
    TOOL_COUNTERS,
    AgentLoopBase,
    AgentLoopOutput,
    is_empty,
    load_agent_loop_config,
)
from hyflow.rollout.agent_server import ServerHandle, TurnServer
from hyflow.rollout.base import SamplingParams
from hyflow.rollout.output import left_pad, rollout_batch
from hyflow.rollout.stream import ASYNC_COLUMNS, ASYNC_METRICS, RolloutStream
from hyflow.rollout.tool_parser import make_tool_parser
from hyflow.tools.runner import ToolRunner


class AgentLoopManager:
    """Runs one rollout's trajectories on this worker's engine and returns verl's rollout Batch."""

    def __init__(self, engine, tokenizer, rollout_config, *, eos_token_ids: Sequence[int], pad_token_id: int,
                 tools: Sequence | None = None, interactions: dict | None = None,
                 chat_template_kwargs: dict | None = None, processor=None) -> None:
        self.engine, self.tokenizer, self.config = engine, tokenizer, rollout_config
        self.processor = processor  # a vision-language policy's VisionProcessor: the loops process tools' images
        self.eos_token_ids, self.pad_token_id = list(eos_token_ids), int(pad_token_id)
        self.tools = {tool.name: tool for tool in (tools or [])}
        self.interactions = dict(interactions or {})
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        agent = rollout_config.agent
        load_agent_loop_config(agent.agent_loop_config_path)
        self.default_agent = agent.default_agent_loop
        self.num_workers = max(1, int(agent.num_workers))
        self.multi_turn = bool(rollout_config.multi_turn.enable)
        self.tool_parser = make_tool_parser(rollout_config.multi_turn.format, tokenizer)
        self.tool_parser.set_tools(tool.tool_schema.model_dump(exclude_unset=True, exclude_none=True)
                                   for tool in self.tools.values())
        # tool calls run on these threads (at most max(64, num_workers) at once), so a timeout can end them
        self.tool_runner = ToolRunner(max_threads=max(64, self.num_workers))
        self._stuck_reported = 0
        self.last_server: TurnServer | None = None
        # progress(stage, done, total, unit, detail): called as trajectories finish (the trainer's progress bar)
        self.progress: Callable[..., None] | None = None

    def agent_names(self, prompts: Batch) -> list[str]:
        names = list(prompts["agent_name"]) if "agent_name" in prompts else [None] * len(prompts)
        names = [self.default_agent if is_empty(name) else str(name) for name in names]
        unknown = sorted({name for name in names if name not in AGENT_LOOPS})
        if unknown:
            raise AGENT_LOOPS.unknown(unknown[0], " (the rows' agent_name, or rollout.agent.default_agent_loop)")
        if not self.multi_turn and any(name != "single_turn_agent" for name in names):
            other = next(name for name in names if name != "single_turn_agent")
            raise ValueError(f"rows ask for the agent loop {other!r} but actor_rollout_ref.rollout.multi_turn.enable "
                             "is false: set it to true (and multi_turn.tool_config_path for tools), or drop the rows' "
                             "agent_name to roll them out single-turn")
        return names

    def generate(self, prompts: Batch, params: SamplingParams,
                 on_finished: Callable[[int, int, AgentLoopOutput], None] | None = None) -> Batch:
        """The rollout of `prompts`: the degenerate case of the asynchronous stream (`hyflow.rollout.stream`), one
        driver for every mode: submit every prompt, advance until all are finished, close. Row i of the Batch is
        sample i % n of prompt i // n. `on_finished(prompt row, sample, output)` is called as each trajectory
        ends (`RolloutStream`'s on_finished)."""
        if len(prompts) == 0:
            raise ValueError("AgentLoopManager.generate got an empty prompt batch")
        stream = RolloutStream(self, params, prompt_width=prompts["input_ids"].shape[1], prompts=prompts,
                               response_length=int(self.config.response_length), progress=self.progress,
                               on_finished=on_finished)
        self.last_server = stream.server
        try:
            stream.submit(prompts, range(len(prompts)))
            batch = stream.advance(len(prompts))
        finally:
            stream.close()
        self._warn_stuck_threads()
        batch.pop(*ASYNC_COLUMNS)
        for key in ASYNC_METRICS:
            batch.meta["metrics"].pop(key, None)
        return batch

    def _warn_stuck_threads(self) -> None:
        """One warning when more tool threads are stuck than at the last report (see the module docstring)."""
        stuck = self.tool_runner.stuck_threads()
        if len(stuck) > self._stuck_reported:
            import collections
            import warnings

            where = ", ".join(f"{label} x{count}" for label, count in collections.Counter(stuck).most_common())
            warnings.warn(f"hyflow: {len(stuck)} tool thread(s) are still blocked in calls abandoned at their timeout "
                          f"({where}); they keep running (Python cannot kill a thread) but no longer hold the "
                          "rollout. Give the blocking work in the tool a timeout of its own, or make it await "
                          "(tool/stuck_threads counts them)", RuntimeWarning, stacklevel=2)
        self._stuck_reported = len(stuck)

    def turn_params(self, params: SamplingParams) -> SamplingParams:
        """The sampling params of one turn: one sample (the n samples of a prompt are n trajectories), and the
        tool format's own end-of-call ids among the stop ids (llama3's <|eom_id|>)."""
        turn_params = dataclasses.replace(params, n=1)
        extra_stops = [i for i in self.tool_parser.stop_token_ids if i not in params.stop_token_ids]
        if self.multi_turn and extra_stops:
            turn_params = dataclasses.replace(turn_params, stop_token_ids=(*params.stop_token_ids, *extra_stops))
        return turn_params

    def make_agent(self, name: str, handle: ServerHandle, rollout_kwargs: dict | None = None) -> AgentLoopBase:
        """A new instance of the agent loop registered as `name`, over `handle`; `rollout_kwargs`: loop class ->
        what its start_rollout gave this rollout."""
        loop = AGENT_LOOPS[name]
        extra = (rollout_kwargs or {}).get(loop, {})
        return loop(server_manager=handle, tokenizer=self.tokenizer, rollout_config=self.config,
                    tools=self.tools, tool_parser=self.tool_parser, interactions=self.interactions,
                    chat_template_kwargs=self.chat_template_kwargs, tool_runner=self.tool_runner,
                    **({"processor": self.processor} if self.processor is not None else {}),
                    **AGENT_LOOP_KWARGS.get(name, {}), **extra)

    def assemble(self, prompts: Batch, params: SamplingParams, outputs: list[AgentLoopOutput], names: list[str],
                 server: TurnServer) -> Batch:
        """verl's rollout Batch from the trajectories' outputs (row i is sample i % n of prompt i // n); the
        metrics read `server`'s counters (calls, batch_sizes, seconds)."""
        n = params.n
        own_prompts = False  # a loop that may change the prompt did (openai_agent): each row keeps its own
        for i, out in enumerate(outputs):
            expected = prompts["input_ids"][i // n][prompts["attention_mask"][i // n].bool()].tolist()
            if list(out.prompt_ids) != expected and getattr(AGENT_LOOPS.get(names[i // n]), "may_change_prompt", False):
                own_prompts = True
            elif list(out.prompt_ids) != expected:
                raise ValueError(f"agent loop {names[i // n]!r} returned prompt_ids that are not the prompt's token "
                                 "ids; an agent loop keeps the prompt as it came (token in, token out) and puts "
                                 "everything it adds into response_ids (with response_mask 0 where the model did "
                                 "not generate it)")
            if len(out.response_ids) != len(out.response_mask):
                raise ValueError(f"agent loop {names[i // n]!r} returned {len(out.response_ids)} response ids but "
                                 f"{len(out.response_mask)} mask entries")
        if own_prompts:  # one left-padded prompt per trajectory (the prompt repeated n times otherwise)
            rows, rows_params = prompts.repeat(n, interleave=True), dataclasses.replace(params, n=1)
            input_ids, prompt_mask = left_pad((o.prompt_ids for o in outputs), self.pad_token_id)
        else:
            rows, rows_params = prompts, params
            input_ids, prompt_mask = prompts["input_ids"].cpu(), prompts["attention_mask"].cpu()
        out_batch = rollout_batch(rows, input_ids, prompt_mask, rows_params, [o.response_ids for o in outputs],
                                  [o.response_logprobs for o in outputs], self.pad_token_id,
                                  model_masks=[o.response_mask for o in outputs])
        if any(o.multi_modal_inputs is not None for o in outputs):
            self._trajectory_images(out_batch, outputs)
        if self.multi_turn:
            out_batch["__num_turns__"] = np.array([o.num_turns for o in outputs], dtype=np.int64)
            infos = list(out_batch["extra_info"]) if "extra_info" in out_batch else [{} for _ in outputs]
            out_batch["extra_info"] = [self.trajectory_extra_info(info, o) for info, o in zip(infos, outputs)]
        if any(o.reward_score is not None for o in outputs):  # the loop scored its trajectory (verl's reward_score)
            out_batch["agent_reward"] = [None if o.reward_score is None else float(o.reward_score) for o in outputs]
        out_batch.meta.setdefault("metrics", {}).update(self._metrics(outputs, server))
        return out_batch

    def trajectory_extra_info(self, info, output: AgentLoopOutput):
        """The `extra_info` of a trajectory's row in the rollout Batch: the prompt's, and multi-turn also the
        loop's `extra_fields` and `num_turns` (what the reward function sees)."""
        if not self.multi_turn:
            return info
        return {**(info or {}), **output.extra_fields, "num_turns": output.num_turns}

    def _trajectory_images(self, batch: Batch, outputs: list[AgentLoopOutput]) -> None:
        """Rows whose trajectory gained images after the prompt (a tool returned one) take the trajectory's
        `multi_modal_inputs` / `multi_modal_data`, and M-RoPE positions over the whole sequence with every image
        (the response columns after the last token continue from its maximum, as `continue_positions` does)."""
        positions = batch["position_ids"]
        if positions.dim() != 3 or self.processor is None:
            raise ValueError("a trajectory returned images, but the policy is not a vision-language model (its rows "
                             "have no M-RoPE positions); only a vision-language model's tools can return images")
        tokens = self.processor.tokens
        inputs = list(batch["multi_modal_inputs"]) if "multi_modal_inputs" in batch else [None] * len(outputs)
        data = list(batch["multi_modal_data"]) if "multi_modal_data" in batch else [None] * len(outputs)
        for i, out in enumerate(outputs):
            if out.multi_modal_inputs is None:
                continue
            inputs[i], data[i] = out.multi_modal_inputs, out.multi_modal_data
            real = batch["attention_mask"][i].bool()
            ids = batch["input_ids"][i][real]
            row = positions[i].clone()
            row[:, real] = row_position_ids(tokens, ids, out.multi_modal_inputs)
            last = int(real.nonzero().max())
            after = row.shape[-1] - last - 1
            if after:
                row[:, last + 1:] = row[:, real].max(-1, keepdim=True).values + 1 + torch.arange(after)
            positions[i] = row
        batch["position_ids"] = positions
        batch["multi_modal_inputs"] = inputs
        batch["multi_modal_data"] = data

    @staticmethod
    def _tool_metrics(outputs: list[AgentLoopOutput]) -> dict[str, float]:
        metrics: dict[str, float] = {}
        counts = {key: np.array([o.metrics.get(key, 0) for o in outputs], dtype=float) for key in TOOL_COUNTERS}
        calls = counts["tool_calls"] + counts["malformed_calls"]
        # per-sample means (workers' values are averaged, so every count is a rate per sample)
        metrics["tool/calls_per_sample/mean"] = float(calls.mean())
        metrics["tool/calls_per_sample/max"] = float(calls.max())
        metrics["tool/samples_with_call"] = float((calls > 0).mean())
        if calls.sum() > 0:  # calls that parsed, named a tool and fit its schema, of all calls
            bad = counts["malformed_calls"] + counts["unknown_tools"] + counts["bad_arguments"]
            metrics["tool/well_formed_share"] = float(1.0 - bad.sum() / calls.sum())
        for key, name in (("malformed_calls", "tool/malformed_calls"), ("unknown_tools", "tool/unknown_tools"),
                          ("bad_arguments", "tool/bad_arguments"), ("tool_errors", "tool/errors"),
                          ("tool_timeouts", "tool/timeouts"), ("dropped_calls", "tool/dropped_calls")):
            metrics[f"{name}/mean"] = float(counts[key].mean())
        seconds = np.array([o.metrics.get("tool_seconds", 0.0) for o in outputs], dtype=float)
        metrics.update({"agent_loop/tool_calls/min": float(seconds.min()),
                        "agent_loop/tool_calls/max": float(seconds.max()),
                        "agent_loop/tool_calls/mean": float(seconds.mean())})
        return metrics

    def _metrics(self, outputs: list[AgentLoopOutput], server: TurnServer) -> dict[str, float]:
        metrics = {"agent_loop/engine_calls": float(server.calls),
                   "agent_loop/engine_batch/mean": float(np.mean(server.batch_sizes)) if server.batch_sizes else 0.0,
                   "agent_loop/engine_batch/max": float(max(server.batch_sizes, default=0)),
                   "timing_s/agent_loop_engine": server.seconds}
        if not self.multi_turn:
            return metrics
        turns = np.array([o.num_turns for o in outputs], dtype=float)
        metrics.update({"num_turns/min": float(turns.min()), "num_turns/max": float(turns.max()),
                        "num_turns/mean": float(turns.mean()),
                        "tool/stuck_threads": float(len(self.tool_runner.stuck_threads()))})
        # hyflow's tool calls, over the trajectories of loops that make them (tool_agent, env_agent): an
        # openai_agent runs its tools itself and reports openai/* instead
        tooled = [o for o in outputs if "tool_calls" in o.metrics]
        if tooled:
            metrics.update(self._tool_metrics(tooled))
        latencies = [x for o in outputs for x in o.metrics.get("tool_latencies", [])]
        if latencies:
            metrics["tool/latency_s/mean"] = float(np.mean(latencies))
            metrics["tool/latency_s/max"] = float(np.max(latencies))
        agents = [o for o in outputs if "openai_requests" in o.metrics]  # openai_agent (hyflow.rollout.openai_agent)
        for key in ("requests", "restarts", "refused", "errors") if agents else ():
            metrics[f"openai/{key}/mean"] = float(np.mean([o.metrics[f"openai_{key}"] for o in agents]))
        episodes = [o for o in outputs if "env_steps" in o.metrics]  # env_agent trajectories (hyflow.rollout.env_loop)
        if episodes:
            metrics["env/return/mean"] = float(np.mean([o.reward_score or 0.0 for o in episodes]))
            for key in ("env_steps", "env_errors", "env_timeouts", "env_seconds"):
                metrics[f"env/{key[len('env_'):]}/mean"] = float(np.mean([o.metrics[key] for o in episodes]))
            for key in sorted({k for o in episodes for k in o.metrics["env_info"]}):
                values = [o.metrics["env_info"][key] for o in episodes if key in o.metrics["env_info"]]
                metrics[f"env/{key}/mean"] = float(np.mean(values))
        return metrics
