// Shoal's /v1/chat/completions and /v1/completions driven by the official
// OpenAI Node SDK, streaming included. The generator is a small scripted
// OpenAI-compatible server in this file (Shoal has none of its own), served
// through a model with "runtime": "openai".
//
//   npm ci --prefix tests/js
//   SHOAL_BIN=$PWD/build/src/cli/shoal node --test tests/js/openai_chat_test.mjs
import { spawn } from 'node:child_process';
import fs from 'node:fs';
import http from 'node:http';
import os from 'node:os';
import path from 'node:path';
import { after, before, describe, test } from 'node:test';
import assert from 'node:assert/strict';

import OpenAI from 'openai';

const MODEL = 'remote-chat';
const START_TIMEOUT_MS = 60_000;

// The upstream: chat and completions; streams three chunks on request.
function startUpstream() {
  const server = http.createServer((req, res) => {
    let body = '';
    req.on('data', (c) => { body += c; });
    req.on('end', async () => {
      const r = JSON.parse(body);
      const said = r.messages ? r.messages[0].content : r.prompt;
      if (said === 'fail') {
        res.writeHead(400, { 'Content-Type': 'application/json' });
        res.end(JSON.stringify({ error: { message: 'upstream says no', code: 'nope' } }));
        return;
      }
      if (r.stream) {
        res.writeHead(200, { 'Content-Type': 'text/event-stream' });
        for (const w of ['Hello', ' from', ' upstream']) {
          res.write(`data: ${JSON.stringify({
            id: 'c1', object: 'chat.completion.chunk', created: 1, model: r.model,
            choices: [{ index: 0, delta: { content: w }, finish_reason: null }],
          })}\n\n`);
          await new Promise((t) => setTimeout(t, 20));
        }
        res.end('data: [DONE]\n\n');
        return;
      }
      res.writeHead(200, { 'Content-Type': 'application/json' });
      if (r.messages) {
        res.end(JSON.stringify({
          id: 'c2', object: 'chat.completion', created: 1, model: r.model,
          choices: [{ index: 0, message: { role: 'assistant', content: `echo: ${said}` }, finish_reason: 'stop' }],
          usage: { prompt_tokens: 1, completion_tokens: 2, total_tokens: 3 },
        }));
      } else {
        res.end(JSON.stringify({
          id: 'c3', object: 'text_completion', created: 1, model: r.model,
          choices: [{ index: 0, text: `echo: ${said}`, finish_reason: 'stop' }],
        }));
      }
    });
  });
  return new Promise((resolve) => server.listen(0, '127.0.0.1', () => resolve(server)));
}

function startServe(dataDir, modelsDir) {
  const bin = process.env.SHOAL_BIN;
  if (!bin) throw new Error('set SHOAL_BIN to the built shoal binary');
  const child = spawn(
    path.resolve(bin),
    ['serve', '--data-dir', dataDir, '--port', '0', '--models-dir', modelsDir, '--models', MODEL,
     '--threads', '1'],
    { stdio: ['ignore', 'pipe', 'inherit'], detached: true },
  );
  const url = new Promise((resolve, reject) => {
    let out = '';
    const timer = setTimeout(() => reject(new Error(`shoal serve did not start; stdout:\n${out}`)),
      START_TIMEOUT_MS);
    child.stdout.setEncoding('utf8');
    child.stdout.on('data', (chunk) => {
      out += chunk;
      const m = out.match(/Shoal is serving \d+ model\(s\) at (http:\/\/\S+)/);
      if (m) {
        clearTimeout(timer);
        resolve(m[1]);
      }
    });
    child.on('exit', (code, signal) => {
      clearTimeout(timer);
      reject(new Error(`shoal serve exited (${code ?? signal}) before serving; stdout:\n${out}`));
    });
  });
  return { child, url };
}

async function waitReady(url) {
  const deadline = Date.now() + START_TIMEOUT_MS;
  for (;;) {
    try {
      const r = await fetch(`${url}/readyz`);
      if (r.status === 200) return;
    } catch {
      // not listening yet
    }
    if (Date.now() > deadline) throw new Error('/readyz never became 200');
    await new Promise((r) => setTimeout(r, 100));
  }
}

function stop(child) {
  if (child.exitCode !== null || child.signalCode !== null) return Promise.resolve();
  return new Promise((resolve) => {
    const kill = setTimeout(() => {
      try {
        process.kill(-child.pid, 'SIGKILL');
      } catch {
        // already gone
      }
    }, 15_000);
    child.once('exit', () => {
      clearTimeout(kill);
      resolve();
    });
    child.kill('SIGTERM');
  });
}

describe('OpenAI SDK chat and completions against shoal serve', () => {
  let upstream;
  let server;
  let dir;
  let client;

  before(async () => {
    upstream = await startUpstream();
    dir = fs.mkdtempSync(path.join(os.tmpdir(), 'shoal-js-chat-'));
    const models = path.join(dir, 'models');
    fs.mkdirSync(path.join(models, MODEL), { recursive: true });
    fs.writeFileSync(path.join(models, MODEL, 'shoal.json'), JSON.stringify({
      name: MODEL, task: 'generate', runtime: 'openai',
      openai: { base_url: `http://127.0.0.1:${upstream.address().port}/v1`, model: 'fake-llm' },
    }));
    server = startServe(path.join(dir, 'data'), models);
    const url = await server.url;
    await waitReady(url);
    client = new OpenAI({ baseURL: `${url}/v1`, apiKey: 'unused', maxRetries: 0, timeout: 30_000 });
  });

  after(async () => {
    if (server) await stop(server.child);
    if (upstream) upstream.close();
    if (dir) fs.rmSync(dir, { recursive: true, force: true });
  });

  test('chat completion', async () => {
    const res = await client.chat.completions.create({ model: MODEL, messages: [{ role: 'user', content: 'hi' }] });
    assert.equal(res.model, MODEL);
    assert.equal(res.choices[0].message.content, 'echo: hi');
  });

  test('completion', async () => {
    const res = await client.completions.create({ model: MODEL, prompt: 'once' });
    assert.equal(res.choices[0].text, 'echo: once');
  });

  test('streamed chat completion', async () => {
    const stream = await client.chat.completions.create({
      model: MODEL, messages: [{ role: 'user', content: 'tell me' }], stream: true,
    });
    const parts = [];
    for await (const chunk of stream) {
      assert.equal(chunk.object, 'chat.completion.chunk');
      assert.equal(chunk.model, MODEL);
      parts.push(chunk.choices[0].delta.content);
    }
    assert.deepEqual(parts, ['Hello', ' from', ' upstream']);
  });

  test('upstream 400 throws BadRequestError with its message', async () => {
    await assert.rejects(
      client.chat.completions.create({ model: MODEL, messages: [{ role: 'user', content: 'fail' }] }),
      (err) => {
        assert.ok(err instanceof OpenAI.BadRequestError, `got ${err?.constructor?.name}: ${err}`);
        assert.equal(err.code, 'nope');
        assert.match(err.message, /upstream says no/);
        return true;
      },
    );
  });
});
