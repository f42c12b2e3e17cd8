// Blob stores: the same behaviour suite over the local directory store and
// the NATS object store (against a real nats-server -js), plus reference
// parsing, the object-store layout, tampering and orphan clean-up.
#include "blob/blob_store.h"

#include <nats/nats.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <functional>
#include <future>
#include <optional>
#include <random>
#include <thread>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "blob/internal/codec.h"
#include "blob/local_dir_blob_store.h"
#include "blob/nats_object_store.h"
#include "common/clock.h"
#include "queue/nats_client.h"
#include "support/test_env.h"

namespace shoal {
namespace {

std::string RandomBytes(size_t n, uint32_t seed = 7) {
  std::mt19937 rng(seed);
  std::string s(n, '\0');
  for (auto& c : s) c = static_cast<char>(rng() & 0xff);
  return s;
}

#define EXPECT_STATUS(expr, code_, reason_)                                   \
  do {                                                                        \
    const ::shoal::Status _st = (expr);                                       \
    EXPECT_EQ(_st.code(), (code_)) << _st.ToString();                         \
    EXPECT_EQ(_st.ReasonOrDefault(), std::string(reason_)) << _st.ToString(); \
  } while (0)

constexpr int64_t kChunk = 128 * 1024;

// ----- References ---------------------------------------------------------------

TEST(BlobRef, RoundTripsThroughText) {
  BlobRef ref;
  ref.scheme = "nats-os";
  ref.store = "SHOAL_BLOBS";
  ref.name = "req-1.payload";
  ref.size = 1048579;
  ref.sha256 = blob_internal::Sha256Of("abc");
  const std::string text = ref.ToString();
  EXPECT_EQ(text,
            "nats-os://SHOAL_BLOBS/req-1.payload?size=1048579&sha256="
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  auto parsed = ParseBlobRef(text);
  ASSERT_TRUE(parsed.ok()) << parsed.status().ToString();
  EXPECT_EQ(*parsed, ref);
}

TEST(BlobRef, RejectsBadReferences) {
  const std::string digest = blob_internal::HexEncode(blob_internal::Sha256Of(""));
  const std::string ok_tail = "?size=0&sha256=" + digest;
  for (const std::string& bad : std::vector<std::string>{
           "s3x://bucket/name" + ok_tail,           // unknown scheme
           "no-scheme" + ok_tail,
           "file://local/../etc/passwd" + ok_tail,  // traversal
           "file://local/..%2fetc" + ok_tail,
           "file://local/a/b" + ok_tail,            // no sub-directories
           "file://local/.hidden" + ok_tail,
           "file://local/" + ok_tail,               // empty name
           "file://../x" + ok_tail,                 // bad store id
           std::string("file://local/x"),           // no size, no digest
           "file://local/x?size=1",
           "file://local/x?size=-1&sha256=" + digest,
           "file://local/x?size=1&sha256=abc",
           "file://local/x?size=1&sha256=" + std::string(64, 'z'),
       }) {
    auto r = ParseBlobRef(bad);
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << bad;
    EXPECT_EQ(r.status().reason(), kBlobRefInvalid) << bad;
  }
}

TEST(BlobCodec, Base64AndTimes) {
  using namespace blob_internal;
  EXPECT_EQ(Base64UrlEncode("name", true), "bmFtZQ==");
  EXPECT_EQ(Base64UrlEncode("\xfb\xff", true), "-_8=");
  EXPECT_EQ(Base64UrlEncode("\xfb\xff", false), "-_8");
  EXPECT_EQ(Base64Decode("-_8=").value(), "\xfb\xff");
  EXPECT_EQ(Base64Decode("+/8").value(), "\xfb\xff");
  EXPECT_FALSE(Base64Decode("a").has_value());
  EXPECT_EQ(FormatRfc3339Ms(1700000000123), "2023-11-14T22:13:20.123Z");
  EXPECT_EQ(ParseRfc3339Ms("2023-11-14T22:13:20.123Z").value(), 1700000000123);
  EXPECT_EQ(ParseRfc3339Ms("2023-11-14T22:13:20.123456789Z").value(), 1700000000123);
  EXPECT_EQ(ParseRfc3339Ms("2023-11-14T23:13:20+01:00").value(), 1700000000000);
  EXPECT_FALSE(ParseRfc3339Ms("yesterday").has_value());
}

TEST(OpenBlobStore, ChoosesTheStoreByUrl) {
  testing::TempDir dir;
  auto file = OpenBlobStore("file://" + dir.path() + "/blobs?id=box1", nullptr);
  ASSERT_TRUE(file.ok()) << file.status().ToString();
  EXPECT_EQ((*file)->scheme(), "file");
  EXPECT_EQ((*file)->store_id(), "box1");
  EXPECT_EQ(OpenBlobStore("ftp://x/y", nullptr).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(OpenBlobStore("file://relative/dir", nullptr).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(OpenBlobStore("nats://", nullptr).status().code(), StatusCode::kInvalidArgument);

  testing::TestNatsServer server;
  NatsOptions o;
  o.url = server.url();
  auto client = NatsClient::Connect(o);
  ASSERT_TRUE(client.ok());
  auto def = OpenBlobStore("nats://", client->get());
  ASSERT_TRUE(def.ok()) << def.status().ToString();
  EXPECT_EQ((*def)->scheme(), "nats-os");
  EXPECT_EQ((*def)->store_id(), "SHOAL_BLOBS");
  auto named = OpenBlobStore("nats-os://MINE?chunk_bytes=4096&max_age_ms=60000", client->get());
  ASSERT_TRUE(named.ok()) << named.status().ToString();
  EXPECT_EQ((*named)->store_id(), "MINE");
  EXPECT_EQ(OpenBlobStore("nats://bad.bucket", client->get()).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(OpenBlobStore("nats://B?color=red", client->get()).status().code(), StatusCode::kInvalidArgument);
}

// ----- The suite both stores pass -------------------------------------------------

class BlobStoreTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    if (GetParam() != "file") {
      server_ = std::make_unique<testing::TestNatsServer>();
      NatsOptions o;
      o.url = server_->url();
      auto c = NatsClient::Connect(o);
      ASSERT_TRUE(c.ok()) << c.status().ToString();
      client_ = std::move(c).value();
      NatsObjectStoreOptions so;
      so.bucket = "TEST_BLOBS";
      so.clock = &clock_;
      if (GetParam() == "nats_leader_reads") {
        // Every read at the leader, chunk by chunk (no consumer).
        so.direct_reads = false;
        so.stream_read_min_chunks = 1 << 30;
      }
      auto s = NatsObjectStore::Open(*client_, so);
      ASSERT_TRUE(s.ok()) << s.status().ToString();
      nats_ = s->get();
      store_ = std::move(s).value();
    } else {
      LocalDirBlobStoreOptions lo;
      lo.dir = dir_.path() + "/blobs";
      lo.clock = &clock_;
      auto s = LocalDirBlobStore::Create(lo);
      ASSERT_TRUE(s.ok()) << s.status().ToString();
      local_ = s->get();
      store_ = std::move(s).value();
    }
  }

  // A reference in this store to blob `name` holding `data`.
  BlobRef RefTo(const std::string& name, std::string_view data) const {
    BlobRef ref;
    ref.scheme = std::string(store_->scheme());
    ref.store = store_->store_id();
    ref.name = name;
    ref.size = data.size();
    ref.sha256 = blob_internal::Sha256Of(data);
    return ref;
  }

  // Replaces the stored bytes of `ref` by others of the same length,
  // leaving the store's own metadata alone.
  void TamperBytes(const BlobRef& ref) {
    std::string other = RandomBytes(ref.size, 99);
    if (local_) {
      std::ofstream f(local_->PathOf(ref.name), std::ios::binary | std::ios::trunc);
      f << other;
      return;
    }
    auto meta = LastMeta(ref.name);
    const std::string subject = nats_->ChunkSubject(meta["nuid"]);
    jsOptions o;
    jsOptions_Init(&o);
    o.Stream.Purge.Subject = subject.c_str();
    ASSERT_EQ(js_PurgeStream(client_->js(), nats_->stream_name().c_str(), &o, nullptr), NATS_OK);
    for (size_t off = 0; off < other.size(); off += kChunk) {
      const size_t n = std::min<size_t>(kChunk, other.size() - off);
      ASSERT_EQ(js_Publish(nullptr, client_->js(), subject.c_str(), other.data() + off, static_cast<int>(n),
                           nullptr, nullptr),
                NATS_OK);
    }
  }

  nlohmann::json LastMeta(const std::string& name) {
    const std::string subject = nats_->MetaSubject(name);
    natsMsg* m = nullptr;
    EXPECT_EQ(js_GetLastMsg(&m, client_->js(), nats_->stream_name().c_str(), subject.c_str(), nullptr, nullptr),
              NATS_OK);
    if (m == nullptr) return {};
    NatsMsgPtr owned(m);
    return nlohmann::json::parse(std::string(natsMsg_GetData(m), natsMsg_GetDataLength(m)));
  }

  testing::TempDir dir_;
  FakeClock clock_;
  std::unique_ptr<testing::TestNatsServer> server_;
  std::unique_ptr<NatsClient> client_;
  std::unique_ptr<BlobStore> store_;
  NatsObjectStore* nats_ = nullptr;
  LocalDirBlobStore* local_ = nullptr;
};

TEST_P(BlobStoreTest, RoundTripsEverySize) {
  for (size_t size : {size_t{0}, size_t{1}, size_t(kChunk), size_t(kChunk + 1), size_t{5} << 20}) {
    SCOPED_TRACE(size);
    const std::string data = RandomBytes(size, static_cast<uint32_t>(size));
    auto ref = store_->Put(data);
    ASSERT_TRUE(ref.ok()) << ref.status().ToString();
    EXPECT_EQ(ref->scheme, store_->scheme());
    EXPECT_EQ(ref->store, store_->store_id());
    EXPECT_EQ(ref->size, size);
    EXPECT_EQ(ref->sha256, blob_internal::Sha256Of(data));
    // What travels in a message is the text form.
    auto parsed = ParseBlobRef(ref->ToString());
    ASSERT_TRUE(parsed.ok()) << parsed.status().ToString();
    auto got = store_->Get(*parsed);
    ASSERT_TRUE(got.ok()) << got.status().ToString();
    EXPECT_TRUE(*got == data);
    auto stat = store_->Stat(ref->name);
    ASSERT_TRUE(stat.ok()) << stat.status().ToString();
    EXPECT_EQ(*stat, *ref);
  }
}

TEST_P(BlobStoreTest, StreamsFromASourceAndToASink) {
  const std::string data = RandomBytes((1 << 20) + 3);
  size_t offset = 0;
  // Odd piece sizes: chunking must not depend on how the source slices.
  BlobSource source = [&](char* buf, size_t cap) -> Result<size_t> {
    size_t n = std::min({cap, size_t{7777}, data.size() - offset});
    std::memcpy(buf, data.data() + offset, n);
    offset += n;
    return n;
  };
  auto ref = store_->PutFrom(source, "streamed.bin");
  ASSERT_TRUE(ref.ok()) << ref.status().ToString();
  EXPECT_EQ(ref->name, "streamed.bin");
  std::string out;
  size_t pieces = 0;
  ASSERT_TRUE(store_->GetTo(*ref, [&](std::string_view p) {
                      out.append(p);
                      ++pieces;
                      return Status::Ok();
                    }).ok());
  EXPECT_TRUE(out == data);
  EXPECT_GT(pieces, 1u);
}

TEST_P(BlobStoreTest, AFailingSourceLeavesNothing) {
  int calls = 0;
  BlobSource source = [&](char* buf, size_t cap) -> Result<size_t> {
    if (++calls > 3) return Unavailable("client went away");
    std::memset(buf, 'x', cap);
    return cap;
  };
  auto ref = store_->PutFrom(source, "broken");
  EXPECT_EQ(ref.status().code(), StatusCode::kUnavailable);
  EXPECT_EQ(store_->Stat("broken").status().reason(), kBlobNotFound);
  if (local_) {
    size_t files = 0;
    for (auto& e : std::filesystem::directory_iterator(dir_.path() + "/blobs")) {
      (void)e;
      ++files;
    }
    EXPECT_EQ(files, 0u);
  } else {
    auto counts = GetSubjectCounts(*client_, nats_->stream_name(), "$O.TEST_BLOBS.>");
    ASSERT_TRUE(counts.ok());
    EXPECT_TRUE(counts->empty());
  }
}

TEST_P(BlobStoreTest, MissingBlobIsNotFound) {
  const BlobRef ref = RefTo("never-written", "abc");
  EXPECT_STATUS(store_->Get(ref).status(), StatusCode::kNotFound, kBlobNotFound);
  EXPECT_STATUS(store_->Stat("never-written").status(), StatusCode::kNotFound, kBlobNotFound);
}

// A FIFO under a blob's name (no blob: put there by hand) is not opened
// for reading, which would block until someone writes to it.
TEST_P(BlobStoreTest, AFifoUnderABlobsNameIsNotABlob) {
  if (local_ == nullptr) GTEST_SKIP() << "local directory stores only";
  ASSERT_EQ(::mkfifo(local_->PathOf("a-fifo").c_str(), 0600), 0);
  const BlobRef ref = RefTo("a-fifo", "");
  // Waits for `call` up to 10 s; a call still blocked is let go by a
  // writer opening the FIFO, so a failing test ends.
  const auto within = [&](auto call) -> std::optional<Status> {
    auto f = std::async(std::launch::async, call);
    if (f.wait_for(std::chrono::seconds(10)) == std::future_status::ready) return f.get();
    const int w = ::open(local_->PathOf("a-fifo").c_str(), O_WRONLY);
    if (w >= 0) ::close(w);
    f.wait();
    return std::nullopt;
  };
  auto got = within([&] { return store_->Get(ref).status(); });
  ASSERT_TRUE(got.has_value()) << "Get blocked on the FIFO";
  EXPECT_STATUS(*got, StatusCode::kNotFound, kBlobNotFound);
  auto stat = within([&] { return store_->Stat("a-fifo").status(); });
  ASSERT_TRUE(stat.has_value()) << "Stat blocked on the FIFO";
  EXPECT_STATUS(*stat, StatusCode::kNotFound, kBlobNotFound);
}

TEST_P(BlobStoreTest, DeleteThenGetIsNotFound) {
  auto ref = store_->Put("payload");
  ASSERT_TRUE(ref.ok());
  ASSERT_TRUE(store_->Delete(ref->name).ok());
  EXPECT_STATUS(store_->Get(*ref).status(), StatusCode::kNotFound, kBlobNotFound);
  EXPECT_TRUE(store_->Delete(ref->name).ok());  // idempotent
  EXPECT_TRUE(store_->Delete("never-written").ok());
}

TEST_P(BlobStoreTest, TamperedBytesAreCorrupt) {
  const std::string data = RandomBytes(3 * kChunk + 5);
  auto ref = store_->Put(data, "victim");
  ASSERT_TRUE(ref.ok());
  TamperBytes(*ref);
  EXPECT_STATUS(store_->Get(*ref).status(), StatusCode::kInternal, kBlobCorrupt);
}

TEST_P(BlobStoreTest, AReferenceWithAnotherDigestIsCorrupt) {
  auto ref = store_->Put("the real bytes");
  ASSERT_TRUE(ref.ok());
  BlobRef forged = *ref;
  forged.sha256[0] ^= 1;
  EXPECT_STATUS(store_->Get(forged).status(), StatusCode::kInternal, kBlobCorrupt);
  forged = *ref;
  forged.size += 1;
  EXPECT_STATUS(store_->Get(forged).status(), StatusCode::kInternal, kBlobCorrupt);
}

TEST_P(BlobStoreTest, ReplacingANameInvalidatesOldReferences) {
  auto first = store_->Put("first version", "doc");
  auto second = store_->Put("second, longer version", "doc");
  ASSERT_TRUE(first.ok() && second.ok());
  EXPECT_EQ(store_->Get(*second).value(), "second, longer version");
  EXPECT_STATUS(store_->Get(*first).status(), StatusCode::kInternal, kBlobCorrupt);
}

TEST_P(BlobStoreTest, RefusesForeignReferencesAndBadNames) {
  auto ref = store_->Put("x");
  ASSERT_TRUE(ref.ok());
  BlobRef other = *ref;
  other.scheme = GetParam() == "file" ? "nats-os" : "file";
  EXPECT_STATUS(store_->Get(other).status(), StatusCode::kInvalidArgument, kBlobStoreMismatch);
  other = *ref;
  other.store = "elsewhere";
  EXPECT_STATUS(store_->Get(other).status(), StatusCode::kInvalidArgument, kBlobStoreMismatch);
  other = *ref;
  other.name = "../../etc/passwd";
  EXPECT_STATUS(store_->Get(other).status(), StatusCode::kInvalidArgument, kBlobRefInvalid);
  EXPECT_STATUS(store_->Put("x", "../escape").status(), StatusCode::kInvalidArgument, kBlobRefInvalid);
  EXPECT_STATUS(store_->Put("x", "a/b").status(), StatusCode::kInvalidArgument, kBlobRefInvalid);
  EXPECT_STATUS(store_->Delete(".."), StatusCode::kInvalidArgument, kBlobRefInvalid);
  // The longest name a blob may have (255 characters) is stored and read.
  const std::string longest = "n" + std::string(254, 'a');
  auto named = store_->Put("y", longest);
  ASSERT_TRUE(named.ok()) << named.status().ToString();
  EXPECT_EQ(*store_->Get(*named), "y");
  EXPECT_STATUS(store_->Put("x", longest + "a").status(), StatusCode::kInvalidArgument, kBlobRefInvalid);
}

TEST_P(BlobStoreTest, SweepRemovesOldBlobsOnly) {
  auto old_ref = store_->Put(RandomBytes(2 * kChunk), "old");
  ASSERT_TRUE(old_ref.ok());
  clock_.AdvanceUs(int64_t{10} * 1000 * 1000);
  auto fresh_ref = store_->Put("fresh", "fresh");
  ASSERT_TRUE(fresh_ref.ok());
  auto removed = store_->Sweep(5000);
  ASSERT_TRUE(removed.ok()) << removed.status().ToString();
  EXPECT_EQ(*removed, 1u);
  EXPECT_STATUS(store_->Get(*old_ref).status(), StatusCode::kNotFound, kBlobNotFound);
  EXPECT_EQ(store_->Get(*fresh_ref).value(), "fresh");
  EXPECT_EQ(store_->Sweep(5000).value(), 0u);
  clock_.AdvanceUs(int64_t{10} * 1000 * 1000);
  EXPECT_EQ(store_->Sweep(5000).value(), 1u);
  EXPECT_STATUS(store_->Get(*fresh_ref).status(), StatusCode::kNotFound, kBlobNotFound);
}

TEST_P(BlobStoreTest, ConcurrentPutsAndGets) {
  std::vector<std::thread> threads;
  std::atomic<int> failures{0};
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 5; ++i) {
        const std::string data = RandomBytes(kChunk * 2 + static_cast<size_t>(t * 100 + i), t * 10 + i);
        auto ref = store_->Put(data);
        if (!ref.ok() || store_->Get(*ref).value() != data || !store_->Delete(ref->name).ok()) ++failures;
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(failures.load(), 0);
}

INSTANTIATE_TEST_SUITE_P(Stores, BlobStoreTest, ::testing::Values("file", "nats", "nats_leader_reads"),
                         [](const auto& info) { return info.param; });

// ----- Store-specific ---------------------------------------------------------------

class NatsObjectStoreTest : public ::testing::Test {
 protected:
  void SetUp() override {
    NatsOptions o;
    o.url = server_.url();
    auto c = NatsClient::Connect(o);
    ASSERT_TRUE(c.ok()) << c.status().ToString();
    client_ = std::move(c).value();
  }
  std::unique_ptr<NatsObjectStore> Open(NatsObjectStoreOptions o = {}) {
    auto s = NatsObjectStore::Open(*client_, o);
    EXPECT_TRUE(s.ok()) << s.status().ToString();
    return s.ok() ? std::move(s).value() : nullptr;
  }
  testing::TestNatsServer server_;
  std::unique_ptr<NatsClient> client_;
};

TEST_F(NatsObjectStoreTest, WritesTheObjectStoreLayout) {
  auto store = Open();
  ASSERT_TRUE(store);
  const std::string data = RandomBytes(kChunk * 2 + 3);
  auto ref = store->Put(data, "layout.bin");
  ASSERT_TRUE(ref.ok()) << ref.status().ToString();

  jsStreamInfo* si = nullptr;
  ASSERT_EQ(js_GetStreamInfo(&si, client_->js(), "OBJ_SHOAL_BLOBS", nullptr, nullptr), NATS_OK);
  EXPECT_TRUE(si->Config->AllowRollup);
  EXPECT_TRUE(si->Config->AllowDirect);
  EXPECT_EQ(si->Config->Discard, js_DiscardNew);
  ASSERT_EQ(si->Config->SubjectsLen, 2);
  EXPECT_STREQ(si->Config->Subjects[0], "$O.SHOAL_BLOBS.C.>");
  EXPECT_STREQ(si->Config->Subjects[1], "$O.SHOAL_BLOBS.M.>");
  jsStreamInfo_Destroy(si);

  EXPECT_EQ(store->MetaSubject("layout.bin"), "$O.SHOAL_BLOBS.M.bGF5b3V0LmJpbg==");
  natsMsg* m = nullptr;
  ASSERT_EQ(js_GetLastMsg(&m, client_->js(), "OBJ_SHOAL_BLOBS", "$O.SHOAL_BLOBS.M.bGF5b3V0LmJpbg==", nullptr,
                          nullptr),
            NATS_OK);
  NatsMsgPtr owned(m);
  const char* rollup = nullptr;
  ASSERT_EQ(natsMsgHeader_Get(m, "Nats-Rollup", &rollup), NATS_OK);
  EXPECT_STREQ(rollup, "sub");
  auto meta = nlohmann::json::parse(std::string(natsMsg_GetData(m), natsMsg_GetDataLength(m)));
  EXPECT_EQ(meta["name"], "layout.bin");
  EXPECT_EQ(meta["bucket"], "SHOAL_BLOBS");
  EXPECT_EQ(meta["size"], data.size());
  EXPECT_EQ(meta["chunks"], 3);
  EXPECT_EQ(meta["options"]["max_chunk_size"], kChunk);
  const auto d = blob_internal::Sha256Of(data);
  EXPECT_EQ(meta["digest"], "SHA-256=" + blob_internal::Base64UrlEncode(
                                             std::string(reinterpret_cast<const char*>(d.data()), d.size()), true));
  EXPECT_TRUE(blob_internal::ParseRfc3339Ms(meta["mtime"].get<std::string>()).has_value());
  auto counts = GetSubjectCounts(*client_, "OBJ_SHOAL_BLOBS", "$O.SHOAL_BLOBS.C.>");
  ASSERT_TRUE(counts.ok());
  ASSERT_EQ(counts->size(), 1u);
  EXPECT_EQ(counts->begin()->first, "$O.SHOAL_BLOBS.C." + meta["nuid"].get<std::string>());
  EXPECT_EQ(counts->begin()->second, 3u);

  // Delete: a tombstone meta (what other clients expect) and no chunks.
  ASSERT_TRUE(store->Delete("layout.bin").ok());
  natsMsg* t = nullptr;
  ASSERT_EQ(js_GetLastMsg(&t, client_->js(), "OBJ_SHOAL_BLOBS", "$O.SHOAL_BLOBS.M.bGF5b3V0LmJpbg==", nullptr,
                          nullptr),
            NATS_OK);
  NatsMsgPtr owned_t(t);
  auto tomb = nlohmann::json::parse(std::string(natsMsg_GetData(t), natsMsg_GetDataLength(t)));
  EXPECT_EQ(tomb["deleted"], true);
  EXPECT_EQ(tomb["size"], 0);
  EXPECT_EQ(tomb["chunks"], 0);
  EXPECT_TRUE(GetSubjectCounts(*client_, "OBJ_SHOAL_BLOBS", "$O.SHOAL_BLOBS.C.>")->empty());
}

TEST_F(NatsObjectStoreTest, MissingChunksAreCorrupt) {
  // Both read paths: the ordered consumer and chunk-by-chunk direct gets.
  for (int min_chunks : {2, 1 << 30}) {
    SCOPED_TRACE(min_chunks);
    NatsObjectStoreOptions o;
    o.stream_read_min_chunks = min_chunks;
    auto store = Open(o);
    ASSERT_TRUE(store);
    auto whole = store->Put(RandomBytes(kChunk * 3), "whole");
    auto partial = store->Put(RandomBytes(kChunk * 3), "partial");
    ASSERT_TRUE(whole.ok() && partial.ok());
    // Drop the last chunk of "partial" only.
    natsMsg* m = nullptr;
    ASSERT_EQ(js_GetLastMsg(&m, client_->js(), "OBJ_SHOAL_BLOBS", store->MetaSubject("partial").c_str(), nullptr,
                            nullptr),
              NATS_OK);
    auto pj = nlohmann::json::parse(std::string(natsMsg_GetData(m), natsMsg_GetDataLength(m)));
    natsMsg_Destroy(m);
    const std::string subject = store->ChunkSubject(pj["nuid"]);
    natsMsg* last = nullptr;
    ASSERT_EQ(js_GetLastMsg(&last, client_->js(), "OBJ_SHOAL_BLOBS", subject.c_str(), nullptr, nullptr), NATS_OK);
    const uint64_t seq = natsMsg_GetSequence(last);
    natsMsg_Destroy(last);
    ASSERT_EQ(js_DeleteMsg(client_->js(), "OBJ_SHOAL_BLOBS", seq, nullptr, nullptr), NATS_OK);
    EXPECT_EQ(store->Get(*partial).status().reason(), kBlobCorrupt) << store->Get(*partial).status().ToString();
    EXPECT_TRUE(store->Get(*whole).ok());
    // All chunks gone.
    jsOptions po;
    jsOptions_Init(&po);
    po.Stream.Purge.Subject = subject.c_str();
    ASSERT_EQ(js_PurgeStream(client_->js(), "OBJ_SHOAL_BLOBS", &po, nullptr), NATS_OK);
    EXPECT_EQ(store->Get(*partial).status().reason(), kBlobCorrupt);
  }
}

TEST_F(NatsObjectStoreTest, SweepRemovesOrphanChunks) {
  auto store = Open();
  ASSERT_TRUE(store);
  // A writer that crashed between its chunks and its meta.
  for (int i = 0; i < 3; ++i) {
    ASSERT_EQ(js_Publish(nullptr, client_->js(), "$O.SHOAL_BLOBS.C.crashedwriter", "chunk", 5, nullptr, nullptr),
              NATS_OK);
  }
  auto live = store->Put(RandomBytes(kChunk + 1), "live");
  ASSERT_TRUE(live.ok());
  EXPECT_EQ(store->Sweep(60000).value(), 0u);  // too young to judge
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  // Both are older than 20 ms now: the orphan and the live object go.
  auto removed = store->Sweep(20);
  ASSERT_TRUE(removed.ok()) << removed.status().ToString();
  EXPECT_EQ(*removed, 2u);
  EXPECT_EQ(store->Get(*live).status().reason(), kBlobNotFound);
  auto counts = GetSubjectCounts(*client_, "OBJ_SHOAL_BLOBS", "$O.SHOAL_BLOBS.C.crashedwriter");
  ASSERT_TRUE(counts.ok());
  EXPECT_TRUE(counts->empty());
}

// Any client can write a meta. One whose "nuid" is a wildcard names no
// chunks Shoal purges: deleting or sweeping it leaves every other object's
// chunks alone (purging "$O.SHOAL_BLOBS.C.>" would have taken them all).
TEST_F(NatsObjectStoreTest, AForeignMetaWithAWildcardForChunksPurgesNothingElse) {
  auto store = Open();
  ASSERT_TRUE(store);
  auto live = store->Put(RandomBytes(kChunk + 1), "live");
  ASSERT_TRUE(live.ok()) << live.status().ToString();
  for (const char* nuid : {">", "*", "a.>"}) {
    SCOPED_TRACE(nuid);
    const std::string meta = nlohmann::json{{"name", "foreign"}, {"bucket", "SHOAL_BLOBS"}, {"nuid", nuid},
                                            {"size", 10}, {"chunks", 1}, {"mtime", "2000-01-01T00:00:00Z"},
                                            {"digest", "SHA-256=AAAA"}}
                                 .dump();
    ASSERT_EQ(js_Publish(nullptr, client_->js(), store->MetaSubject("foreign").c_str(), meta.data(),
                         static_cast<int>(meta.size()), nullptr, nullptr),
              NATS_OK);
    EXPECT_TRUE(store->Delete("foreign").ok());
    EXPECT_TRUE(store->Get(*live).ok()) << store->Get(*live).status().ToString();
    ASSERT_EQ(js_Publish(nullptr, client_->js(), store->MetaSubject("foreign").c_str(), meta.data(),
                         static_cast<int>(meta.size()), nullptr, nullptr),
              NATS_OK);
    auto swept = store->Sweep(60000);  // the foreign meta is old, "live" is not
    ASSERT_TRUE(swept.ok()) << swept.status().ToString();
    EXPECT_EQ(*swept, 1u);
    EXPECT_TRUE(store->Get(*live).ok()) << store->Get(*live).status().ToString();
  }
}

// A meta that cannot be read (any client can write one) does not lock its
// name: a Put replaces it and a Delete removes it.
TEST_F(NatsObjectStoreTest, AnUnreadableMetaCanBeReplacedAndDeleted) {
  auto store = Open();
  ASSERT_TRUE(store);
  const std::string subject = store->MetaSubject("broken");
  for (const std::string bad : {"not json", "[1, 2]", R"({"name": "broken", "mtime": 5})"}) {
    SCOPED_TRACE(bad);
    ASSERT_EQ(js_Publish(nullptr, client_->js(), subject.c_str(), bad.data(), static_cast<int>(bad.size()), nullptr,
                         nullptr),
              NATS_OK);
    ASSERT_EQ(store->Stat("broken").status().reason(), kBlobCorrupt);
    const std::string data = RandomBytes(kChunk + 7);
    auto ref = store->Put(data, "broken");
    ASSERT_TRUE(ref.ok()) << ref.status().ToString();
    auto got = store->Get(*ref);
    ASSERT_TRUE(got.ok()) << got.status().ToString();
    EXPECT_EQ(*got, data);

    ASSERT_EQ(js_Publish(nullptr, client_->js(), subject.c_str(), bad.data(), static_cast<int>(bad.size()), nullptr,
                         nullptr),
              NATS_OK);
    Status deleted = store->Delete("broken");
    EXPECT_TRUE(deleted.ok()) << deleted.ToString();
    EXPECT_EQ(store->Stat("broken").status().reason(), kBlobNotFound);
  }
}

// Metas any client may write with fields of the wrong type are skipped by
// the sweep (it used to throw out of the sweeper thread and end the
// process); the objects around them are still swept.
TEST_F(NatsObjectStoreTest, SweepSkipsMetasWithFieldsOfTheWrongType) {
  auto store = Open();
  ASSERT_TRUE(store);
  auto old = store->Put(RandomBytes(100), "old-one");
  ASSERT_TRUE(old.ok()) << old.status().ToString();
  int k = 0;
  for (const std::string bad : {R"({"name": "x", "mtime": 5})", R"({"deleted": "no"})", R"({"nuid": 1})", "[1, 2]",
                                "7", "not json"}) {
    const std::string subject = store->MetaSubject("bad-" + std::to_string(k++));
    ASSERT_EQ(js_Publish(nullptr, client_->js(), subject.c_str(), bad.data(), static_cast<int>(bad.size()), nullptr,
                         nullptr),
              NATS_OK);
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  auto swept = store->Sweep(0);
  ASSERT_TRUE(swept.ok()) << swept.status().ToString();
  EXPECT_EQ(*swept, 1u) << "the one old object";
  EXPECT_EQ(store->Stat("old-one").status().reason(), kBlobNotFound);
  EXPECT_EQ(store->Stat("bad-0").status().reason(), kBlobCorrupt) << "left to an operator";
}

// Chunks no meta names are a crashed Put's only once their newest chunk is
// old: a Put still uploading after the cutoff keeps its first chunks.
TEST_F(NatsObjectStoreTest, SweepJudgesOrphanChunksByTheirNewest) {
  auto store = Open();
  ASSERT_TRUE(store);
  const std::string chunks = store->ChunkSubject("slowwriter");
  const char* subject = chunks.c_str();
  ASSERT_EQ(js_Publish(nullptr, client_->js(), subject, "chunk", 5, nullptr, nullptr), NATS_OK);
  std::this_thread::sleep_for(std::chrono::milliseconds(2000));
  ASSERT_EQ(js_Publish(nullptr, client_->js(), subject, "chunk", 5, nullptr, nullptr), NATS_OK);
  // The first chunk is about 2 s old, the second new (a second of slack).
  auto swept = store->Sweep(1000);
  ASSERT_TRUE(swept.ok()) << swept.status().ToString();
  EXPECT_EQ(*swept, 0u);
  auto counts = GetSubjectCounts(*client_, "OBJ_SHOAL_BLOBS", subject);
  ASSERT_TRUE(counts.ok());
  EXPECT_EQ(counts->count(subject) ? counts->at(subject) : 0, 2u);
  std::this_thread::sleep_for(std::chrono::milliseconds(1200));
  swept = store->Sweep(1000);
  ASSERT_TRUE(swept.ok()) << swept.status().ToString();
  EXPECT_EQ(*swept, 1u);
}

TEST_F(NatsObjectStoreTest, BindsToABucketAnotherClientMade) {
  // Created without rollups: not an object store, refuse it clearly.
  jsStreamConfig cfg;
  jsStreamConfig_Init(&cfg);
  const char* subjects[] = {"$O.PLAIN.C.>", "$O.PLAIN.M.>"};
  cfg.Name = "OBJ_PLAIN";
  cfg.Subjects = subjects;
  cfg.SubjectsLen = 2;
  jsStreamInfo* si = nullptr;
  ASSERT_EQ(js_AddStream(&si, client_->js(), &cfg, nullptr, nullptr), NATS_OK);
  jsStreamInfo_Destroy(si);
  NatsObjectStoreOptions o;
  o.bucket = "PLAIN";
  EXPECT_EQ(NatsObjectStore::Open(*client_, o).status().code(), StatusCode::kInvalidArgument);
  // A second Open of a proper bucket binds to it.
  ASSERT_TRUE(Open());
  ASSERT_TRUE(Open());
}

TEST_F(NatsObjectStoreTest, AFullBucketSaysSo) {
  NatsObjectStoreOptions o;
  o.bucket = "SMALL";
  o.max_bytes = 256 * 1024;
  auto store = Open(o);
  ASSERT_TRUE(store);
  auto ref = store->Put(RandomBytes(1 << 20));
  EXPECT_STATUS(ref.status(), StatusCode::kResourceExhausted, kBlobStoreFull);
  EXPECT_TRUE(store->Put("small enough").ok());
}

// Deleting is how a full bucket gets room back, and it refuses even a
// tombstone: the blob goes without one. (The blob deleted has a long name,
// so its tombstone is larger than what the small fillers leave free.)
TEST_F(NatsObjectStoreTest, ADeleteFreesRoomInAFullBucket) {
  NatsObjectStoreOptions o;
  o.bucket = "FULL";
  o.max_bytes = 64 * 1024;
  auto store = Open(o);
  ASSERT_TRUE(store);
  const std::string big(200, 'b');
  ASSERT_TRUE(store->Put(RandomBytes(32 * 1024), big).ok());
  int fillers = 0;
  for (; fillers < 10000; ++fillers) {
    auto r = store->Put("", "f" + std::to_string(fillers));
    if (!r.ok()) {
      ASSERT_EQ(r.status().reason(), kBlobStoreFull) << r.status().ToString();
      break;
    }
  }
  ASSERT_LT(fillers, 10000) << "never full";
  Status deleted = store->Delete(big);
  ASSERT_TRUE(deleted.ok()) << deleted.ToString();
  EXPECT_EQ(store->Stat(big).status().code(), StatusCode::kNotFound);
  EXPECT_TRUE(store->Put(RandomBytes(16 * 1024)).ok());  // the room came back
}

// A bucket another client made with settings that would break the store in
// use (not at once) is refused at start, saying which; a small
// max_msg_size only makes chunks smaller.
TEST_F(NatsObjectStoreTest, RefusesABucketThatWouldFailInUse) {
  const auto make = [&](const std::string& bucket, const std::function<void(jsStreamConfig&)>& set) {
    const std::string chunks = "$O." + bucket + ".C.>", metas = "$O." + bucket + ".M.>", name = "OBJ_" + bucket;
    const char* subjects[] = {chunks.c_str(), metas.c_str()};
    jsStreamConfig cfg;
    jsStreamConfig_Init(&cfg);
    cfg.Name = name.c_str();
    cfg.Subjects = subjects;
    cfg.SubjectsLen = 2;
    cfg.AllowRollup = true;
    cfg.AllowDirect = true;
    cfg.Discard = js_DiscardNew;
    set(cfg);
    jsStreamInfo* si = nullptr;
    jsErrCode jerr = static_cast<jsErrCode>(0);
    ASSERT_EQ(js_AddStream(&si, client_->js(), &cfg, nullptr, &jerr), NATS_OK) << bucket << " " << jerr;
    jsStreamInfo_Destroy(si);
  };
  const auto refused = [&](const std::string& bucket, const std::string& why) {
    NatsObjectStoreOptions o;
    o.bucket = bucket;
    auto r = NatsObjectStore::Open(*client_, o);
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << bucket;
    EXPECT_NE(r.status().message().find(why), std::string::npos) << r.status().message();
  };
  // (deny_purge cannot be: the server refuses it beside allow_rollup_hdrs.)
  make("DISCARDOLD", [](jsStreamConfig& c) {
    c.Discard = js_DiscardOld;
    c.MaxBytes = 1 << 20;
  });
  refused("DISCARDOLD", "discards old messages");
  make("PERSUBJECT", [](jsStreamConfig& c) { c.MaxMsgsPerSubject = 8; });
  refused("PERSUBJECT", "messages per subject");
  make("TINYMSGS", [](jsStreamConfig& c) { c.MaxMsgSize = 1024; });
  refused("TINYMSGS", "at most 1024 bytes");
  make("SMALLMSGS", [](jsStreamConfig& c) { c.MaxMsgSize = 16 * 1024; });
  NatsObjectStoreOptions o;
  o.bucket = "SMALLMSGS";
  auto store = Open(o);
  ASSERT_TRUE(store);
  const std::string data = RandomBytes(200 * 1024);
  auto ref = store->Put(data);
  ASSERT_TRUE(ref.ok()) << ref.status().ToString();
  auto got = store->Get(*ref);
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  EXPECT_EQ(*got, data);
}

TEST(LocalDirBlobStore, SweepsLeftoverTempFilesAndIgnoresForeignFiles) {
  testing::TempDir dir;
  FakeClock clock;
  LocalDirBlobStoreOptions o;
  o.dir = dir.path();
  o.clock = &clock;
  auto store = LocalDirBlobStore::Create(o);
  ASSERT_TRUE(store.ok());
  { std::ofstream(dir.path() + "/.tmp.crashed.abc") << "half"; }
  { std::ofstream(dir.path() + "/README txt") << "not a blob name"; }
  // Files dated now by the real clock are far newer than the fake clock.
  clock.AdvanceUs(int64_t{1} << 50);
  auto removed = (*store)->Sweep(1000);
  ASSERT_TRUE(removed.ok());
  EXPECT_EQ(*removed, 1u);
  EXPECT_FALSE(std::filesystem::exists(dir.path() + "/.tmp.crashed.abc"));
  EXPECT_TRUE(std::filesystem::exists(dir.path() + "/README txt"));
}

// An id that references could not carry (ParseBlobRef takes at most 255
// characters) is refused when the store is made, not at every read.
TEST(LocalDirBlobStore, IdsReferencesCannotCarryAreRefused) {
  testing::TempDir dir;
  LocalDirBlobStoreOptions o;
  o.dir = dir.path();
  o.id = std::string(255, 'a');
  auto store = LocalDirBlobStore::Create(o);
  ASSERT_TRUE(store.ok()) << store.status().ToString();
  auto ref = (*store)->Put("x");
  ASSERT_TRUE(ref.ok());
  EXPECT_TRUE(ParseBlobRef(ref->ToString()).ok());
  o.id = std::string(256, 'a');
  EXPECT_EQ(LocalDirBlobStore::Create(o).status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace shoal
