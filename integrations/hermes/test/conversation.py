"""Runs one Hermes conversation (run in the Hermes venv): AIAgent against the fake upstream at
argv[1], with HERMES_HOME's config.yaml enabling the ContextRender plugin. Prints the session id
and the final response as JSON on the last line. argv[2:]: the user messages, one turn each."""

import json
import logging
import sys

from run_agent import AIAgent

# The plugin's log (what was rendered, or why a request went unchanged) on stderr.
handler = logging.StreamHandler(sys.stderr)
handler.setFormatter(logging.Formatter("%(name)s %(levelname)s %(message)s"))
logging.getLogger("contextrender").addHandler(handler)
logging.getLogger("contextrender").setLevel(logging.INFO)

base_url, turns = sys.argv[1], sys.argv[2:]
agent = AIAgent(base_url=base_url, api_key="sk-test", provider="custom", api_mode="chat_completions", model="fake-model",
                enabled_toolsets=["file", "context_engine"], quiet_mode=True, skip_context_files=True, skip_memory=True, max_iterations=30,
                checkpoints_enabled=False)
history = None
final = None
for turn in turns:
    result = agent.run_conversation(turn, conversation_history=history)
    history = result.get("messages")
    final = result.get("final_response")
print(json.dumps({"session_id": agent.session_id, "final": final, "engine": agent.context_compressor.name,
                  "tools": sorted(t["function"]["name"] for t in agent.tools)}))
