// The chat page's source, embedded as a raw string.
#include "server/chat_page.h"

namespace shadowkv::server {
namespace {

constexpr std::string_view kPage = R"PAGE(<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>shadowkv chat</title>
<style>
  body { font-family: system-ui, sans-serif; margin: 0; background: #f4f4f6; color: #222; }
  header { padding: 10px 16px; background: #23262f; color: #eee; display: flex; gap: 16px;
           align-items: center; flex-wrap: wrap; font-size: 14px; }
  header b { font-size: 16px; }
  header label { display: flex; gap: 4px; align-items: center; }
  header input { width: 70px; }
  #log { max-width: 820px; margin: 0 auto; padding: 16px; display: flex; flex-direction: column;
         gap: 10px; min-height: calc(100vh - 150px); }
  .msg { padding: 10px 14px; border-radius: 10px; white-space: pre-wrap; max-width: 85%; }
  .user { align-self: flex-end; background: #2f6fde; color: white; }
  .assistant { align-self: flex-start; background: white; border: 1px solid #ddd; }
  .error { align-self: center; background: #fde2e2; color: #8a1c1c; }
  .stats { font-size: 12px; color: #777; align-self: flex-start; }
  form { position: sticky; bottom: 0; background: #f4f4f6; max-width: 820px; margin: 0 auto;
         padding: 12px 16px; display: flex; gap: 8px; }
  textarea { flex: 1; resize: vertical; min-height: 44px; font: inherit; padding: 8px; }
  button { padding: 0 18px; font: inherit; }
</style>
</head>
<body data-state="idle">
<header>
  <b>shadowkv</b><span id="model"></span>
  <label>max tokens <input id="max_tokens" type="number" value="256" min="1"></label>
  <label>temperature <input id="temperature" type="number" value="0.7" step="0.1" min="0" max="2"></label>
  <label>KV <select id="kv_policy"><option value="">server default</option>
    <option>full</option><option>shadowkv</option><option>snapkv</option><option>quest</option>
    <option>streaming</option></select></label>
  <button id="reset" type="button">new chat</button>
</header>
<div id="log"></div>
<form id="form">
  <textarea id="input" placeholder="Message (Enter sends, Shift+Enter for a new line)"></textarea>
  <button id="send" type="submit">Send</button>
</form>
<script>
"use strict";
const log = document.getElementById("log");
const input = document.getElementById("input");
const send = document.getElementById("send");
let messages = [];

fetch("/v1/models").then(r => r.json()).then(m => {
  document.getElementById("model").textContent = m.data[0].id;
}).catch(() => {});

function add(cls, text) {
  const div = document.createElement("div");
  div.className = "msg " + cls;
  div.textContent = text;
  log.appendChild(div);
  window.scrollTo(0, document.body.scrollHeight);
  return div;
}

async function ask(text) {
  messages.push({role: "user", content: text});
  add("user", text);
  const bubble = add("assistant", "");
  document.body.dataset.state = "streaming";
  send.disabled = true;
  const body = {messages: messages, stream: true, stream_options: {include_usage: true},
                max_tokens: Number(document.getElementById("max_tokens").value) || 256,
                temperature: Number(document.getElementById("temperature").value)};
  const policy = document.getElementById("kv_policy").value;
  if (policy) body.kv_policy = policy;
  const started = performance.now();
  let first = 0, answer = "", usage = null;
  try {
    const response = await fetch("/v1/chat/completions", {
      method: "POST", headers: {"Content-Type": "application/json"}, body: JSON.stringify(body)});
    if (!response.ok) {
      const error = await response.json().catch(() => ({error: {message: response.statusText}}));
      throw new Error(error.error.message);
    }
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const {value, done} = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, {stream: true});
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const event = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        if (!event.startsWith("data: ")) continue;
        const data = event.slice(6);
        if (data === "[DONE]") continue;
        const chunk = JSON.parse(data);
        if (chunk.error) throw new Error(chunk.error.message);
        if (chunk.usage) usage = chunk.usage;
        for (const choice of chunk.choices || []) {
          const piece = (choice.delta && choice.delta.content) || "";
          if (piece && !first) first = performance.now();
          answer += piece;
          bubble.textContent = answer;
        }
      }
    }
    messages.push({role: "assistant", content: answer});
    if (usage) {
      const cached = usage.prompt_tokens_details ? usage.prompt_tokens_details.cached_tokens : 0;
      add("stats", `${usage.completion_tokens} tokens, first after ` +
          `${((first || performance.now()) - started).toFixed(0)} ms; prompt ` +
          `${usage.prompt_tokens} tokens (${cached} reused)`);
    }
    bubble.dataset.done = "1";
  } catch (e) {
    messages.pop();
    bubble.remove();
    add("error", String(e.message || e));
  } finally {
    document.body.dataset.state = "idle";
    send.disabled = false;
    input.focus();
  }
}

document.getElementById("form").addEventListener("submit", e => {
  e.preventDefault();
  const text = input.value.trim();
  if (!text || document.body.dataset.state !== "idle") return;
  input.value = "";
  ask(text);
});
input.addEventListener("keydown", e => {
  if (e.key === "Enter" && !e.shiftKey) {
    e.preventDefault();
    document.getElementById("form").requestSubmit();
  }
});
document.getElementById("reset").addEventListener("click", () => {
  messages = [];
  log.replaceChildren();
});
</script>
</body>
</html>
)PAGE";

}  // namespace

std::string_view ChatPageHtml() { return kPage; }

}  // namespace shadowkv::server
