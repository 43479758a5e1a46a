// ContextRender for opencode: before each model call, the session's history is rendered within a
// token budget by a ContextRender server (`POST /walker/render_context`), through opencode's
// `experimental.chat.messages.transform` hook; the `contextrender_restore` tool (opencode's `tool`
// hook) lets the model take back a result a stub stands for (`POST /walker/restore_result`).
//
// Install: copy this file to a project's `.opencode/plugin/` (or `~/.config/opencode/plugin/`);
// opencode loads it from there and installs @opencode-ai/plugin into `.opencode/` itself. Do not
// list the package under "plugin" in opencode.json: opencode 1.18 fetches a name listed there from
// the npm registry, where it is not published (docs/integrations.md). The folder's package.json
// and lock file are what the tests install.
// Switch opencode's own context management off, so that ContextRender is the only thing deciding
// what the model sees:
//
//   { "compaction": { "auto": false, "prune": false } }
//
// Settings (environment): CONTEXTRENDER_URL (default http://127.0.0.1:8000), CONTEXTRENDER_TOKEN
// (a bearer token from the server's login), CONTEXTRENDER_BUDGET (tokens, default 6000),
// CONTEXTRENDER_SELECTOR (default "contextrender"), CONTEXTRENDER_TIMEOUT (seconds a call to the server
// may take, default 30).
//
// Fail-open: if the server cannot be reached, does not answer in time or answers an error, the
// history goes unchanged; a restore then answers the model with a sentence that says so. Both are
// logged (console.warn).
//
// opencode calls every function a plugin module exports, so only the plugin is exported; its
// helpers hang off it (ContextRender.toChat, .parseRender, .applyRender) for tests.

import { tool } from "@opencode-ai/plugin"

// The tool the engine's stubs name (engine/notices.jac RESTORE_TOOL) and its description.
const RESTORE_TOOL = "contextrender_restore"
// The fold index opens with this (engine/notices.jac FOLD_INDEX_HEADING and its stored form): a
// user message of the render's own, sent apart after the selected results of folded turns.
const FOLD_INDEX_OPENING = "Results left out with them"
const isFoldIndex = (content) => typeof content === "string" && content.startsWith(FOLD_INDEX_OPENING)
// The fold marker opens with this (engine/notices.jac FOLD_MARKER_OPENING):
// it follows the task, which the render keeps above it, or comes first.
const FOLD_MARKER_OPENING = "[ContextRender: the oldest messages of this conversation are left out"
const isFoldMarker = (content) => typeof content === "string" && content.startsWith(FOLD_MARKER_OPENING)
const RESTORE_DESCRIPTION =
  "Show again, complete, a tool result that ContextRender left out of this conversation " +
  "to fit its history budget. The placeholder that stands for the result names its handle."

/** opencode messages ({info, parts}) -> OpenAI chat-completions messages, as ContextRender stores them. */
function toChat(messages) {
  const chat = []
  for (const message of messages) {
    const role = message.info?.role
    const parts = message.parts ?? []
    const text = parts
      .filter((p) => p.type === "text" && !p.ignored && typeof p.text === "string")
      .map((p) => p.text)
      .join("\n")
    if (role === "user") {
      chat.push({ role: "user", content: text })
      continue
    }
    if (role !== "assistant") continue
    const done = parts.filter((p) => p.type === "tool" && (p.state?.status === "completed" || p.state?.status === "error"))
    if (!text && done.length === 0) continue
    const reply = { role: "assistant", content: text }
    if (done.length) {
      reply.tool_calls = done.map((p) => ({
        id: p.callID,
        type: "function",
        function: { name: p.tool, arguments: JSON.stringify(p.state.input ?? {}) },
      }))
    }
    chat.push(reply)
    for (const p of done) {
      const content = p.state.status === "completed" ? String(p.state.output ?? "") : `Error: ${p.state.error ?? ""}`
      chat.push({ role: "tool", tool_call_id: p.callID, content })
    }
  }
  return chat
}

/** The rendered message list from the server's answer to POST /walker/render_context.
 *  The jac-scale envelope (checked against a real server by tests/test_integrations.py):
 *  {"ok": true, "data": {"result": {...}, "reports": [RenderResult]}},
 *  the RenderResult as an object with `messages`. */
function parseRender(body) {
  if (body && body.ok === false) throw new Error(`ContextRender: ${JSON.stringify(body.error ?? body)}`)
  const data = body?.data ?? body
  const reports = data?.reports ?? data?.result?.reports ?? []
  const report = reports.length ? reports[reports.length - 1] : data?.result
  const messages = Array.isArray(report) ? report : report?.messages
  if (!Array.isArray(messages)) throw new Error("ContextRender: no rendered messages in the server's answer")
  return messages
}

function sameText(a, b) {
  return (a ?? "") === (b ?? "")
}

/** Rebuild opencode's message list from the rendered history: results kept, replaced by their stub
 *  or compacted, or dropped with their call; folded turns removed, the fold marker added as a
 *  synthetic user message; cut texts replaced. Messages are copied, never changed in place. */
function applyRender(messages, rendered) {
  // The opencode message behind each non-tool chat message, in order.
  const origin = []
  for (const message of messages) {
    for (const entry of toChat([message])) if (entry.role !== "tool") origin.push({ message, entry })
  }
  const results = new Map()
  for (const m of rendered) if (m.role === "tool") results.set(m.tool_call_id, m.content)
  const out = []
  let next = 0
  for (const r of rendered) {
    if (r.role === "tool" || r.role === "system" || r.role === "developer") continue
    const firstCall = r.tool_calls?.[0]?.id
    let found = -1
    for (let k = next; k < origin.length; k++) {
      const e = origin[k].entry
      if (e.role !== r.role) continue
      if (firstCall ? e.tool_calls?.[0]?.id === firstCall : sameText(e.content, r.content)) {
        found = k
        break
      }
    }
    if (r.role === "user" && (isFoldMarker(r.content) || (found < 0 && (out.length === 0 || isFoldIndex(r.content))))) {
      // The fold marker (older turns left out), or the fold index after the folded results kept.
      out.push(marker(messages, r.content, isFoldIndex(r.content) ? "contextrender-index" : "contextrender"))
      continue
    }
    if (found < 0) found = origin.findIndex((o, k) => k >= next && o.entry.role === r.role) // a cut text
    if (found < 0) continue
    next = found + 1
    out.push(rebuild(origin[found].message, r, results))
  }
  return out
}

function marker(messages, text, suffix) {
  const first = messages.find((m) => m.info?.role === "user") ?? messages[0]
  const id = `${first.info.id}-${suffix}`
  return {
    info: { ...first.info, id },
    parts: [{ id: `${id}-text`, sessionID: first.info.sessionID, messageID: id, type: "text", text: String(text ?? ""), synthetic: true }],
  }
}

function rebuild(message, r, results) {
  const original = toChat([message]).find((e) => e.role !== "tool")
  const keepText = sameText(original.content, r.content)
  const parts = []
  let textPlaced = false
  for (const part of message.parts ?? []) {
    if (part.type === "text" && !part.ignored) {
      if (keepText) parts.push(part)
      else if (!textPlaced && r.content) parts.push({ ...part, text: String(r.content) })
      textPlaced = true
      continue
    }
    if (part.type === "tool" && (part.state?.status === "completed" || part.state?.status === "error")) {
      if (!results.has(part.callID)) continue // dropped with its call, or in a folded turn
      const content = results.get(part.callID)
      const current = part.state.status === "completed" ? String(part.state.output ?? "") : `Error: ${part.state.error ?? ""}`
      // Its arguments as rendered: a call over results of a folded turn may be cut.
      const shown = (r.tool_calls ?? []).find((c) => c.id === part.callID)?.function?.arguments
      const cut = shown !== undefined && shown !== JSON.stringify(part.state.input ?? {})
      if (content === current && !cut) parts.push(part)
      else {
        const state = content === current ? part.state : { ...part.state, status: "completed", output: String(content) }
        parts.push({ ...part, state: cut ? { ...state, input: JSON.parse(shown || "{}") } : state })
      }
      continue
    }
    if (part.type === "reasoning" && !keepText && !r.content) continue
    parts.push(part)
  }
  return { info: message.info, parts }
}

/** The restored result's text from the server's answer to POST /walker/restore_result. */
function parseRestore(body) {
  const reports = body?.data?.reports ?? []
  const message = reports[reports.length - 1]?.message
  if (!message) throw new Error("ContextRender: no restored result in the server's answer")
  const content = message.content
  if (typeof content === "string") return content
  if (Array.isArray(content)) return content.map((p) => (typeof p?.text === "string" ? p.text : "")).join("\n")
  return String(content ?? "")
}

/** The `contextrender_restore` tool: asks the server for the stored result of the session's
 *  handle, or (given a `query` instead) for the handles of the stored results that match it; every
 *  failure is a sentence for the model, never a thrown error. */
function restoreTool(post) {
  return tool({
    description: RESTORE_DESCRIPTION,
    args: {
      handle: tool.schema.string().optional().describe("The handle the placeholder names, such as r17."),
      query: tool.schema.string().optional().describe(
        "Instead of a handle: words or values the result held (a file name, a command, an error). " +
        "Answers the best matching handles, one line each, to restore by handle."),
    },
    async execute(args, context) {
      const session_id = `opencode-${context.sessionID}`
      const handle = typeof args?.handle === "string" ? args.handle.trim() : ""
      const query = typeof args?.query === "string" ? args.query.trim() : ""
      if (!handle && !query)
        return `${RESTORE_TOOL} needs a handle, such as {"handle": "r17"} (the placeholder names it), or a "query".`
      const asked = handle || query
      try {
        const response = await post(handle ? "restore_result" : "search_results", handle ? { session_id, handle } : { session_id, query })
        const body = await response.json().catch(() => null)
        const code = body?.error?.code
        if (handle && (code === "UNKNOWN_RESULT" || code === "UNKNOWN_SESSION"))
          return `There is no stored result with handle "${handle}" in this conversation: use a handle a placeholder names.`
        if (!handle && code === "UNKNOWN_SESSION") return `There are no stored results in this conversation to search.`
        if (code === "INVALID_REQUEST") return `${RESTORE_TOOL} could not read "${asked}": ${body.error.message ?? ""}`
        if (!response.ok) throw new Error(`HTTP ${response.status}: ${JSON.stringify(body)}`)
        if (handle) return parseRestore(body)
        const reports = body?.data?.reports ?? []
        const text = reports[reports.length - 1]?.text
        if (typeof text !== "string") throw new Error("ContextRender: no search answer in the server's reply")
        return text
      } catch (error) {
        console.warn(`contextrender: ${handle ? "restore of" : "search for"} ${asked} failed (${error?.message ?? error})`)
        return `ContextRender could not ${handle ? "restore" : "search for"} "${asked}" now; go on without it.`
      }
    },
  })
}

// Seconds a call to the server may take, headers and body (CONTEXTRENDER_TIMEOUT).
const DEFAULT_TIMEOUT_S = 30

function seconds(text, fallback) {
  const value = Number.parseFloat(text ?? "")
  return Number.isFinite(value) && value > 0 ? value : fallback
}

export const ContextRender = async () => {
  const env = globalThis.process?.env ?? {}
  const url = (env.CONTEXTRENDER_URL || "http://127.0.0.1:8000").replace(/\/+$/, "")
  const token = env.CONTEXTRENDER_TOKEN || ""
  const budget = Number.parseInt(env.CONTEXTRENDER_BUDGET || "6000", 10)
  const selector = env.CONTEXTRENDER_SELECTOR || "contextrender"
  const timeout = seconds(env.CONTEXTRENDER_TIMEOUT, DEFAULT_TIMEOUT_S)
  // A server that takes the connection and never answers would hold opencode's model call
  // forever (neither Bun's fetch nor Node's gives up on its own before minutes): past `timeout`
  // the call fails, so the history goes unchanged (fail-open).
  const post = async (walker, payload) => {
    try {
      return await fetch(`${url}/walker/${walker}`, {
        method: "POST",
        headers: { "content-type": "application/json", ...(token ? { authorization: `Bearer ${token}` } : {}) },
        body: JSON.stringify(payload),
        signal: AbortSignal.timeout(timeout * 1000),
      })
    } catch (error) {
      if (error?.name === "TimeoutError" || error?.name === "AbortError")
        throw new Error(`no answer from ${url} within ${timeout} s (CONTEXTRENDER_TIMEOUT)`)
      throw error
    }
  }
  return {
    tool: { [RESTORE_TOOL]: restoreTool(post) },
    "experimental.chat.messages.transform": async (_input, output) => {
      const messages = output.messages
      const sessionID = messages.find((m) => m.info?.sessionID)?.info.sessionID
      if (!sessionID || messages.length === 0) return
      try {
        const response = await post("render_context", { session_id: `opencode-${sessionID}`, messages: toChat(messages), budget, selector })
        const body = await response.json().catch(() => null)
        if (!response.ok) throw new Error(`HTTP ${response.status}: ${JSON.stringify(body)}`)
        const rendered = applyRender(messages, parseRender(body))
        messages.splice(0, messages.length, ...rendered) // opencode keeps its reference to this array
      } catch (error) {
        console.warn(`contextrender: history sent unchanged (${error?.message ?? error})`)
      }
    },
  }
}

ContextRender.toChat = toChat
ContextRender.parseRender = parseRender
ContextRender.applyRender = applyRender
ContextRender.parseRestore = parseRestore
