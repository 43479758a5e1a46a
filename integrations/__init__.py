"""ContextRender inside agent frameworks, imported as `contextrender_integrations`: a LangChain
middleware (`.langchain`), an OpenAI Agents SDK model-input filter (`.openai_agents`). The Node
integrations (opencode, OpenClaw) are npm package folders beside these (docs/integrations.md)."""
