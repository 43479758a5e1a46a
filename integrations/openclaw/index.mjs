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
// - The current turn: OpenClaw hands assemble only the messages from before the turn's prompt and
//   appends the turn's own (the prompt, the model's calls and their results) unrendered. So, with a
//   plugin budget B, a tool-result middleware (`api.registerAgentToolResultMiddleware`, runtime
//   "openclaw") keeps the turn's results within TURN_RESULTS of B: a result that fits is kept
//   whole, one that does not is cut to the room left, or stubbed, under a turn handle
//   ("turn:<call id>") that the restore tool answers; the original is kept in a file of OpenClaw's
//   state folder (OpenClaw hands an engine no result's details), and the next turns' assemble sends it to
//   the server in the note's place, so the server stores the result itself. A restore's
//   answer comes whole (as the proxy's restore rounds): assemble renders the history before the
//   turn within B less the turn's own calls and results (estimated), restores included, so every
//   model call of the turn stays within B while the turn's own messages do.
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
// The share of B the current turn's tool results may take (restores aside: their answers come
// whole, as the proxy's restore rounds do; the history before the turn makes room for them).
export const TURN_RESULTS = 1 / 3
// Below this room (estimated tokens) a result that does not fit is a stub only, not cut.
const MIN_CUT = 48
const TURN_HANDLE = /^turn:(.+)$/
// A turn note's handle, as turnNote writes it (a note standing alone or after a cut's start).
const TURN_NOTE = /\[ContextRender: (?:the rest of )?this .* result \(about [0-9]+ tokens\) is left out to fit the history budget\. To see it in full, call contextrender_restore with handle "(turn:[^"]+)"\.\]$/
/** A token estimate a little above tiktoken's (o200k_base) for identifiers and numbers, the dense
 *  case (a file of `counter_3_7 = 126` rows is 2.2 characters a token), and above it for prose:
 *  a word counts a token per 6 letters, a number one per 3 digits, any other character one. */
const PIECES = /[A-Za-z]+|[0-9]+|\n+|[^\sA-Za-z0-9]/g
export function estimateTokens(text) {
  let tokens = 0
  for (const [piece] of String(text ?? "").matchAll(PIECES)) {
    const first = piece.charCodeAt(0)
    tokens += first >= 48 && first <= 57 ? Math.ceil(piece.length / 3) : /[A-Za-z]/.test(piece[0]) ? Math.ceil(piece.length / 6) : 1
  }
  return Math.ceil(tokens * 1.1)
}

/** The longest start of `text` whose estimate is at most `tokens`. */
function headOf(text, tokens) {
  let end = Math.floor((text.length * tokens) / Math.max(1, estimateTokens(text)))
  while (end > 0 && estimateTokens(text.slice(0, end)) > tokens) end = Math.floor(end * 0.9)
  return text.slice(0, end)
}
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
// The fold marker opens with this (engine/notices.jac FOLD_MARKER_OPENING): it follows the task,
// which the render keeps above it, or comes first.
const FOLD_MARKER_OPENING = "[ContextRender: the oldest messages of this conversation are left out"
const isFoldMarker = (text) => typeof text === "string" && text.startsWith(FOLD_MARKER_OPENING)
// A call as rendered: its id and arguments (a call over results of a folded turn may be cut).
const callsOf = (m) => (m.tool_calls ?? []).map((c) => `${c.id}\u0000${c.function?.arguments ?? ""}`)

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
    if (r.role === "user" && (isFoldMarker(textOf(r.content)) || (found < 0 && (out.length === 0 || isFoldIndex(textOf(r.content)))))) {
      // The fold marker (the oldest turns are left out), or the fold index after the folded results kept.
      out.push({ role: "user", content: textOf(r.content), timestamp: messages[0]?.timestamp ?? Date.now() })
      continue
    }
    if (found < 0) found = origin.findIndex((o, k) => k >= next && o.entry.role === r.role) // a cut text
    if (found < 0) continue
    next = found + 1
    const { message, entry } = origin[found]
    const text = textOf(r.content)
    if (sameText(entry.content, text) && callsOf(entry).join() === callsOf(r).join()) {
      out.push(message)
      continue
    }
    if (message.role === "user") {
      out.push({ ...message, content: text })
      continue
    }
    const kept = new Map((r.tool_calls ?? []).map((c) => [c.id, c.function?.arguments]))
    const keepText = sameText(entry.content, text)
    const parts = []
    let placed = false
    for (const part of message.content ?? []) {
      if (part?.type === "toolCall") {
        if (!kept.has(part.id)) continue
        const shown = kept.get(part.id)
        parts.push(shown === JSON.stringify(part.arguments ?? {}) ? part : { ...part, arguments: JSON.parse(shown || "{}") })
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

/** What stands for a result of the current turn that does not fit: its first `shown` characters
 *  (none for a stub) and where the whole is. */
export function turnNote(toolName, tokens, handle, cut) {
  const what = `this ${toolName || "tool"} result (about ${tokens} tokens)`
  const how = `To see it in full, call ${RESTORE_TOOL} with handle "${handle}".`
  return cut
    ? `${cut}\n[ContextRender: the rest of ${what} is left out to fit the history budget. ${how}]`
    : `[ContextRender: ${what} is left out to fit the history budget. ${how}]`
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

// The current turn of each session: {key, tokens, originals}. Module-wide: OpenClaw may load the
// plugin twice in one process (the tool-result middleware through a registry of its own), and the
// middleware, assemble and the restore tool must share it.
const TURNS = new Map()
function turnOf(session, key) {
  let turn = TURNS.get(session)
  if (!turn || (key !== undefined && turn.key !== key)) {
    // A new turn (assemble's history and prompt moved): its results start the count again.
    turn = { key: key ?? turn?.key, tokens: 0, originals: turn?.originals ?? new Map() }
    TURNS.delete(session)
    TURNS.set(session, turn)
    if (TURNS.size > VIEWS_KEPT) TURNS.delete(TURNS.keys().next().value)
  }
  return turn
}

/** Where the originals of the turn's cut results are kept: a Map in this process (tests, hosts
 *  without a state folder), or files in OpenClaw's state folder (`storeOf`). */
export function memoryStore() {
  const kept = new Map()
  return {
    async get(key) { return kept.get(key) },
    async put(key, value) {
      kept.delete(key)
      kept.set(key, value)
      if (kept.size > 4096) kept.delete(kept.keys().next().value)
    },
  }
}

/** Files under `folder`, one a kept original (OpenClaw's keyed plugin state is for trusted, npm
 *  installed plugins only): the oldest go past FILES_KEPT, checked once a process. */
const FILES_KEPT = 4096
export function fileStore(folder) {
  let pruned = false
  const path = async (key) => {
    const { createHash } = await import("node:crypto")
    const { join } = await import("node:path")
    return join(folder, `${createHash("sha256").update(key).digest("hex").slice(0, 40)}.txt`)
  }
  return {
    async get(key) {
      const { readFile } = await import("node:fs/promises")
      return readFile(await path(key), "utf8").catch(() => undefined)
    },
    async put(key, text) {
      const fs = await import("node:fs/promises")
      await fs.mkdir(folder, { recursive: true })
      const file = await path(key)
      await fs.writeFile(`${file}.part`, text, "utf8")
      await fs.rename(`${file}.part`, file)
      if (pruned) return
      pruned = true
      const names = (await fs.readdir(folder)).filter((n) => n.endsWith(".txt"))
      if (names.length <= FILES_KEPT) return
      const { join } = await import("node:path")
      const dated = await Promise.all(names.map(async (n) => [n, (await fs.stat(join(folder, n))).mtimeMs]))
      dated.sort((a, b) => a[1] - b[1])
      await Promise.all(dated.slice(0, names.length - FILES_KEPT).map(([n]) => fs.rm(join(folder, n), { force: true })))
    },
  }
}

/** The store of the turn's originals for OpenClaw: files in its state folder (else memoryStore). */
export function storeOf(api) {
  let folder
  try {
    folder = api?.runtime?.state?.resolveStateDir?.()
  } catch {
    folder = undefined
  }
  return typeof folder === "string" && folder ? fileStore(`${folder}/plugins/contextrender/turn-originals`) : memoryStore()
}

/** The context engine and the restore tool, bound to one server. */
export function createContextRender(pluginConfig, log = console, store = memoryStore()) {
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
  const checked = new Set() // sessions whose first turn found the server (or logged that it did not)
  /** `messages` with each earlier turn's note replaced by the result it stood for (the store's copy). */
  async function withOriginals(session, messages) {
    let out = messages
    for (let k = 0; k < messages.length; k++) {
      const message = messages[k]
      const handle = message?.role === "toolResult" ? TURN_NOTE.exec(textOf(message.content))?.[1] : undefined
      if (!handle) continue
      const kept = await store.get(`${session}|${handle}`).catch(() => undefined)
      if (typeof kept !== "string") continue
      if (out === messages) out = messages.slice()
      out[k] = { ...message, content: [{ type: "text", text: kept }] }
    }
    return out
  }
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
    async assemble({ sessionId, sessionKey, messages: given, tokenBudget, prompt }) {
      const session = sessionName(sessionKey, sessionId)
      let messages = given
      try {
        messages = await withOriginals(session, unview(given, views.get(session)))
        // The turn's own calls and results come after this history, unrendered: B less what they
        // hold (the prompt, as the current user message of any render, is not charged to B).
        const turn = turnOf(session, `${messages.length}\u0000${prompt ?? ""}`)
        const pending = s.budget ? turn.tokens : 0
        const budget = Math.max(64, Math.min(s.budget ? s.budget - pending : tokenBudget ?? 6000, tokenBudget ?? Infinity))
        const chat = toChat(messages)
        if (chat.length === 0) {
          if (!checked.has(session)) {
            checked.add(session)
            // A first turn has no history to render: ask the server whether it is there, so a
            // dead server is said now, not at the second turn.
            await post("health", {}).catch((error) => log.warn(`contextrender: the server at ${s.url} did not answer for ${session}; the next turns go unrendered until it does (${error?.message ?? error})`))
          }
          return { messages: given, estimatedTokens: 0 }
        }
        checked.add(session)
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

  /** The tool-result middleware: the current turn's results within the turn's share of B. */
  async function cutTurnResult(event, ctx) {
    if (!s.budget) return undefined // B is OpenClaw's own budget: its guards hold the turn
    const session = sessionName(ctx?.sessionKey, ctx?.sessionId)
    const turn = turnOf(session)
    const content = Array.isArray(event?.result?.content) ? event.result.content : []
    const text = textOf(content)
    const tokens = estimateTokens(text)
    // The call and its message around the result, and the narration before it: a few tokens more.
    const call = estimateTokens(JSON.stringify(event?.args ?? {})) + 32
    const room = Math.floor(TURN_RESULTS * s.budget) - turn.tokens - call
    if (tokens <= room || event?.toolName === RESTORE_TOOL || content.some((p) => p?.type !== "text")) {
      turn.tokens += tokens + call
      return undefined
    }
    const handle = `turn:${event.toolCallId}`
    // Kept where the next turns find it (OpenClaw hands an engine no result's details); a result
    // that cannot be kept is not cut (the store's error leaves it whole).
    await store.put(`${session}|${handle}`, text)
    turn.originals.set(handle, text)
    if (turn.originals.size > VIEWS_KEPT) turn.originals.delete(turn.originals.keys().next().value)
    const stub = turnNote(event.toolName, tokens, handle, "")
    const left = room - estimateTokens(stub)
    const note = left >= MIN_CUT ? turnNote(event.toolName, tokens, handle, headOf(text, left)) : stub
    turn.tokens += estimateTokens(note) + call
    return { result: { ...event.result, content: [{ type: "text", text: note }] } }
  }

  async function restore(session, handle) {
    if (typeof handle !== "string" || !handle) return `${RESTORE_TOOL} needs a handle, such as {"handle": "r17"}: the placeholder names it.`
    if (TURN_HANDLE.test(handle)) {
      // A result of the current turn: the server has not seen the turn yet; this process kept it.
      const kept = TURNS.get(session)?.originals.get(handle) ?? (await store.get(`${session}|${handle}`).catch(() => undefined))
      return kept ?? `There is no result "${handle}" in this turn any more: use a handle a placeholder of the history names.`
    }
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

  const toolResultMiddleware = async (event, ctx) => {
    try {
      return await cutTurnResult(event, ctx)
    } catch (error) {
      log.warn(`contextrender: the turn's result ${event?.toolCallId} kept whole (${error?.message ?? error})`)
      return undefined
    }
  }

  return { engine, restoreTool, restore, toolResultMiddleware }
}

/** The plugin entry OpenClaw loads (openclaw.plugin.json, package.json "openclaw.extensions"). */
export default function register(api) {
  const { engine, restoreTool, toolResultMiddleware } = createContextRender(api.pluginConfig, api.logger ?? console, storeOf(api))
  api.registerContextEngine("contextrender", () => engine)
  api.registerTool(restoreTool, { name: RESTORE_TOOL })
  // The current turn's results (openclaw.plugin.json declares contracts.agentToolResultMiddleware).
  if (typeof api.registerAgentToolResultMiddleware === "function")
    api.registerAgentToolResultMiddleware(toolResultMiddleware, { runtimes: ["openclaw"] })
}
