// One request through the official openai npm package; prints what the SDK reports, as one JSON line.
// Usage: node error_body.mjs <base URL ending in /v1> <request JSON>
import OpenAI from "openai";

const [baseURL, body] = process.argv.slice(2);
const client = new OpenAI({ baseURL, apiKey: "unused", maxRetries: 0 });
try {
  const r = await client.chat.completions.create(JSON.parse(body));
  console.log(JSON.stringify({ ok: true, content: r.choices[0].message.content }));
} catch (e) {
  console.log(JSON.stringify({ ok: false, status: e.status, message: e.message, type: e.type ?? null,
                               param: e.param ?? null }));
}
