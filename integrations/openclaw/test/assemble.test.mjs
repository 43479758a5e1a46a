// Node unit test (`node --test integrations/openclaw/test`): the engine's assemble as OpenClaw
// 2026.9.6 calls it in one run. The first assemble gets the transcript; OpenClaw then puts the view
// it returned in the agent's messages, and its tool loop assembles again from that view before
// every model call. The server must be sent the transcript each time, never the view's stubs and
// fold marker (a rewritten history: the server would fork and the handles shown would be lost).
// The server is a stub `fetch` that records what it is sent and renders by fixed rules.
import assert from "node:assert/strict"
import { createServer } from "node:net"
import { test } from "node:test"
import { createContextRender, estimateTokens, memoryStore, TURN_RESULTS } from "../index.mjs"

const MARKER = "[ContextRender: the oldest messages of this conversation are left out.]"
const stub = (id) => `[ContextRender: left out. call contextrender_restore with handle "r-${id}".]`

function transcript(reads) {
  const messages = [{ role: "user", content: "Read the files.", timestamp: 1 }]
  for (let i = 0; i < reads; i++) {
    messages.push({ role: "assistant", stopReason: "toolUse", timestamp: 2 + 2 * i,
      content: [{ type: "toolCall", id: `call_${i}`, name: "read", arguments: { path: `f${i}` } }] })
    messages.push({ role: "toolResult", toolCallId: `call_${i}`, toolName: "read", isError: false,
      content: [{ type: "text", text: `contents of f${i} `.repeat(50) }], timestamp: 3 + 2 * i })
  }
  return messages
}

const realFetch = globalThis.fetch

/** A server that folds the first user message and cuts every tool result to a stub. */
function server({ down = false, budgets = [] } = {}) {
  const sent = []
  globalThis.fetch = async (url, init) => {
    if (down) throw new TypeError("fetch failed")
    if (String(url).endsWith("/walker/health")) return new Response(JSON.stringify({ ok: true, data: { reports: [{ ok: true }] } }), { status: 200 })
    const body = JSON.parse(init.body)
    sent.push(body.messages)
    budgets.push(body.budget)
    const messages = body.messages.map((m, k) =>
      k === 0 && m.role === "user" ? { role: "user", content: MARKER }
      : m.role === "tool" && !m.content.startsWith("[ContextRender") ? { ...m, content: stub(m.tool_call_id) } : m)
    return new Response(JSON.stringify({ ok: true, data: { reports: [{ messages, history_tokens: 42 }] } }), { status: 200 })
  }
  return sent
}

const quiet = { warn() {} }
const call = (engine, messages) => engine.assemble({ sessionId: "s-1", sessionKey: "agent:main:t", messages, tokenBudget: 100000 })

test("the tool loop's assemble of the last view sends the transcript again, not the view", async () => {
  const sent = server()
  const { engine } = createContextRender({ url: "http://127.0.0.1:9" }, quiet)
  const messages = transcript(2)
  const first = await call(engine, messages)
  assert.equal(first.messages[0].content, MARKER)
  assert.ok(first.messages.some((m) => m.role === "toolResult" && m.content[0].text === stub("call_0")))
  await call(engine, first.messages) // before the next model call: the view, as OpenClaw holds it
  assert.deepEqual(sent[1], sent[0])
  // The view with the run's new messages after it: the transcript, then those messages.
  const view = (await call(engine, first.messages)).messages
  const more = transcript(3).slice(messages.length)
  await call(engine, [...view, ...more])
  assert.deepEqual(sent[3], [...sent[0], ...sent[3].slice(sent[0].length)])
  assert.equal(sent[3].length, sent[0].length + more.length)
  assert.ok(sent.every((chat) => !JSON.stringify(chat).includes("[ContextRender")))
})

test("a history that is not the last view is sent as it is", async () => {
  const sent = server()
  const { engine } = createContextRender({ url: "http://127.0.0.1:9" }, quiet)
  await call(engine, transcript(2))
  const edited = transcript(2)
  edited[0] = { ...edited[0], content: "Read the files, then stop." }
  await call(engine, edited)
  assert.equal(sent[1][0].content, "Read the files, then stop.")
  await call(engine, transcript(3)) // the next run's transcript: longer, its start unchanged
  assert.equal(sent[2].length, 7)
  assert.equal(sent[2][0].content, "Read the files.")
})

test("with the server down, assemble returns OpenClaw's messages as given", async () => {
  server({ down: true })
  const warnings = []
  const { engine } = createContextRender({ url: "http://127.0.0.1:9" }, { warn: (m) => warnings.push(m) })
  const messages = transcript(1)
  const out = await call(engine, messages)
  assert.equal(out.messages, messages)
  assert.equal(out.promptAuthority, "preassembly_may_overflow")
  assert.match(warnings[0], /history sent unchanged for openclaw-agent:main:t/)
})

test("a server that takes the connection and never answers fails open after the timeout", { timeout: 10000 }, async () => {
  globalThis.fetch = realFetch
  const held = []
  const silent = createServer((socket) => held.push(socket))
  await new Promise((done) => silent.listen(0, "127.0.0.1", done))
  const warnings = []
  const url = `http://127.0.0.1:${silent.address().port}`
  const { engine } = createContextRender({ url, timeout: 0.5 }, { warn: (m) => warnings.push(m) })
  try {
    const messages = transcript(1)
    const start = Date.now()
    const out = await call(engine, messages)
    assert.equal(out.messages, messages)
    assert.match(warnings[0], /history sent unchanged .*no answer from .* within 0.5 s/)
    assert.ok(Date.now() - start < 10000)
  } finally {
    held.forEach((socket) => socket.destroy())
    silent.close()
  }
})

const report = (i) => Array.from({ length: 25 }, (_, j) => `report_${i} row ${j}: counter_${i}_${j} = ${j * 17 + i}`).join("\n")
const result = (id, text, toolName = "read") => ({ toolCallId: id, toolName, args: { path: `${id}.txt` }, result: { content: [{ type: "text", text }] } })
const ctx = { sessionKey: "agent:main:turn" }
const turnCall = (engine, messages) => engine.assemble({ sessionKey: "agent:main:turn", messages, tokenBudget: 100000, prompt: "Read them all." })

test("a turn's own results stay within its share of B: whole, cut, then stubs; a restore answers whole; the next turn sends the originals", async () => {
  const budgets = []
  const sent = server({ budgets })
  const B = 3300
  const { engine, toolResultMiddleware, restoreTool } = createContextRender({ url: "http://127.0.0.1:9", budget: B }, quiet, memoryStore())
  const history = transcript(2)
  await turnCall(engine, history)
  assert.equal(budgets[0], B) // nothing of the turn yet
  const outs = []
  for (let i = 0; i < 6; i++) outs.push(await toolResultMiddleware(result(`call_t${i}`, report(i)), ctx))
  const tokens = estimateTokens(report(0))
  assert.ok(tokens > 350 && 2 * tokens < TURN_RESULTS * B && 3 * tokens > TURN_RESULTS * B)
  assert.equal(outs[0], undefined) // whole
  assert.equal(outs[1], undefined)
  const cut = outs[2].result.content[0].text
  assert.ok(cut.startsWith("report_2 row 0") && cut.length < report(2).length)
  assert.match(cut, /the rest of this read result .* handle "turn:call_t2"/)
  for (const out of outs.slice(3)) assert.match(out.result.content[0].text, /^\[ContextRender: this read result \(about \d+ tokens\) is left out .* handle "turn:call_t\d"/)
  // The next model call: the history before the turn gets B less what the turn holds.
  await turnCall(engine, history)
  assert.ok(budgets[1] < B - 2 * tokens && budgets[1] > B / 2, budgets)
  // A restore of a turn handle answers the original, whole, and is charged to the turn.
  const tool = restoreTool(ctx)
  const restored = (await tool.execute("call_r", { handle: "turn:call_t4" })).content[0].text
  assert.equal(restored, report(4))
  assert.equal(await toolResultMiddleware(result("call_r", restored, "contextrender_restore"), ctx), undefined)
  await turnCall(engine, history)
  assert.ok(budgets[2] < budgets[1] - tokens + 1, budgets)
  // The next turn: its history holds the notes; the server is sent the originals, and the turn's
  // count starts again.
  const done = [...history, { role: "user", content: "Read them all.", timestamp: 90 }]
  for (let i = 0; i < 6; i++) {
    done.push({ role: "assistant", stopReason: "toolUse", timestamp: 91 + i, content: [{ type: "toolCall", id: `call_t${i}`, name: "read", arguments: { path: `call_t${i}.txt` } }] })
    done.push({ role: "toolResult", toolCallId: `call_t${i}`, toolName: "read", isError: false, timestamp: 91 + i,
      content: outs[i] ? outs[i].result.content : [{ type: "text", text: report(i) }] })
  }
  await engine.assemble({ sessionKey: "agent:main:turn", messages: done, tokenBudget: 100000, prompt: "Now compare." })
  assert.equal(budgets[3], B)
  const tools = sent[3].filter((m) => m.role === "tool" && m.tool_call_id.startsWith("call_t"))
  assert.deepEqual(tools.map((m) => m.content), [0, 1, 2, 3, 4, 5].map(report))
})

test("without a plugin budget the turn is OpenClaw's: the middleware leaves results whole", async () => {
  server()
  const { toolResultMiddleware } = createContextRender({ url: "http://127.0.0.1:9" }, quiet, memoryStore())
  for (let i = 0; i < 8; i++) assert.equal(await toolResultMiddleware(result(`call_w${i}`, report(i)), ctx), undefined)
})

test("a dead server is logged at the first turn, once", async () => {
  server({ down: true })
  const warnings = []
  const { engine } = createContextRender({ url: "http://127.0.0.1:9", budget: 2000 }, { warn: (m) => warnings.push(m) }, memoryStore())
  const first = await engine.assemble({ sessionKey: "agent:main:new", messages: [], tokenBudget: 100000, prompt: "Hi." })
  assert.deepEqual(first.messages, [])
  assert.equal(warnings.length, 1)
  assert.match(warnings[0], /the server at http:\/\/127\.0\.0\.1:9 did not answer for openclaw-agent:main:new/)
  await engine.assemble({ sessionKey: "agent:main:new", messages: [], tokenBudget: 100000, prompt: "Hi again." })
  assert.equal(warnings.length, 1)
})
