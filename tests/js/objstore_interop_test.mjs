// Object-store interoperability: Shoal's NATS object store (driven through
// the shoal_blob_tool binary) and the official `nats` npm client read each
// other's objects, deletes and digests. Starts its own nats-server -js.
//
//   SHOAL_BLOB_TOOL=build/tests/shoal_blob_tool node --test tests/js/objstore_interop_test.mjs
import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { spawn, spawnSync } from "node:child_process";
import { createHash, randomBytes } from "node:crypto";
import { mkdtempSync, readFileSync, rmSync, writeFileSync } from "node:fs";
import net from "node:net";
import os from "node:os";
import path from "node:path";
import { fileURLToPath } from "node:url";
import { connect } from "nats";

const here = path.dirname(fileURLToPath(import.meta.url));
const tool = process.env.SHOAL_BLOB_TOOL ?? path.join(here, "..", "..", "build", "tests", "shoal_blob_tool");

let server, nc, js, dir, url;

function freePort() {
  return new Promise((resolve, reject) => {
    const s = net.createServer();
    s.on("error", reject);
    s.listen(0, "127.0.0.1", () => {
      const { port } = s.address();
      s.close(() => resolve(port));
    });
  });
}

async function waitForServer(port) {
  for (let i = 0; i < 100; i++) {
    try {
      return await connect({ servers: `127.0.0.1:${port}` });
    } catch {
      await new Promise((r) => setTimeout(r, 100));
    }
  }
  throw new Error("nats-server did not start");
}

// Runs shoal_blob_tool against bucket `bucket`; returns { status, stdout, stderr }.
function shoal(bucket, ...args) {
  const r = spawnSync(tool, ["--nats", url, "--store", `nats://${bucket}`, ...args], { encoding: "utf8" });
  if (r.error) throw r.error;
  return r;
}

const sha256 = (bytes) => createHash("sha256").update(bytes).digest();
const natsDigest = (bytes) => "SHA-256=" + sha256(bytes).toString("base64url") + "=";

before(async () => {
  dir = mkdtempSync(path.join(os.tmpdir(), "shoal-objstore-"));
  const port = await freePort();
  server = spawn("nats-server", ["-js", "-sd", path.join(dir, "js"), "-a", "127.0.0.1", "-p", String(port)], {
    stdio: "ignore",
  });
  url = `nats://127.0.0.1:${port}`;
  nc = await waitForServer(port);
  js = nc.jetstream();
});

after(async () => {
  await nc?.close();
  server?.kill("SIGTERM");
  if (dir) rmSync(dir, { recursive: true, force: true });
});

test("an object Shoal writes is read by nats.js, digest included", async () => {
  const data = randomBytes(1024 * 1024 + 3);
  const file = path.join(dir, "shoal-put.bin");
  writeFileSync(file, data);
  const put = shoal("SHOAL_MADE", "put", "from-shoal.bin", file);
  assert.equal(put.status, 0, put.stderr);
  assert.match(put.stdout.trim(), /^nats-os:\/\/SHOAL_MADE\/from-shoal\.bin\?size=1048579&sha256=[0-9a-f]{64}$/);
  assert.ok(put.stdout.includes(sha256(data).toString("hex")));

  const store = await js.views.os("SHOAL_MADE"); // binds to the bucket Shoal created
  const info = await store.info("from-shoal.bin");
  assert.equal(info.size, data.length);
  assert.equal(info.chunks, 9);
  assert.equal(info.digest, natsDigest(data));
  const got = await store.getBlob("from-shoal.bin"); // nats.js verifies the digest
  assert.ok(Buffer.from(got).equals(data));
});

test("an object nats.js writes is read by Shoal", async () => {
  const store = await js.views.os("JS_MADE"); // nats.js creates this bucket
  const data = randomBytes(1024 * 1024 + 3);
  const info = await store.putBlob({ name: "from-js.bin" }, data);
  assert.equal(info.chunks, 9);
  const out = path.join(dir, "shoal-get.bin");
  const get = shoal("JS_MADE", "get", "from-js.bin", out);
  assert.equal(get.status, 0, get.stderr);
  assert.ok(readFileSync(out).equals(data));
  assert.ok(get.stdout.includes(sha256(data).toString("hex")));
});

test("empty objects travel both ways", async () => {
  const store = await js.views.os("SHOAL_MADE");
  const empty = path.join(dir, "empty.bin");
  writeFileSync(empty, Buffer.alloc(0));
  assert.equal(shoal("SHOAL_MADE", "put", "empty-from-shoal", empty).status, 0);
  assert.equal((await store.getBlob("empty-from-shoal")).length, 0);

  await store.putBlob({ name: "empty-from-js" }, new Uint8Array(0));
  const out = path.join(dir, "empty-out.bin");
  const get = shoal("SHOAL_MADE", "get", "empty-from-js", out);
  assert.equal(get.status, 0, get.stderr);
  assert.equal(readFileSync(out).length, 0);
});

test("deletes are seen by the other side", async () => {
  const store = await js.views.os("SHOAL_MADE");
  const data = randomBytes(300 * 1024);
  const file = path.join(dir, "del.bin");
  writeFileSync(file, data);

  // Shoal deletes, nats.js sees nothing.
  assert.equal(shoal("SHOAL_MADE", "put", "del-by-shoal", file).status, 0);
  assert.equal(shoal("SHOAL_MADE", "delete", "del-by-shoal").status, 0);
  assert.equal(await store.getBlob("del-by-shoal"), null);
  assert.equal((await store.info("del-by-shoal")).deleted, true);

  // nats.js deletes, Shoal reports not found (exit status 2).
  await store.putBlob({ name: "del-by-js" }, data);
  await store.delete("del-by-js");
  const get = shoal("SHOAL_MADE", "get", "del-by-js", path.join(dir, "x.bin"));
  assert.equal(get.status, 2, get.stderr);
  assert.match(get.stderr, /blob_not_found/);
});

test("a reference to an object nats.js replaced is refused as corrupt", async () => {
  const store = await js.views.os("SHOAL_MADE");
  const file = path.join(dir, "orig.bin");
  writeFileSync(file, randomBytes(200 * 1024));
  const put = shoal("SHOAL_MADE", "put", "replaced", file);
  assert.equal(put.status, 0, put.stderr);
  const ref = put.stdout.trim();
  await store.putBlob({ name: "replaced" }, randomBytes(200 * 1024));
  const out = path.join(dir, "replaced-out.bin");
  const get = shoal("SHOAL_MADE", "getref", ref, out);
  assert.equal(get.status, 3, get.stderr);
  assert.match(get.stderr, /blob_corrupt/);
});
