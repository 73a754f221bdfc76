// How <specinfer-chat> renders an answer: Markdown (marked, GitHub flavour, line breaks kept),
// fenced code highlighted (highlight.js, its common languages), and the HTML sanitised
// (DOMPurify) so that an answer cannot run script in the page that embeds the widget, whatever
// the model writes (<script>, event handlers, javascript: links). web/build.sh bundles this
// with its pinned dependencies into pkg/vendor.js; nothing is fetched at run time.
import { Marked } from "marked";
import DOMPurify from "dompurify";
import hljs from "highlight.js/lib/common";

const escape = (text) =>
  text.replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" })[c]);

const marked = new Marked({
  gfm: true,
  breaks: true,
  renderer: {
    code({ text, lang }) {
      const language = (lang || "").trim().split(/\s+/)[0];
      const known = language && hljs.getLanguage(language);
      const html = known ? hljs.highlight(text, { language, ignoreIllegals: true }).value : escape(text);
      const label = known ? ` language-${escape(language)}` : "";
      return `<pre><code class="hljs${label}">${html}</code></pre>`;
    },
  },
});

/** The answer's Markdown as sanitised HTML. */
export function renderMarkdown(text) {
  return DOMPurify.sanitize(marked.parse(text), { USE_PROFILES: { html: true } });
}
