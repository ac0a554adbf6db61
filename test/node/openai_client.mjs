// The official openai npm package against a server; prints one JSON line with what the SDK returned or reported.
// Usage: node openai_client.mjs <base URL ending in /v1> <mode> [<request JSON>]
//   error:  a chat request expected to fail -> {ok: false, status, message, type, param}
//   calls:  a plain chat, a streamed chat and a forced tool call -> {plain, streamed, chunks, tool}
import OpenAI from "openai";

const [baseURL, mode, body] = process.argv.slice(2);
const client = new OpenAI({ baseURL, apiKey: "unused", maxRetries: 0 });

async function error() {
  try {
    await client.chat.completions.create(JSON.parse(body));
    return { ok: true };
  } catch (e) {
    return { ok: false, status: e.status, message: e.message, type: e.type ?? null, param: e.param ?? null };
  }
}

async function calls() {
  const ask = { model: "m", messages: [{ role: "user", content: "What is the capital of France?" }],
                max_tokens: 8, temperature: 0 };
  const plain = await client.chat.completions.create(ask);
  let streamed = "", chunks = 0;
  for await (const chunk of await client.chat.completions.create({ ...ask, stream: true })) {
    chunks += 1;
    streamed += chunk.choices[0]?.delta?.content ?? "";
  }
  const tools = [{ type: "function", function: { name: "get_weather", parameters: {
    type: "object", properties: { city: { type: "string", maxLength: 12 } }, required: ["city"],
    additionalProperties: false } } }];
  const tool = await client.chat.completions.create({ ...ask, max_tokens: 24, tools,
    tool_choice: { type: "function", function: { name: "get_weather" } } });
  return { plain: plain.choices[0].message.content, streamed, chunks,
           tool: tool.choices[0].message.tool_calls ?? null, finish: tool.choices[0].finish_reason };
}

console.log(JSON.stringify(mode === "error" ? await error() : await calls()));
