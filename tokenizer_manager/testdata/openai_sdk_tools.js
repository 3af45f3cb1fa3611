// Drives ebb's chat endpoint with the official OpenAI SDK for Node: a tool
// call (plain and streamed) and a response_format ebb cannot honour.
//   NODE_PATH=.cache/npm/node_modules node openai_sdk_tools.js http://HOST/v1
"use strict";
const mod = require("openai");
const OpenAI = mod.OpenAI || mod.default || mod;

const tools = [{type: "function", function: {name: "get_weather", description: "Current weather in a city",
  parameters: {type: "object", properties: {city: {type: "string"}, unit: {type: "string"}}, required: ["city"]}}}];
const messages = [{role: "user", content: "What is the weather in Paris?"}];

(async () => {
  const client = new OpenAI({baseURL: process.argv[2], apiKey: "unused", maxRetries: 0});
  const out = {};
  const r = await client.chat.completions.create({model: "m", messages, tools});
  const c = r.choices[0];
  out.Finish = c.finish_reason;
  out.Name = c.message.tool_calls[0].function.name;
  out.City = JSON.parse(c.message.tool_calls[0].function.arguments).city;
  const stream = await client.chat.completions.create({model: "m", messages, tools, stream: true});
  out.StreamName = "";
  out.StreamArgs = "";
  for await (const chunk of stream) {
    const ch = chunk.choices[0];
    if (!ch) continue;
    for (const tc of ch.delta.tool_calls || []) {
      out.StreamName += (tc.function && tc.function.name) || "";
      out.StreamArgs += (tc.function && tc.function.arguments) || "";
    }
    if (ch.finish_reason) out.StreamFinish = ch.finish_reason;
  }
  try {
    await client.chat.completions.create({model: "m", messages,
      response_format: {type: "json_schema", json_schema: {name: "w", schema: {type: "object"}}}});
    out.JSONSchemaStatus = 200;
  } catch (e) {
    out.JSONSchemaStatus = e.status;
  }
  console.log(JSON.stringify(out));
})().catch((e) => { console.error(e); process.exit(1); });
