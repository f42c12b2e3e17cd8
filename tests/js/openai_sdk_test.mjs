// Shoal's /v1/embeddings driven by the official OpenAI Node SDK: the SDK's
// default base64 path, explicit float, and its typed errors.
//
//   npm ci --prefix tests/js
//   SHOAL_BIN=$PWD/build/src/cli/shoal node --test tests/js/openai_sdk_test.mjs
//
// SHOAL_BIN: the built `shoal` binary (required; relative paths resolve
// against the working directory). SHOAL_MODELS_DIR: the generated demo
// models (default: <repo>/models).
import { spawn } from 'node:child_process';
import fs from 'node:fs';
import os from 'node:os';
import path from 'node:path';
import { after, before, describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { fileURLToPath } from 'node:url';

import OpenAI from 'openai';

const here = path.dirname(fileURLToPath(import.meta.url));
const MODEL = 'tiny-bert';
const DIM = 64;
const START_TIMEOUT_MS = 60_000;

function norm(v) {
  return Math.sqrt(v.reduce((s, x) => s + x * x, 0));
}

function maxAbsDiff(a, b) {
  assert.equal(a.length, b.length);
  return a.reduce((m, x, i) => Math.max(m, Math.abs(x - b[i])), 0);
}

// Starts `shoal serve --port 0` and resolves with its base URL.
function startServe(dataDir) {
  const bin = process.env.SHOAL_BIN;
  if (!bin) throw new Error('set SHOAL_BIN to the built shoal binary');
  const modelsDir = process.env.SHOAL_MODELS_DIR || path.resolve(here, '../../models');
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
    child.on('error', (err) => {
      clearTimeout(timer);
      reject(err);
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

// SIGTERM and wait for a clean exit; SIGKILL the group if it hangs.
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

describe('OpenAI SDK against shoal serve', () => {
  let server;
  let dataDir;
  let client;

  before(async () => {
    dataDir = fs.mkdtempSync(path.join(os.tmpdir(), 'shoal-js-'));
    server = startServe(dataDir);
    const url = await server.url;
    await waitReady(url);
    client = new OpenAI({ baseURL: `${url}/v1`, apiKey: 'unused', maxRetries: 0, timeout: 30_000 });
  });

  after(async () => {
    if (server) await stop(server.child);
    if (dataDir) fs.rmSync(dataDir, { recursive: true, force: true });
  });

  const inputs = ['The quick brown fox.', 'Shoal serves small models.', 'hello world'];

  test('default request (base64, decoded by the SDK)', async () => {
    const res = await client.embeddings.create({ model: MODEL, input: inputs });
    assert.equal(res.object, 'list');
    assert.equal(res.model, MODEL);
    assert.equal(res.data.length, inputs.length);
    res.data.forEach((d, i) => {
      assert.equal(d.object, 'embedding');
      assert.equal(d.index, i);
      assert.equal(d.embedding.length, DIM);
      assert.ok(Math.abs(norm(d.embedding) - 1) < 1e-4, `row ${i} norm ${norm(d.embedding)}`);
    });
    assert.ok(res.usage.prompt_tokens > 0);
    assert.equal(res.usage.total_tokens, res.usage.prompt_tokens);
  });

  test('encoding_format float matches the base64 path', async () => {
    const b64 = await client.embeddings.create({ model: MODEL, input: inputs });
    const flt = await client.embeddings.create({ model: MODEL, input: inputs, encoding_format: 'float' });
    assert.equal(flt.data.length, inputs.length);
    flt.data.forEach((d, i) => {
      assert.ok(Array.isArray(d.embedding));
      assert.equal(d.embedding.length, DIM);
      assert.ok(Math.abs(norm(d.embedding) - 1) < 1e-4);
      assert.ok(maxAbsDiff(d.embedding, b64.data[i].embedding) < 1e-6, `row ${i}`);
    });
  });

  test('single string input and dimensions', async () => {
    const one = await client.embeddings.create({ model: MODEL, input: 'just one' });
    assert.equal(one.data.length, 1);
    assert.equal(one.data[0].embedding.length, DIM);
    const short = await client.embeddings.create({ model: MODEL, input: 'just one', dimensions: 32 });
    assert.equal(short.data[0].embedding.length, 32);
    assert.ok(Math.abs(norm(short.data[0].embedding) - 1) < 1e-4);
  });

  test('unknown model throws NotFoundError (404)', async () => {
    await assert.rejects(
      client.embeddings.create({ model: 'no-such-model', input: 'hi' }),
      (err) => {
        assert.ok(err instanceof OpenAI.NotFoundError, `got ${err?.constructor?.name}: ${err}`);
        assert.equal(err.status, 404);
        assert.equal(err.code, 'model_not_found');
        return true;
      },
    );
  });

  test('bad input throws BadRequestError (400)', async () => {
    await assert.rejects(
      client.embeddings.create({ model: MODEL, input: '' }),
      (err) => {
        assert.ok(err instanceof OpenAI.BadRequestError, `got ${err?.constructor?.name}: ${err}`);
        assert.equal(err.status, 400);
        assert.equal(err.code, 'empty_input');
        return true;
      },
    );
  });
});
