#include "infer/serve/page.h"

#include <fmt/format.h>

#include <sstream>

namespace dcp::serve {
namespace {

std::string escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&quot;"; break;
      default: out += c;
    }
  }
  return out;
}

// The page's script: POST /v1/completions with "stream": true, read the server-sent events from the response
// body (fetch and a stream reader: EventSource cannot POST), append each chunk's text, show the cache's bytes.
constexpr const char* kScript = R"JS(
const $ = (id) => document.getElementById(id);
let controller = null;
function setStatus(text) { $('status').textContent = text; }
function fmtBytes(n) { return n >= 1e6 ? (n / 1e6).toFixed(2) + ' MB' : n >= 1e3 ? (n / 1e3).toFixed(1) + ' kB' : n + ' B'; }
async function generate() {
  if (controller) controller.abort();
  controller = new AbortController();
  const out = $('output');
  out.textContent = '';
  $('kv').textContent = '-';
  const body = {
    prompt: $('prompt').value,
    max_tokens: parseInt($('max_tokens').value, 10),
    temperature: parseFloat($('temperature').value),
    kv_policy: $('policy').value,
    stream: true,
  };
  if ($('policy').value !== 'full') body.kv_budget = parseFloat($('budget').value);
  const seed = $('seed').value.trim();
  if (seed !== '') body.seed = parseInt(seed, 10);
  setStatus('waiting for the server...');
  $('go').disabled = true;
  $('stop').disabled = false;
  let generated = 0;
  try {
    const res = await fetch('/v1/completions', {
      method: 'POST', headers: {'Content-Type': 'application/json'}, body: JSON.stringify(body),
      signal: controller.signal });
    if (!res.ok) {
      const err = await res.json().catch(() => ({error: {message: res.statusText}}));
      setStatus('error ' + res.status + ': ' + err.error.message);
      return;
    }
    const reader = res.body.getReader();
    const decoder = new TextDecoder();
    let buffer = '';
    setStatus('streaming');
    for (;;) {
      const {value, done} = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, {stream: true});
      let cut;
      while ((cut = buffer.indexOf('\n\n')) >= 0) {
        const line = buffer.slice(0, cut).trim();
        buffer = buffer.slice(cut + 2);
        if (!line.startsWith('data: ')) continue;
        const data = line.slice(6);
        if (data === '[DONE]') { continue; }
        const chunk = JSON.parse(data);
        if (chunk.error) { setStatus('error: ' + chunk.error.message); continue; }
        const choice = chunk.choices && chunk.choices[0];
        if (choice) {
          out.textContent += choice.text;
          generated += choice.text.length;
        }
        if (chunk.kv_cache) $('kv').textContent = fmtBytes(chunk.kv_cache.bytes);
        if (choice && choice.finish_reason) {
          const kv = chunk.kv_cache;
          setStatus('done: ' + choice.finish_reason + ', ' + chunk.usage.completion_tokens + ' bytes generated, cache ' +
                    fmtBytes(kv.bytes) + ' (' + kv.policy + ' at ' + kv.budget + ')' +
                    (kv.abstained ? ', minimax kept ' + kv.abstained_heads.length + ' heads exact' : ''));
        }
      }
    }
  } catch (e) {
    setStatus(e.name === 'AbortError' ? 'stopped' : 'error: ' + e.message);
  } finally {
    $('go').disabled = false;
    $('stop').disabled = true;
    controller = null;
  }
}
$('go').addEventListener('click', generate);
$('stop').addEventListener('click', () => { if (controller) controller.abort(); });
$('policy').addEventListener('change', () => { $('budget').disabled = $('policy').value === 'full'; });
$('budget').disabled = $('policy').value === 'full';
)JS";

constexpr const char* kStyle = R"CSS(
body { font-family: system-ui, sans-serif; max-width: 56rem; margin: 2rem auto; padding: 0 1rem; color: #222; }
h1 { font-size: 1.3rem; } label { margin-right: 1rem; white-space: nowrap; }
textarea { width: 100%; height: 7rem; font-family: ui-monospace, monospace; font-size: 0.95rem; }
#output { white-space: pre-wrap; font-family: ui-monospace, monospace; background: #f6f6f4; border: 1px solid #ddd;
          min-height: 8rem; padding: 0.6rem; }
.row { margin: 0.6rem 0; } input[type=number] { width: 5rem; } #status { color: #555; }
button { padding: 0.3rem 1rem; }
)CSS";

}  // namespace

std::string page_html(const std::vector<std::string>& policies, const std::string& default_policy, double default_budget,
                      const std::string& model_id, bool recurrent) {
  std::ostringstream options;
  for (const auto& p : policies) {
    options << "<option value=\"" << escape(p) << "\"" << (p == default_policy ? " selected" : "") << ">" << escape(p)
            << "</option>";
  }
  std::ostringstream budgets;
  for (double b : {0.1, 0.25, 0.5, 1.0}) {
    budgets << "<option value=\"" << b << "\"" << ((default_budget >= 1 ? b == 0.5 : b == default_budget) ? " selected" : "")
            << ">" << b << "</option>";
  }
  return fmt::format(R"HTML(<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>dcp serve</title><style>{}</style></head>
<body>
<h1>dcp serve &middot; {}</h1>
<div class="row"><textarea id="prompt" placeholder="Prompt">The </textarea></div>
<div class="row">
<label>KV policy <select id="policy">{}</select></label>
<label>budget <select id="budget">{}</select></label>
<label>max tokens <input id="max_tokens" type="number" value="200" min="1"></label>
<label>temperature <input id="temperature" type="number" value="0.8" min="0" step="0.1"></label>
<label>seed <input id="seed" type="number" min="0" placeholder="random"></label>
</div>
<div class="row"><button id="go">Generate</button> <button id="stop" disabled>Stop</button>
<span> {} held: <b id="kv">-</b></span></div>
<div class="row" id="status">ready</div>
<div id="output"></div>
<script>{}</script>
</body></html>
)HTML",
                     kStyle, escape(model_id), options.str(), budgets.str(),
                     recurrent ? "recurrent states" : "KV cache", kScript);
}

}  // namespace dcp::serve
