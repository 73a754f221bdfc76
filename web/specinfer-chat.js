// <specinfer-chat server="/config.json" tree="adaptive:dynamic:32" max-tokens="256"
//                 temperature="0.8" top-p="0.95" persist="session" round-timeout="20">
//
// A chat widget for specinfer: a small speculative model drafts token trees right here, in
// WebAssembly; the verifier (the large model, in the cloud) checks a whole tree per round over
// WebTransport and sends back the tokens it keeps. Greedy answers are token-identical to the
// large model's own. No dependencies: embed with
//   <script type="module" src="https://VERIFIER/specinfer-chat.js"></script>
//
// /config.json names the verifier (webtransport_port, certificate_sha256, api_key), or a fleet:
// "verifiers": [{"host", "webtransport_port", "certificate_sha256"}, ...]. The widget says hello
// to two and keeps the less loaded, as the native client does; when its verifier drains (Move)
// or dies mid-answer, it opens the session again with everything committed on another and
// streams on, nothing lost or repeated.
//
// It keeps the conversation: every question is asked with the turns before it (the oldest
// forgotten where the LLM's context would not hold them, by the native clients' rule, in the
// WebAssembly), and the conversation survives a reload of the page (sessionStorage) unless
// persist="off". Stop ends an answer after the round in flight and keeps what it had;
// Regenerate answers the last question again; New conversation forgets it all.
//
// Answers are rendered as Markdown, code highlighted, and sanitised (web/render.js, bundled into
// pkg/vendor.js): no answer can run script in the embedding page.
//
// Events: "ready" (connected), "progress" ({text}: the answer so far, after each round),
// "answer" ({ids, text, stats, stopped}), "failed" (a message).
// Theming: the custom properties --specinfer-accent, --specinfer-background, --specinfer-text,
// --specinfer-user-bubble, --specinfer-bot-bubble, --specinfer-font and --specinfer-radius, and
// the parts log, message, user, bot, composer, input, send, stop, regenerate, new, status.
import init, { BrowserClient } from "./pkg/specinfer_wasm.js";
import { renderMarkdown } from "./pkg/vendor.js";

const STYLE = `
  :host { display: block; font: var(--specinfer-font, 15px/1.45 system-ui, sans-serif); max-width: 46rem;
          border: 1px solid #c9ced6; border-radius: var(--specinfer-radius, 10px); overflow: hidden;
          background: var(--specinfer-background, #fff); color: var(--specinfer-text, #202124); }
  .log { padding: 12px; min-height: 8rem; max-height: 28rem; overflow-y: auto; }
  .msg { margin: 6px 0; padding: 8px 11px; border-radius: calc(var(--specinfer-radius, 10px) - 2px);
         white-space: pre-wrap; }
  .user { background: var(--specinfer-user-bubble, #e8f0fe); margin-left: 18%; }
  .bot { background: var(--specinfer-bot-bubble, #f3f4f6); margin-right: 8%; }
  .bot { white-space: normal; }
  .bot > :first-child { margin-top: 0; } .bot > :last-child { margin-bottom: 0; }
  .bot pre { background: #f6f8fa; border: 1px solid #e3e6ea; border-radius: 6px; padding: 8px 10px;
             overflow-x: auto; font: 13px/1.4 ui-monospace, SFMono-Regular, Menlo, monospace; }
  .bot code { font-family: ui-monospace, SFMono-Regular, Menlo, monospace; }
  .hljs-keyword, .hljs-built_in, .hljs-literal { color: #cf222e; }
  .hljs-string, .hljs-regexp { color: #0a3069; }
  .hljs-comment { color: #6e7781; font-style: italic; }
  .hljs-number { color: #0550ae; }
  .hljs-title, .hljs-title.function_ { color: #8250df; }
  .hljs-params, .hljs-attr, .hljs-variable { color: #953800; }
  .error-line { color: #8a1c1c; }
  .bot.error { background: #fde8e8; color: #8a1c1c; }
  .stopped::after { content: " (stopped)"; color: #5f6368; font-style: italic; }
  form { display: flex; gap: 8px; padding: 10px; border-top: 1px solid #e3e6ea; }
  textarea { flex: 1; padding: 8px; font: inherit; border: 1px solid #c9ced6; border-radius: 6px;
             resize: vertical; min-height: 2.4em; }
  button { padding: 8px 14px; font: inherit; border: 0; border-radius: 6px;
           background: var(--specinfer-accent, #1a73e8); color: #fff; }
  button:disabled { opacity: 0.5; }
  button.quiet { background: transparent; color: var(--specinfer-accent, #1a73e8); padding: 2px 8px; }
  .controls { display: flex; gap: 6px; padding: 0 10px 6px; }
  [hidden] { display: none !important; }
  .bar { display: flex; justify-content: space-between; gap: 8px; padding: 6px 12px;
         font-size: 12.5px; color: #5f6368; background: #fafbfc; border-top: 1px solid #e3e6ea; }
  .retry { background: #c5221f; padding: 2px 10px; font-size: 12.5px; }
`;

/** Length-prefixed frames over one WebTransport bidirectional stream. */
class FrameStream {
  constructor(stream) {
    this.reader = stream.readable.getReader();
    this.writer = stream.writable.getWriter();
    this.buf = new Uint8Array(0);
  }
  write(bytes) {
    return this.writer.write(bytes);
  }
  async readExact(n) {
    while (this.buf.length < n) {
      const { value, done } = await this.reader.read();
      if (done) throw new Error("the verifier closed the stream");
      const joined = new Uint8Array(this.buf.length + value.length);
      joined.set(this.buf);
      joined.set(value, this.buf.length);
      this.buf = joined;
    }
    const out = this.buf.slice(0, n);
    this.buf = this.buf.slice(n);
    return out;
  }
  /** One frame's body; the client checks the announced length against the limits first. */
  async readFrame(client) {
    return this.readExact(client.frame_len(await this.readExact(4)));
  }
  async close() {
    try { await this.writer.close(); } catch (_) { /* already gone */ }
  }
}

const hexBytes = (hex) => new Uint8Array(hex.match(/../g).map((h) => parseInt(h, 16)));

/** `promise`, or an error after `seconds`: every wait on a verifier is bounded. */
const within = (seconds, what, promise) =>
  Promise.race([
    promise,
    new Promise((_, fail) =>
      setTimeout(() => fail(new Error(`${what}: no answer from the verifier in ${seconds} s`)), seconds * 1000)),
  ]);

class SpecinferChat extends HTMLElement {
  connectedCallback() {
    const root = this.attachShadow({ mode: "open" });
    root.innerHTML = `<style>${STYLE}</style>
      <div class="log" part="log" role="log" aria-live="polite" aria-label="Conversation"></div>
      <form part="composer">
        <textarea part="input" rows="1" placeholder="Ask something" aria-label="Your message" disabled></textarea>
        <button type="submit" part="send" class="send" aria-label="Send" disabled>Send</button>
        <button type="button" part="stop" class="stop" aria-label="Stop the answer" hidden>Stop</button>
      </form>
      <div class="controls">
        <button type="button" part="regenerate" class="quiet regenerate" aria-label="Answer the last question again" hidden>Regenerate</button>
        <button type="button" part="new" class="quiet new" aria-label="Start a new conversation">New conversation</button>
      </div>
      <div class="bar"><span class="status" part="status" role="status">starting…</span><span class="stats"></span></div>`;
    this.log = root.querySelector(".log");
    this.input = root.querySelector("textarea");
    this.button = root.querySelector(".send");
    this.stopButton = root.querySelector(".stop");
    this.regenerateButton = root.querySelector(".regenerate");
    this.newButton = root.querySelector(".new");
    this.statusLine = root.querySelector(".status");
    this.statsLine = root.querySelector(".stats");
    root.querySelector("form").addEventListener("submit", (e) => {
      e.preventDefault();
      this.send();
    });
    // Enter sends, Shift+Enter breaks the line.
    this.input.addEventListener("keydown", (e) => {
      if (e.key === "Enter" && !e.shiftKey) {
        e.preventDefault();
        this.send();
      }
    });
    this.stopButton.onclick = () => this.stop();
    this.regenerateButton.onclick = () => this.regenerate().catch(() => {});
    this.newButton.onclick = () => this.newConversation();
    this.start();
  }

  send() {
    const text = this.input.value.trim();
    if (text && !this.input.disabled) {
      this.input.value = "";
      this.ask(text).catch(() => {});
    }
  }

  /** Seconds a round may wait for its verdict before the connection counts as lost. */
  roundTimeout() {
    return Number(this.getAttribute("round-timeout") || 20);
  }

  /** Ends the answer in flight after its current round; what it committed stays. */
  stop() {
    this.stopping = true;
  }

  /** Where the conversation is kept across reloads (null: not kept). */
  storageKey() {
    if (this.getAttribute("persist") === "off") return null;
    return `specinfer-chat:${this.configUrl}`;
  }

  saveConversation() {
    const key = this.storageKey();
    if (key) sessionStorage.setItem(key, this.client.conversation_json());
  }

  /** The kept conversation, shown and handed to the client (after a reload). */
  restoreConversation() {
    const key = this.storageKey();
    const kept = key && sessionStorage.getItem(key);
    if (!kept) return;
    try {
      this.client.restore_conversation(kept);
      for (const turn of JSON.parse(kept)) this.bubble(turn.role === "user" ? "user" : "bot", turn.content);
      this.regenerateButton.hidden = JSON.parse(kept).length === 0;
    } catch (e) {
      sessionStorage.removeItem(key);
    }
  }

  newConversation() {
    if (this.answering) return;
    this.client?.reset();
    this.log.replaceChildren();
    this.statsLine.textContent = "";
    this.regenerateButton.hidden = true;
    const key = this.storageKey();
    if (key) sessionStorage.removeItem(key);
    this.input.focus();
  }

  setStatus(text) {
    this.statusLine.textContent = text;
  }

  setBusy(busy) {
    this.input.disabled = busy;
    this.button.disabled = busy;
    this.newButton.disabled = busy;
    this.regenerateButton.disabled = busy;
    if (!busy) this.input.focus();
  }

  async start() {
    try {
      this.setStatus("loading the draft model…");
      this.configUrl = new URL(this.getAttribute("server") || "/config.json", location.href);
      const at = (path) => new URL(path, this.configUrl);
      this.config = await (await fetch(this.configUrl)).json();
      await init();
      const [ssmConfig, weights, tokenizer, chat] = await Promise.all([
        fetch(at("/ssm/config.json")).then((r) => r.text()),
        fetch(at("/ssm/model.safetensors")).then((r) => r.arrayBuffer()),
        fetch(at("/tokenizer.json")).then((r) => r.text()),
        fetch(at("/chat.json")).then((r) => r.text()),
      ]);
      const tree = this.getAttribute("tree") || "adaptive:dynamic:32";
      this.client = new BrowserClient(ssmConfig, new Uint8Array(weights), tokenizer, chat, tree);
      this.restoreConversation();
      await this.connect();
      this.dispatchEvent(new CustomEvent("ready"));
    } catch (e) {
      this.fail(`could not start: ${e.message || e}`);
    }
  }

  /** The verifiers /config.json lists ("verifiers": [...], or itself as the one). */
  endpoints() {
    return (this.config.verifiers ?? [this.config]).map((v) => ({
      host: v.host ?? this.configUrl.hostname,
      port: v.webtransport_port,
      hash: v.certificate_sha256,
    }));
  }

  /** A connection to `ep` that has said hello: {wt, ep, event}. */
  async hello(ep) {
    const wt = new WebTransport(`https://${ep.host}:${ep.port}/`, {
      serverCertificateHashes: [{ algorithm: "sha-256", value: hexBytes(ep.hash) }],
    });
    try {
      const event = await within(10, "hello", (async () => {
        await wt.ready;
        const stream = new FrameStream(await wt.createBidirectionalStream());
        await stream.write(this.client.hello(this.config.api_key ?? undefined));
        return JSON.parse(this.client.on_frame(await stream.readFrame(this.client)));
      })());
      return { wt, ep, event };
    } catch (e) {
      try { wt.close(); } catch (_) { /* never opened */ }
      throw e;
    }
  }

  /**
   * Connects as the native client does: hello to two of the listed verifiers (leaving out
   * `avoid`, the one just lost, while there are others) and keep the less loaded; a draining
   * one only when nothing else answers.
   */
  async connect(avoid = null) {
    this.setStatus("connecting…");
    const same = (a, b) => a && b && a.host === b.host && a.port === b.port;
    const all = this.endpoints();
    const others = all.filter((ep) => !same(ep, avoid));
    const pool = (others.length ? others : all).sort(() => Math.random() - 0.5);
    let answered = [];
    let why = null;
    // Two at a time, until some answer.
    for (let i = 0; i < pool.length && !answered.length; i += 2) {
      const tried = await Promise.allSettled(pool.slice(i, i + 2).map((ep) => this.hello(ep)));
      answered = tried.filter((t) => t.status === "fulfilled").map((t) => t.value);
      why = tried.find((t) => t.status === "rejected")?.reason ?? why;
    }
    if (!answered.length) throw why ?? new Error("no verifier answered");
    const load = (h) => (h.event.draining ? Infinity : h.event.load ?? Infinity);
    answered.sort((a, b) => load(a) - load(b));
    const [best, ...rest] = answered;
    rest.forEach((h) => h.wt.close());
    this.adopt(best);
  }

  /** Makes the connection `h` (from hello) the one answers go over. */
  adopt(h) {
    const { wt, ep, event } = h;
    this.wt = wt;
    this.endpoint = ep;
    wt.closed.then(
      () => this.lost(wt, "the verifier closed the connection"),
      (e) => this.lost(wt, e.message || String(e)),
    );
    const where = this.endpoints().length > 1 ? ` at ${ep.host}:${ep.port}` : "";
    this.setStatus(`connected to ${event.model}${where}; drafting locally in WebAssembly`);
    this.setBusy(false);
  }

  lost(wt, reason) {
    if (this.wt !== wt) return;
    this.wt = null;
    this.setBusy(true);
    this.statusLine.innerHTML = "";
    this.statusLine.append(`connection lost (${reason}) `);
    const retry = document.createElement("button");
    retry.className = "retry";
    retry.textContent = "Retry";
    retry.onclick = () => this.connect().catch((e) => this.lost(null, e.message || String(e)));
    this.statusLine.append(retry);
  }

  /**
   * After the connection broke mid-answer: the session back from the same verifier (resumed,
   * or opened again there with everything committed); when that verifier is gone, opened
   * again on another. Resolves with {stream, finished}.
   */
  async recover(answer) {
    const lost = this.endpoint;
    let h;
    try {
      h = await this.hello(lost);
    } catch (_) {
      return { stream: await this.reopenElsewhere(lost), finished: false };
    }
    this.adopt(h);
    this.setBusy(true);
    let stream = new FrameStream(await this.wt.createBidirectionalStream());
    await stream.write(this.client.resume());
    const event = JSON.parse(this.client.on_frame(await stream.readFrame(this.client)));
    if (event.event === "resumed") {
      this.setAnswerText(answer, answer.rawText + event.text);
      return { stream, finished: event.finished };
    }
    if (event.event === "move") return { stream: await this.reopenElsewhere(lost), finished: false };
    // The verifier no longer holds it: open it again on a fresh stream.
    stream = new FrameStream(await this.wt.createBidirectionalStream());
    await stream.write(this.client.reopen());
    this.client.on_frame(await stream.readFrame(this.client));
    return { stream, finished: false };
  }

  /**
   * Opens the answer's session, with everything committed so far, on a verifier other than
   * `avoid` (which drained or died); resolves with the new session's stream. Sampling goes on
   * from the same seed, so a seeded answer is the same wherever it is finished.
   */
  async reopenElsewhere(avoid) {
    for (let tries = 0; ; tries++) {
      const old = this.wt;
      await this.connect(avoid);
      if (old && old !== this.wt) {
        try { old.close(); } catch (_) { /* already gone */ }
      }
      this.setBusy(true);
      const stream = new FrameStream(await this.wt.createBidirectionalStream());
      await stream.write(this.client.reopen());
      const event = JSON.parse(this.client.on_frame(await stream.readFrame(this.client)));
      if (event.event !== "move") return stream;
      // That one is draining too.
      await stream.close();
      avoid = this.endpoint;
      if (tries >= 3) throw new Error("every verifier is draining");
    }
  }

  fail(message) {
    this.setStatus(message);
    this.dispatchEvent(new CustomEvent("failed", { detail: message }));
  }

  bubble(cls, text) {
    const div = document.createElement("div");
    div.className = `msg ${cls}`;
    div.setAttribute("part", `message ${cls}`);
    if (cls === "bot") this.setAnswerText(div, text);
    else div.textContent = text;
    this.log.append(div);
    this.log.scrollTop = this.log.scrollHeight;
    return div;
  }

  /** Shows `text` in the answer bubble `div`, rendered (Markdown, code, sanitised). */
  setAnswerText(div, text) {
    div.rawText = text;
    div.innerHTML = renderMarkdown(text);
  }

  /** An answer's bubble with `text` rendered as answers are (the page's own use, and tests). */
  showAnswer(text) {
    return this.bubble("bot", text);
  }

  /** Answers `text`, the conversation's next question; resolves with {ids, text, stats, stopped}. */
  async ask(text, maxTokens = Number(this.getAttribute("max-tokens") || 256)) {
    this.bubble("user", text);
    return this.answer((t, p) => this.client.open(text, maxTokens, t, p));
  }

  /** Answers the last question again, in place of the last answer. */
  async regenerate(maxTokens = Number(this.getAttribute("max-tokens") || 256)) {
    const last = this.log.lastElementChild;
    if (last?.classList.contains("bot")) last.remove();
    return this.answer((t, p) => this.client.regenerate(maxTokens, t, p));
  }

  /** Streams the answer whose OpenSession frame `opening(temperature, topP)` gives. */
  async answer(opening) {
    const answer = this.bubble("bot", "");
    this.setBusy(true);
    this.answering = true;
    this.stopping = false;
    this.stopButton.hidden = false;
    this.regenerateButton.hidden = true;
    let stopped = false;
    try {
      if (!this.wt) throw new Error("not connected");
      let stream = new FrameStream(await this.wt.createBidirectionalStream());
      const started = performance.now();
      // Sampled by default, as chat front ends do (llama.cpp's temperature 0.8, top-p 0.95);
      // temperature="0" answers greedily, token for token the LLM's own answer.
      const temperature = Number(this.getAttribute("temperature") ?? 0.8);
      const topP = Number(this.getAttribute("top-p") ?? 0.95);
      await stream.write(opening(temperature, topP));
      if (JSON.parse(this.client.on_frame(await stream.readFrame(this.client))).event === "move") {
        // It started draining since the hello: the session opens elsewhere.
        await stream.close();
        stream = await this.reopenElsewhere(this.endpoint);
      }
      let reconnects = 0;
      for (;;) {
        if (this.stopping) {
          stopped = true;
          answer.classList.add("stopped");
          break;
        }
        const frame = this.client.next_round();
        let body;
        try {
          await stream.write(frame);
          // A verifier that died without closing its connection (killed, its host gone) is
          // noticed after round-timeout seconds, not after the transport's idle timeout.
          body = await within(this.roundTimeout(), "a round", stream.readFrame(this.client));
        } catch (lostStream) {
          // The connection broke mid-answer: resume the session on a new one (or open it again
          // with everything committed, there or on another verifier), as the native client
          // does; nothing streamed is lost or repeated.
          if (++reconnects > 6) throw lostStream;
          const recovered = await this.recover(answer);
          stream = recovered.stream;
          if (recovered.finished) break;
          continue;
        }
        const event = JSON.parse(this.client.on_frame(body));
        if (event.event === "move") {
          // The verifier is draining: it let the session go without running the round.
          if (++reconnects > 6) throw new Error("the session was moved too often");
          await stream.close();
          stream = await this.reopenElsewhere(this.endpoint);
          continue;
        }
        this.setAnswerText(answer, answer.rawText + event.text);
        this.dispatchEvent(new CustomEvent("progress", { detail: { text: answer.rawText } }));
        this.log.scrollTop = this.log.scrollHeight;
        const s = JSON.parse(this.client.stats());
        const seconds = (performance.now() - started) / 1000;
        // (A paused clock, as in a headless browser's virtual time, gives no rate.)
        const rate = seconds > 0 ? `${(s.tokens / seconds).toFixed(1)} tokens/s · ` : "";
        this.statsLine.textContent = `${rate}${s.tau.toFixed(2)} tokens/round · ${s.rounds} rounds`;
        if (event.finished) break;
      }
      await stream.write(this.client.close_frame());
      await stream.close();
      const detail = {
        ids: Array.from(this.client.token_ids()),
        text: answer.rawText,
        stopped,
        stats: { ...JSON.parse(this.client.stats()), wall_ms: performance.now() - started },
      };
      this.saveConversation();
      this.dataset.tokenIds = detail.ids.join(",");
      this.dispatchEvent(new CustomEvent("answer", { detail }));
      return detail;
    } catch (e) {
      answer.classList.add("error");
      const line = document.createElement("div");
      line.className = "error-line";
      line.textContent = `[${e.message || e}]`;
      answer.append(line);
      this.fail(e.message || String(e));
      throw e;
    } finally {
      this.answering = false;
      this.stopButton.hidden = true;
      this.regenerateButton.hidden = false;
      if (this.wt) this.setBusy(false);
    }
  }
}

customElements.define("specinfer-chat", SpecinferChat);
