// ContextRender for OpenClaw (2026.9.6): a context engine (`api.registerContextEngine`) that
// renders the history of every model call within a token budget through a running ContextRender
// server (`POST /walker/render_context`), and the `contextrender_restore` tool (`api.registerTool`,
// listed in openclaw.plugin.json's contracts.tools) that takes back a result a stub stands for.
//
// - assemble: OpenClaw's messages (user / assistant with toolCall parts / toolResult) become a
//   chat-completions list, the server renders it within B, and the render comes back as OpenClaw's
//   own message objects (unchanged ones as they were; an omitted result carries the stub; the fold
//   marker is a user message). B is the plugin's `budget`, else OpenClaw's tokenBudget for the call.
//   OpenClaw gives assemble its last view back before each model call of a run: `unview` sends
//   the messages that view was rendered from instead, so the server's history only grows.
// - The transcript contract (currentTurnFence + atomic idempotent commitTurn) is declared, so
//   OpenClaw does not bypass the engine. commitTurn writes nothing: the transcript OpenClaw keeps is
//   the source, and the next assemble's render ingests what the server has not seen (ingestion skips
//   what it holds), so a retried advancement key cannot store a turn twice.
// - ownsCompaction: OpenClaw's own compaction is off. compact (`/compact`, overflow) keeps the
//   transcript whole: every call is rendered within B anyway, so there is nothing to summarise away.
// - Fail open: every lifecycle method catches its errors (a throwing engine is quarantined):
//   assemble then returns OpenClaw's messages unchanged, the restore tool a sentence; both log a
//   warning.
//
// The restore tool is "direct-only": offered beside OpenClaw's tool search, not behind it.
//
// Sessions are named by OpenClaw's own session key (stable across transcript rotation), else its
// session id: `openclaw-<key>`.
//
// Settings: plugins.entries.contextrender.config {url, token, budget, selector, timeout}, or the
// environment: CONTEXTRENDER_URL (default http://127.0.0.1:8000), CONTEXTRENDER_TOKEN,
// CONTEXTRENDER_BUDGET, CONTEXTRENDER_SELECTOR, CONTEXTRENDER_TIMEOUT (seconds a call to the server
// may take, default 30: past it the call fails open, as with the server down).

export const RESTORE_TOOL = "contextrender_restore"
const RESTORE_DESCRIPTION =
  "Show again, complete, a tool result that ContextRender left out of this conversation " +
  "to fit its history budget. The placeholder that stands for the result names its handle."

function textOf(content) {
  if (typeof content === "string") return content
  if (!Array.isArray(content)) return ""
  return content.filter((p) => p?.type === "text" && typeof p.text === "string").map((p) => p.text).join("\n")
}

/** OpenClaw messages -> chat-completions messages (custom message kinds are not sent). */
export function toChat(messages) {
  const chat = []
  for (const message of messages) {
    const role = message?.role
    if (role === "user") chat.push({ role: "user", content: textOf(message.content) })
    else if (role === "assistant") {
      const parts = Array.isArray(message.content) ? message.content : []
      const calls = parts.filter((p) => p?.type === "toolCall")
      const reply = { role: "assistant", content: textOf(parts) }
      if (calls.length)
        reply.tool_calls = calls.map((c) => ({
          id: c.id,
          type: "function",
          function: { name: c.name, arguments: JSON.stringify(c.arguments ?? {}) },
        }))
      chat.push(reply)
    } else if (role === "toolResult") {
      chat.push({ role: "tool", tool_call_id: message.toolCallId, content: textOf(message.content) })
    }
  }
  return chat
}

function origins(messages) {
  // The OpenClaw message behind each chat message toChat makes, in order.
  const out = []
  for (const message of messages) for (const entry of toChat([message])) out.push({ message, entry })
  return out
}

const sameText = (a, b) => (a ?? "") === (b ?? "")
// The fold index opens with this (engine/notices.jac FOLD_INDEX_HEADING and its stored form): a
// user message of the render's own, sent apart after the selected results of folded turns.
const FOLD_INDEX_OPENING = "Results left out with them"
const isFoldIndex = (text) => typeof text === "string" && text.startsWith(FOLD_INDEX_OPENING)
const callIds = (m) => (m.tool_calls ?? []).map((c) => c.id)

/** The OpenClaw messages for a rendered chat list (messages are copied, never changed in place). */
export function fromChat(messages, rendered) {
  const origin = origins(messages)
  const toolAt = new Map(origin.filter((o) => o.entry.role === "tool").map((o) => [o.entry.tool_call_id, o]))
  const out = []
  let next = 0
  for (const r of rendered) {
    if (r.role === "system" || r.role === "developer") continue
    if (r.role === "tool") {
      const o = toolAt.get(r.tool_call_id)
      if (!o) continue
      const text = textOf(r.content)
      out.push(sameText(o.entry.content, text) ? o.message : { ...o.message, content: [{ type: "text", text }] })
      continue
    }
    const first = r.tool_calls?.[0]?.id
    let found = -1
    for (let k = next; k < origin.length; k++) {
      const e = origin[k].entry
      if (e.role !== r.role) continue
      if (first ? e.tool_calls?.[0]?.id === first : !e.tool_calls && sameText(e.content, textOf(r.content))) {
        found = k
        break
      }
    }
    if (found < 0 && r.role === "user" && (out.length === 0 || isFoldIndex(textOf(r.content)))) {
      // The fold marker (the oldest turns are left out), or the fold index after the folded results kept.
      out.push({ role: "user", content: textOf(r.content), timestamp: messages[0]?.timestamp ?? Date.now() })
      continue
    }
    if (found < 0) found = origin.findIndex((o, k) => k >= next && o.entry.role === r.role) // a cut text
    if (found < 0) continue
    next = found + 1
    const { message, entry } = origin[found]
    const text = textOf(r.content)
    if (sameText(entry.content, text) && callIds(entry).join() === callIds(r).join()) {
      out.push(message)
      continue
    }
    if (message.role === "user") {
      out.push({ ...message, content: text })
      continue
    }
    const kept = new Set(callIds(r))
    const keepText = sameText(entry.content, text)
    const parts = []
    let placed = false
    for (const part of message.content ?? []) {
      if (part?.type === "toolCall") {
        if (kept.has(part.id)) parts.push(part)
      } else if (part?.type === "text") {
        if (keepText) parts.push(part)
        else if (!placed && text) parts.push({ type: "text", text })
        placed = true
      } else if (keepText) parts.push(part) // thinking: only beside the text it came with
    }
    out.push({ ...message, content: parts })
  }
  return out
}

/** The rendered report from a jac-scale envelope: {ok, data: {reports: [report]}}. */
function report(body) {
  if (body && body.ok === false) throw new Error(`ContextRender: ${JSON.stringify(body.error ?? body)}`)
  const reports = body?.data?.reports ?? []
  const last = reports[reports.length - 1]
  if (!last) throw new Error("ContextRender: no report in the server's answer")
  return last
}

function settings(pluginConfig) {
  const env = globalThis.process?.env ?? {}
  const config = pluginConfig ?? {}
  const budget = Number.parseInt(String(config.budget ?? env.CONTEXTRENDER_BUDGET ?? ""), 10)
  return {
    url: String(config.url || env.CONTEXTRENDER_URL || "http://127.0.0.1:8000").replace(/\/+$/, ""),
    token: String(config.token || env.CONTEXTRENDER_TOKEN || ""),
    budget: Number.isFinite(budget) ? budget : null,
    selector: String(config.selector || env.CONTEXTRENDER_SELECTOR || "contextrender"),
    timeout: positive(config.timeout ?? env.CONTEXTRENDER_TIMEOUT, DEFAULT_TIMEOUT_S),
  }
}

const DEFAULT_TIMEOUT_S = 30

function positive(text, fallback) {
  const value = Number.parseFloat(String(text ?? ""))
  return Number.isFinite(value) && value > 0 ? value : fallback
}

export const sessionName = (key, id) => `openclaw-${key || id}`

/** What one assemble answered: the chat entries of the messages it returned (`view`), and the
 *  OpenClaw messages they were rendered from (`source`). */
export const viewOf = (source, returned) => ({ view: toChat(returned).map((e) => JSON.stringify(e)), source })

/** The history to render for `messages`. OpenClaw (2026.9.6) gives an engine that owns compaction
 *  its own last answer back: the run's first assemble replaces the agent's messages with the view
 *  it returned, and the tool loop assembles again from them before every model call. Sent as they
 *  are, the stubs and the fold marker would be a rewritten history (a fork: every result stored
 *  again under a new handle, the handles the model was shown off the live chain). So a leading run
 *  of `messages` equal, as chat entries, to the last view is replaced by the messages that view was
 *  rendered from; anything else (the transcript at a run's start) is sent as it is. */
export function unview(messages, last) {
  if (!last || last.view.length === 0) return messages
  let seen = 0
  for (let k = 0; k < messages.length; k++) {
    for (const entry of toChat([messages[k]])) if (seen >= last.view.length || JSON.stringify(entry) !== last.view[seen++]) return messages
    if (seen === last.view.length) return [...last.source, ...messages.slice(k + 1)]
  }
  return messages
}
const VIEWS_KEPT = 256 // sessions whose last view this process remembers

/** The context engine and the restore tool, bound to one server. */
export function createContextRender(pluginConfig, log = console) {
  const s = settings(pluginConfig)
  // A server that takes the connection and never answers would hold OpenClaw's model call for
  // good (Node's fetch does not give up on its own): past `timeout` the call fails (fail-open).
  const post = async (walker, payload) => {
    const signal = AbortSignal.timeout(s.timeout * 1000)
    let response, body
    try {
      response = await fetch(`${s.url}/walker/${walker}`, {
        method: "POST",
        headers: { "content-type": "application/json", ...(s.token ? { authorization: `Bearer ${s.token}` } : {}) },
        body: JSON.stringify(payload),
        signal,
      })
      body = await response.json().catch((error) => { if (signal.aborted) throw error; return null })
    } catch (error) {
      if (error?.name === "TimeoutError" || error?.name === "AbortError")
        throw new Error(`no answer from ${s.url} within ${s.timeout} s (CONTEXTRENDER_TIMEOUT)`)
      throw error
    }
    if (!response.ok) {
      const error = new Error(`HTTP ${response.status}: ${JSON.stringify(body?.error ?? body)}`)
      error.code = body?.error?.code
      throw error
    }
    return report(body)
  }
  const committed = new Map() // session -> advancement keys seen by this process
  const views = new Map() // session -> the last assemble's viewOf
  const remember = (session, view) => {
    views.delete(session)
    views.set(session, view)
    if (views.size > VIEWS_KEPT) views.delete(views.keys().next().value)
  }

  const engine = {
    info: {
      id: "contextrender",
      name: "ContextRender",
      version: "0.1.0",
      ownsCompaction: true,
      acceptedHostParams: ["sessionKey"],
      transcriptSemantics: {
        currentTurnFence: "before-current-turn-entry-v1",
        turnAdvancementIdempotency: "atomic-idempotent-v1",
      },
    },
    async ingest() {
      // Stored at the next assemble (the render ingests what the server has not seen).
      return { ingested: false }
    },
    async assemble({ sessionId, sessionKey, messages: given, tokenBudget }) {
      const session = sessionName(sessionKey, sessionId)
      const budget = Math.min(s.budget ?? tokenBudget ?? 6000, tokenBudget ?? Infinity)
      let messages = given
      try {
        messages = unview(given, views.get(session))
        const chat = toChat(messages)
        if (chat.length === 0) return { messages: given, estimatedTokens: 0 }
        const rendered = await post("render_context", { session_id: session, messages: chat, budget, selector: s.selector })
        if (!Array.isArray(rendered?.messages)) throw new Error("ContextRender: no rendered messages in the server's answer")
        const out = fromChat(messages, rendered.messages)
        remember(session, viewOf(messages, out))
        return { messages: out, estimatedTokens: rendered.history_tokens ?? 0 }
      } catch (error) {
        try {
          remember(session, viewOf(messages, given)) // the next call, given this, sends `messages`
        } catch {
          views.delete(session)
        }
        log.warn(`contextrender: history sent unchanged for ${session} (${error?.message ?? error})`)
        return { messages: given, estimatedTokens: 0, promptAuthority: "preassembly_may_overflow" }
      }
    },
    async commitTurn({ advancementKey, sessionId, sessionKey }) {
      const session = sessionName(sessionKey, sessionId)
      const keys = committed.get(session) ?? new Set()
      committed.set(session, keys)
      if (keys.has(advancementKey)) return { status: "duplicate" }
      keys.add(advancementKey)
      return { status: "committed" }
    },
    async compact({ tokenBudget }) {
      return {
        ok: true,
        compacted: false,
        reason: `ContextRender renders every call within its budget (${s.budget ?? tokenBudget ?? "the call's"} tokens); the transcript stays whole`,
      }
    },
  }

  async function restore(session, handle) {
    if (typeof handle !== "string" || !handle) return `${RESTORE_TOOL} needs a handle, such as {"handle": "r17"}: the placeholder names it.`
    try {
      const restored = await post("restore_result", { session_id: session, handle })
      return textOf(restored?.message?.content)
    } catch (error) {
      if (error.code === "UNKNOWN_RESULT" || error.code === "UNKNOWN_SESSION")
        return `There is no stored result with handle "${handle}" in this conversation: use a handle a placeholder names.`
      if (error.code === "INVALID_REQUEST") return `${RESTORE_TOOL} could not read handle "${handle}": ${error.message}`
      log.warn(`contextrender: restore of ${handle} in ${session} failed (${error?.message ?? error})`)
      return `ContextRender could not restore "${handle}" now; go on without it.`
    }
  }

  /** OpenClaw's tool factory: one tool per run, bound to the run's session. */
  const restoreTool = (ctx) => ({
    name: RESTORE_TOOL,
    label: "Restore an omitted result",
    // Offered to the model beside OpenClaw's tool search, not in its catalog: the stubs name this
    // tool, and a model that has to search for it first seldom calls it.
    catalogMode: "direct-only",
    description: RESTORE_DESCRIPTION,
    parameters: {
      type: "object",
      properties: { handle: { type: "string", description: "The handle the placeholder names, such as r17." } },
      required: ["handle"],
      additionalProperties: false,
    },
    async execute(_toolCallId, params) {
      const text = await restore(sessionName(ctx?.sessionKey, ctx?.sessionId), params?.handle)
      return { content: [{ type: "text", text }], details: { handle: params?.handle ?? null } }
    },
  })

  return { engine, restoreTool, restore }
}

/** The plugin entry OpenClaw loads (openclaw.plugin.json, package.json "openclaw.extensions"). */
export default function register(api) {
  const { engine, restoreTool } = createContextRender(api.pluginConfig, api.logger ?? console)
  api.registerContextEngine("contextrender", () => engine)
  api.registerTool(restoreTool, { name: RESTORE_TOOL })
}
