#!/usr/bin/env python3
"""Per-tool-iteration overhead of a peer agent framework against Steward's rule model.

Drives one framework's most idiomatic tool-using agent against the fake OpenAI-compatible
model (`steward-rule-model`, streaming chat completions on loopback) in two scenarios:

- ``1-call``: prompt "hello there" -> one model call, no tool;
- ``4-tool``: prompt "check my tasks x4" -> four ``list_tasks`` calls (one per model turn),
  then the text answer: five model calls.

Every run is a fresh conversation. The agent, model client and HTTP connection pool are built
once, outside the timed region. Runs are sequential (one at a time) on one asyncio loop: first
``--warmup`` runs of each scenario, then ``--runs`` runs of each, the two scenarios alternating
so that drift hits both alike. A run is timed with ``time.perf_counter`` from just before the
agent is invoked until its stream is exhausted (the final answer is complete). Every run,
warm-up included, is verified: the final answer must equal the model's ANSWER and the agent
must have executed ``list_tasks`` exactly 0 / 4 times over exactly 1 / 5 model calls; any
failure exits non-zero with a message, and no numbers are printed.

stdout: exactly one JSON line; everything else goes to stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.metadata as md
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from typing import Awaitable, Callable

# Nothing may leave the machine: no LangSmith, no OpenAI trace export.
os.environ["LANGSMITH_TRACING"] = "false"
os.environ["LANGCHAIN_TRACING_V2"] = "false"
os.environ["OPENAI_AGENTS_DISABLE_TRACING"] = "1"

# The constant `ANSWER` of tests/src/rule_model.rs.
ANSWER = (
    "Here is what I found for you today and everything is in order so "
    "there is nothing else you need to do now."
)
TOOL_RESULT = '{"tasks": [], "count": 0}'
MODEL = "gpt-4o-mini"
API_KEY = "bench"
INSTRUCTIONS = "You are a helpful assistant."


@dataclass(frozen=True)
class Scenario:
    name: str
    prompt: str
    tool_calls: int
    model_calls: int


SCENARIOS = (
    Scenario("1-call", "hello there", tool_calls=0, model_calls=1),
    Scenario("4-tool", "check my tasks x4", tool_calls=4, model_calls=5),
)


@dataclass
class Outcome:
    """What one run did, as the framework reported it."""

    answer: str
    model_calls: int
    tool_results: int  # list_tasks results seen in the framework's stream


class BenchError(RuntimeError):
    pass


class Counter:
    """Counts the executions of the tool body itself (the ground truth)."""

    def __init__(self) -> None:
        self.n = 0


# A run: prompt -> outcome. Built once per framework; each call is a fresh conversation.
Runner = Callable[[str], Awaitable[Outcome]]


# ---------------------------------------------------------------------------------------------
# LangGraph
# ---------------------------------------------------------------------------------------------


def build_langgraph(base_url: str, counter: Counter, builder: str) -> Runner:
    from langchain_core.messages import AIMessageChunk, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    async def list_tasks() -> str:
        """List the user's open tasks."""
        counter.n += 1
        return TOOL_RESULT

    llm = ChatOpenAI(
        model=MODEL,
        base_url=base_url,
        api_key=API_KEY,
        streaming=True,
        use_responses_api=False,  # the fake serves chat completions only
        max_retries=0,  # a failure must surface, not be hidden by a retry
    )
    if builder == "create_agent":
        # The current recommendation: LangGraph's prebuilt create_react_agent is deprecated
        # since LangGraph 1.0 in favour of langchain.agents.create_agent (a LangGraph graph).
        from langchain.agents import create_agent

        agent = create_agent(llm, tools=[list_tasks], system_prompt=INSTRUCTIONS)
    else:
        import warnings

        from langgraph.prebuilt import create_react_agent

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # its deprecation notice, once, is not news
            agent = create_react_agent(llm, tools=[list_tasks], prompt=INSTRUCTIONS)

    async def run(prompt: str) -> Outcome:
        # stream_mode="messages": the token stream a chat UI consumes (LLM deltas plus the
        # tool messages), driven to the end.
        text: list[str] = []
        model_ids: list[str] = []
        tool_results = 0
        async for chunk, _meta in agent.astream(
            {"messages": [{"role": "user", "content": prompt}]}, stream_mode="messages"
        ):
            if isinstance(chunk, AIMessageChunk):
                if not model_ids or chunk.id != model_ids[-1]:
                    model_ids.append(chunk.id)  # a new model call: the answer so far was not final
                    text.clear()
                if isinstance(chunk.content, str):
                    text.append(chunk.content)
            elif isinstance(chunk, ToolMessage) and chunk.name == "list_tasks":
                tool_results += 1
        return Outcome("".join(text), len(model_ids), tool_results)

    return run


# ---------------------------------------------------------------------------------------------
# OpenAI Agents SDK
# ---------------------------------------------------------------------------------------------


def build_openai_agents(base_url: str, counter: Counter) -> Runner:
    from agents import (
        Agent,
        OpenAIChatCompletionsModel,
        Runner as AgentsRunner,
        function_tool,
        set_tracing_disabled,
    )
    from openai import AsyncOpenAI

    set_tracing_disabled(True)

    @function_tool
    async def list_tasks() -> str:
        """List the user's open tasks."""
        counter.n += 1
        return TOOL_RESULT

    client = AsyncOpenAI(base_url=base_url, api_key=API_KEY, max_retries=0)
    agent = Agent(
        name="Assistant",
        instructions=INSTRUCTIONS,
        model=OpenAIChatCompletionsModel(model=MODEL, openai_client=client),
        tools=[list_tasks],
    )

    async def run(prompt: str) -> Outcome:
        result = AgentsRunner.run_streamed(agent, input=prompt)
        tool_results = 0
        async for event in result.stream_events():
            if event.type == "run_item_stream_event" and event.name == "tool_output":
                tool_results += 1
        answer = result.final_output if isinstance(result.final_output, str) else ""
        return Outcome(answer, len(result.raw_responses), tool_results)

    return run


# ---------------------------------------------------------------------------------------------
# Measurement
# ---------------------------------------------------------------------------------------------


def percentile(samples: list[float], p: float) -> float:
    """Nearest-rank percentile: the smallest sample such that at least p% of the samples are
    less than or equal to it, i.e. sorted(samples)[ceil(p/100 * n) - 1]."""
    s = sorted(samples)
    rank = max(1, math.ceil(p / 100.0 * len(s)))
    return s[rank - 1]


async def one_run(run: Runner, counter: Counter, sc: Scenario, label: str) -> float:
    counter.n = 0
    t0 = time.perf_counter()
    try:
        out = await run(sc.prompt)
    except Exception as e:  # noqa: BLE001 - any failure of a run fails the bench
        raise BenchError(f"{label} {sc.name}: the agent raised {type(e).__name__}: {e}") from e
    elapsed = time.perf_counter() - t0
    problems = []
    if out.answer.strip() != ANSWER:
        problems.append(f"final answer {out.answer.strip()!r} is not ANSWER")
    if counter.n != sc.tool_calls:
        problems.append(f"list_tasks executed {counter.n} times, want {sc.tool_calls}")
    if out.tool_results != sc.tool_calls:
        problems.append(f"stream showed {out.tool_results} list_tasks results, want {sc.tool_calls}")
    if out.model_calls != sc.model_calls:
        problems.append(f"{out.model_calls} model calls, want {sc.model_calls}")
    if problems:
        raise BenchError(f"{label} {sc.name}: " + "; ".join(problems))
    return elapsed * 1000.0


async def bench(run: Runner, counter: Counter, runs: int, warmup: int) -> dict[str, list[float]]:
    for i in range(warmup):
        for sc in SCENARIOS:
            await one_run(run, counter, sc, f"warm-up {i + 1}")
    samples: dict[str, list[float]] = {sc.name: [] for sc in SCENARIOS}
    for i in range(runs):
        for sc in SCENARIOS:  # alternating: 1-call, 4-tool, 1-call, 4-tool, ...
            samples[sc.name].append(await one_run(run, counter, sc, f"run {i + 1}"))
    return samples


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--framework", required=True, choices=["langgraph", "openai-agents"])
    ap.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:PORT/v1")
    ap.add_argument("--runs", type=int, default=50, help="measured runs of each scenario")
    ap.add_argument("--warmup", type=int, default=5, help="unmeasured runs of each scenario")
    ap.add_argument(
        "--langgraph-builder",
        choices=["create_agent", "create_react_agent"],
        default="create_agent",
        help="langgraph only: langchain.agents.create_agent (the current recommendation, "
        "default) or the deprecated langgraph.prebuilt.create_react_agent",
    )
    args = ap.parse_args()
    if args.runs < 1 or args.warmup < 0:
        ap.error("--runs must be >= 1 and --warmup >= 0")

    real_stdout = sys.stdout
    counter = Counter()
    try:
        # Whatever a library prints must not corrupt the one JSON line.
        with contextlib.redirect_stdout(sys.stderr):
            t0 = time.perf_counter()
            if args.framework == "langgraph":
                run = build_langgraph(args.base_url, counter, args.langgraph_builder)
                pkg, variant = "langgraph", args.langgraph_builder
                versions = {p: md.version(p) for p in
                            ("langgraph", "langchain", "langchain-core", "langchain-openai", "openai")}
            else:
                run = build_openai_agents(args.base_url, counter)
                pkg, variant = "openai-agents", "Runner.run_streamed"
                versions = {p: md.version(p) for p in ("openai-agents", "openai")}
            t1 = time.perf_counter()
            samples = asyncio.run(bench(run, counter, args.runs, args.warmup))
            t2 = time.perf_counter()
    except BenchError as e:
        print(f"peer_bench: FAILED ({args.framework}): {e}", file=sys.stderr)
        return 1

    result: dict[str, object] = {
        "framework": args.framework,
        "version": md.version(pkg),
        "variant": variant,
        "runs": args.runs,
        "warmup": args.warmup,
    }
    for name, ms in samples.items():
        result[name] = {"p50_ms": round(percentile(ms, 50), 3), "p99_ms": round(percentile(ms, 99), 3)}
    result["per_iteration_ms"] = round(
        (percentile(samples["4-tool"], 50) - percentile(samples["1-call"], 50)) / 4, 3
    )
    result["versions"] = versions
    print(
        f"peer_bench: {args.framework} ({variant}): setup {t1 - t0:.2f}s, "
        f"{args.warmup}+{args.runs} runs of each scenario in {t2 - t1:.2f}s; "
        f"1-call min {min(samples['1-call']):.2f} ms, 4-tool min {min(samples['4-tool']):.2f} ms",
        file=sys.stderr,
    )
    print(json.dumps(result), file=real_stdout, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
