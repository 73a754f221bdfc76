// <specinfer-chat server="/config.json" tree="adaptive:dynamic:32" max-tokens="256">
//
// A chat widget for specinfer: a small speculative model drafts token trees right here, in
// WebAssembly; the verifier (the large model, in the cloud) checks a whole tree per round over
// WebTransport and sends back the tokens it keeps. Greedy answers are token-identical to the
// large model's own. No dependencies: embed with
//   <script type="module" src="https://VERIFIER/specinfer-chat.js"></script>
//
// Events: "ready" (connected), "answer" ({ids, text, stats}), "failed" (a message).
import init, { BrowserClient } from "./pkg/specinfer_wasm.js";

const STYLE = `
  :host { display: block; font: 15px/1.45 system-ui, sans-serif; max-width: 46rem;
          border: 1px solid #c9ced6; border-radius: 10px; overflow: hidden; background: #fff; }
  .log { padding: 12px; min-height: 8rem; max-height: 28rem; overflow-y: auto; }
  .msg { margin: 6px 0; padding: 8px 11px; border-radius: 8px; white-space: pre-wrap; }
  .user { background: #e8f0fe; margin-left: 18%; }
  .bot { background: #f3f4f6; margin-right: 8%; }
  .bot.error { background: #fde8e8; color: #8a1c1c; }
  form { display: flex; gap: 8px; padding: 10px; border-top: 1px solid #e3e6ea; }
  input { flex: 1; padding: 8px; font: inherit; border: 1px solid #c9ced6; border-radius: 6px; }
  button { padding: 8px 14px; font: inherit; border: 0; border-radius: 6px; background: #1a73e8; color: #fff; }
  button:disabled { background: #9fb8e8; }
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

class SpecinferChat extends HTMLElement {
  connectedCallback() {
    const root = this.attachShadow({ mode: "open" });
    root.innerHTML = `<style>${STYLE}</style>
      <div class="log" part="log"></div>
      <form><input placeholder="Ask something" disabled><button disabled>Send</button></form>
      <div class="bar"><span class="status">starting…</span><span class="stats"></span></div>`;
    this.log = root.querySelector(".log");
    this.input = root.querySelector("input");
    this.button = root.querySelector("button");
    this.statusLine = root.querySelector(".status");
    this.statsLine = root.querySelector(".stats");
    root.querySelector("form").addEventListener("submit", (e) => {
      e.preventDefault();
      const text = this.input.value.trim();
      if (text) {
        this.input.value = "";
        this.ask(text).catch(() => {});
      }
    });
    this.start();
  }

  setStatus(text) {
    this.statusLine.textContent = text;
  }

  setBusy(busy) {
    this.input.disabled = busy;
    this.button.disabled = busy;
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
      await this.connect();
      this.dispatchEvent(new CustomEvent("ready"));
    } catch (e) {
      this.fail(`could not start: ${e.message || e}`);
    }
  }

  async connect() {
    this.setStatus("connecting…");
    const url = `https://${this.configUrl.hostname}:${this.config.webtransport_port}/`;
    const wt = new WebTransport(url, {
      serverCertificateHashes: [{ algorithm: "sha-256", value: hexBytes(this.config.certificate_sha256) }],
    });
    await wt.ready;
    this.wt = wt;
    wt.closed.then(
      () => this.lost(wt, "the verifier closed the connection"),
      (e) => this.lost(wt, e.message || String(e)),
    );
    const hello = new FrameStream(await wt.createBidirectionalStream());
    await hello.write(this.client.hello(this.config.api_key ?? undefined));
    const event = JSON.parse(this.client.on_frame(await hello.readFrame(this.client)));
    this.setStatus(`connected to ${event.model}; drafting locally in WebAssembly`);
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

  /** Reconnects and gets the answer's session back; resolves with {stream, finished}. */
  async recover(answer) {
    await this.connect();
    this.setBusy(true);
    let stream = new FrameStream(await this.wt.createBidirectionalStream());
    await stream.write(this.client.resume());
    const event = JSON.parse(this.client.on_frame(await stream.readFrame(this.client)));
    if (event.event === "resumed") {
      answer.textContent += event.text;
      return { stream, finished: event.finished };
    }
    // The verifier no longer holds it: open it again on a fresh stream.
    stream = new FrameStream(await this.wt.createBidirectionalStream());
    await stream.write(this.client.reopen());
    this.client.on_frame(await stream.readFrame(this.client));
    return { stream, finished: false };
  }

  fail(message) {
    this.setStatus(message);
    this.dispatchEvent(new CustomEvent("failed", { detail: message }));
  }

  bubble(cls, text) {
    const div = document.createElement("div");
    div.className = `msg ${cls}`;
    div.textContent = text;
    this.log.append(div);
    this.log.scrollTop = this.log.scrollHeight;
    return div;
  }

  /** Answers `text`; resolves with {ids, text, stats}. */
  async ask(text, maxTokens = Number(this.getAttribute("max-tokens") || 256)) {
    this.bubble("user", text);
    const answer = this.bubble("bot", "");
    this.setBusy(true);
    try {
      if (!this.wt) throw new Error("not connected");
      let stream = new FrameStream(await this.wt.createBidirectionalStream());
      const started = performance.now();
      // Sampled by default, as chat front ends do (llama.cpp's temperature 0.8, top-p 0.95);
      // temperature="0" answers greedily, token for token the LLM's own answer.
      const temperature = Number(this.getAttribute("temperature") ?? 0.8);
      const topP = Number(this.getAttribute("top-p") ?? 0.95);
      await stream.write(this.client.open(text, maxTokens, temperature, topP));
      this.client.on_frame(await stream.readFrame(this.client));
      let reconnects = 0;
      for (;;) {
        const frame = this.client.next_round();
        let body;
        try {
          await stream.write(frame);
          body = await stream.readFrame(this.client);
        } catch (lostStream) {
          // The connection broke mid-answer: resume the session on a new one (or open it again
          // with everything committed), as the native client does; nothing streamed is lost.
          if (++reconnects > 3) throw lostStream;
          const recovered = await this.recover(answer);
          stream = recovered.stream;
          if (recovered.finished) break;
          continue;
        }
        const event = JSON.parse(this.client.on_frame(body));
        answer.textContent += event.text;
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
        text: answer.textContent,
        stats: { ...JSON.parse(this.client.stats()), wall_ms: performance.now() - started },
      };
      this.dataset.tokenIds = detail.ids.join(",");
      this.dispatchEvent(new CustomEvent("answer", { detail }));
      return detail;
    } catch (e) {
      answer.classList.add("error");
      answer.textContent += `\n[${e.message || e}]`;
      this.fail(e.message || String(e));
      throw e;
    } finally {
      if (this.wt) this.setBusy(false);
    }
  }
}

customElements.define("specinfer-chat", SpecinferChat);
