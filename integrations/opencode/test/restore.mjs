// Calls the opencode plugin's contextrender_restore tool as opencode would: reads {"handle" or
// "query", "sessionID"} on stdin, builds the tool's argument schema the way opencode does (a zod object of
// the tool's `args`), runs `execute`, and prints {"output", "schema", "description"} on stdout.
import { pathToFileURL } from "node:url"
import { tool } from "@opencode-ai/plugin"

const [pluginPath] = process.argv.slice(2)
const { ContextRender } = await import(pathToFileURL(pluginPath).href)
let input = ""
for await (const chunk of process.stdin) input += chunk
const { handle, query, sessionID } = JSON.parse(input)
const hooks = await ContextRender({ client: null, project: null, directory: process.cwd(), worktree: process.cwd(), $: null })
const restore = hooks.tool.contextrender_restore
const z = tool.schema
const args = z.object(restore.args).parse(query === undefined ? { handle } : { query })
const context = { sessionID, messageID: "msg_restore", agent: "build", directory: process.cwd(), worktree: process.cwd(),
  abort: new AbortController().signal, metadata() {}, async ask() {} }
const output = await restore.execute(args, context)
process.stdout.write(JSON.stringify({ output, schema: z.toJSONSchema(z.object(restore.args)), description: restore.description }))
