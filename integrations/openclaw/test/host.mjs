// Drives the plugin as OpenClaw's host calls it: loads the entry with an `api` that records what it
// registers, then runs the operations read on stdin ({"ops": [...]}) in order, printing their
// results as JSON: {"op": "assemble", sessionId, sessionKey, messages, tokenBudget},
// {"op": "commitTurn", ...}, {"op": "compact", ...}, {"op": "restore", sessionKey, sessionId, handle}.
// An assemble with "afterView": true is given the messages the last assemble returned, then its
// own `messages` (as OpenClaw's tool loop assembles again from the view the run started with).
import { pathToFileURL } from "node:url"

const [pluginPath] = process.argv.slice(2)
const plugin = await import(pathToFileURL(pluginPath).href)
const registered = { engines: {}, tools: [] }
const warnings = []
const api = {
  pluginConfig: process.env.CONTEXTRENDER_PLUGIN_CONFIG ? JSON.parse(process.env.CONTEXTRENDER_PLUGIN_CONFIG) : undefined,
  logger: { warn: (m) => warnings.push(String(m)), info() {}, error: (m) => warnings.push(String(m)), debug() {} },
  registerContextEngine: (id, factory) => (registered.engines[id] = factory),
  registerTool: (tool, opts) => registered.tools.push({ tool, opts }),
}
plugin.default(api)
let input = ""
for await (const chunk of process.stdin) input += chunk
const { ops } = JSON.parse(input)
const engine = await registered.engines.contextrender({ config: {}, agentDir: process.cwd(), workspaceDir: process.cwd() })
const results = []
let view = []
for (const op of ops) {
  if (op.op === "assemble") {
    const messages = op.afterView ? [...view, ...(op.messages ?? [])] : op.messages
    const out = await engine.assemble({ ...op, messages })
    view = out.messages
    results.push({ ...out, chat: plugin.toChat(out.messages), sent: plugin.toChat(messages) })
  } else if (op.op === "commitTurn") results.push(await engine.commitTurn(op))
  else if (op.op === "compact") results.push(await engine.compact(op))
  else if (op.op === "restore") {
    const factory = registered.tools[0].tool
    const tool = factory({ sessionKey: op.sessionKey, sessionId: op.sessionId })
    results.push({ result: await tool.execute("call_restore", { handle: op.handle }), name: tool.name, parameters: tool.parameters })
  }
}
process.stdout.write(JSON.stringify({ info: engine.info, tools: registered.tools.map((t) => t.opts), results, warnings }))
