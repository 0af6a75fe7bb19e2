"""A CrewAI crew (researcher -> writer -> editor) on a running ``kvcmas serve`` gateway.

    kvcmas serve --port 8000 &                       # one engine, reuse=kvcmas by default
    pip install crewai                               # CrewAI is not in kvcmas-agents' extras
    python examples/crewai_gateway.py --base-url http://127.0.0.1:8000/v1 [--api-key KEY]

CrewAI talks plain OpenAI HTTP; nothing kvcmas-specific is imported. Each agent's LLM sends an
``X-KVCMAS-Agent`` header so the gateway accounts its requests to that agent, and one
``X-KVCMAS-Session`` header for the crew. At the end the script prints the gateway's per-agent table
from ``/v1/kvcmas/stats``: "reused" counts prompt tokens whose KV came from another agent's requests.
"""
from __future__ import annotations

import argparse
import json
import os
import urllib.request

os.environ.setdefault("CREWAI_DISABLE_TELEMETRY", "true")
os.environ.setdefault("OTEL_SDK_DISABLED", "true")

from crewai import LLM, Agent, Crew, Process, Task  # noqa: E402

ROLES = {
    "researcher": ("Researcher", "Collect three short facts about the topic.",
                   "You find facts quickly and list them plainly."),
    "writer": ("Writer", "Turn the facts into one short paragraph.", "You write clear, short prose."),
    "editor": ("Editor", "Tighten the paragraph and fix any mistake.", "You are a careful, terse editor."),
}
TOPIC = "lighthouses"


def llm_for(agent: str, args: argparse.Namespace) -> LLM:
    return LLM(model=f"openai/{args.model}", base_url=args.base_url, api_key=args.api_key, custom_openai=True,
               temperature=0, max_tokens=args.max_tokens,
               default_headers={"X-KVCMAS-Agent": agent, "X-KVCMAS-Session": "crewai-example"})


def gateway_stats(args: argparse.Namespace) -> dict:
    req = urllib.request.Request(args.base_url.rstrip("/") + "/kvcmas/stats",
                                 headers={"Authorization": f"Bearer {args.api_key}"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.load(r)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--api-key", default=os.environ.get("KVCMAS_API_KEY", "none"))
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()

    agents = {name: Agent(role=role, goal=goal, backstory=story, llm=llm_for(name, args), max_iter=2,
                          allow_delegation=False, verbose=False)
              for name, (role, goal, story) in ROLES.items()}
    research = Task(description=f"List three facts about {TOPIC}.", expected_output="Three short facts.",
                    agent=agents["researcher"])
    write = Task(description=f"Write one paragraph about {TOPIC} from the facts.",
                 expected_output="One paragraph.", agent=agents["writer"], context=[research])
    edit = Task(description="Edit the paragraph.", expected_output="The edited paragraph.",
                agent=agents["editor"], context=[research, write])
    crew = Crew(agents=list(agents.values()), tasks=[research, write, edit], process=Process.sequential)
    result = crew.kickoff()
    for task in result.tasks_output:
        print(f"--- {task.agent}\n{task.raw}\n")

    stats = gateway_stats(args)
    print(f"gateway engine: {stats['engine']['model']}, reuse={stats['engine']['reuse']}")
    print(f"{'agent':<12}{'requests':>9}{'prompt':>8}{'cached':>8}{'reused':>8}{'recomputed':>11}")
    for name in ROLES:
        a = stats["agents"].get(name, {})
        print(f"{name:<12}{int(a.get('requests', 0)):>9}{int(a.get('prompt_tokens', 0)):>8}"
              f"{int(a.get('cached_tokens', 0)):>8}{int(a.get('reused_tokens', 0)):>8}"
              f"{int(a.get('recomputed_tokens', 0)):>11}")


if __name__ == "__main__":
    main()
