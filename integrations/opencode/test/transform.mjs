// Runs the opencode plugin's transform hook as opencode would: reads {"messages": [...]} (opencode's
// {info, parts} shape) on stdin, calls the hook (which posts to $CONTEXTRENDER_URL), and prints
// {"messages": <transformed>, "chat": <toChat of them>, "sent": <toChat of the input>} on stdout.
import { pathToFileURL } from "node:url"

const [pluginPath] = process.argv.slice(2)
const { ContextRender } = await import(pathToFileURL(pluginPath).href)
let input = ""
for await (const chunk of process.stdin) input += chunk
const output = JSON.parse(input)
const sent = ContextRender.toChat(output.messages)
const hooks = await ContextRender({ client: null, project: null, directory: process.cwd(), worktree: process.cwd(), $: null })
const array = output.messages
await hooks["experimental.chat.messages.transform"]({}, output)
if (output.messages !== array) throw new Error("the hook must change opencode's array in place")
process.stdout.write(JSON.stringify({ messages: output.messages, chat: ContextRender.toChat(output.messages), sent }))
