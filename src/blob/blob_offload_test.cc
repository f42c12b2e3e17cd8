// BlobOffload over a local directory store: asynchronous put, fetch with
// verification (missing and tampered payloads), delete and the orphan sweep.
#include "blob/blob_offload.h"

#include <signal.h>

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <future>
#include <optional>
#include <string>
#include <thread>

#include "common/clock.h"
#include "queue/nats_client.h"
#include "queue/nats_server_process.h"
#include "support/held_offload_thread.h"
#include "support/test_env.h"

namespace shoal {
namespace {

class BlobOffloadTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::temp_directory_path() /
           ("shoal-offload-" + std::to_string(::getpid()) + "-" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    std::filesystem::remove_all(dir_);
    BlobOffloadOptions o;
    o.store_url = "file://" + dir_.string();
    o.threshold_bytes = 10;
    o.ttl_ms = 60000;
    auto b = BlobOffload::Create(o, nullptr, &metrics_, &clock_);
    ASSERT_TRUE(b.ok()) << b.status().ToString();
    offload_ = std::move(b).value();
  }
  void TearDown() override {
    offload_.reset();
    std::filesystem::remove_all(dir_);
  }
  BlobRef PutAsync(const std::string& data) {
    std::promise<Result<BlobRef>> p;
    offload_->PutAsync(data, "request", [&p](Result<BlobRef> r) { p.set_value(std::move(r)); });
    auto r = p.get_future().get();
    EXPECT_TRUE(r.ok()) << r.status().ToString();
    return r.ok() ? *r : BlobRef{};
  }
  size_t Files() const {
    size_t n = 0;
    for (const auto& e : std::filesystem::directory_iterator(dir_)) n += e.is_regular_file();
    return n;
  }

  std::filesystem::path dir_;
  FakeClock clock_;
  MetricsRegistry metrics_;
  std::unique_ptr<BlobOffload> offload_;
};

TEST_F(BlobOffloadTest, ThresholdIsExclusive) {
  EXPECT_FALSE(offload_->ShouldOffload(10));
  EXPECT_TRUE(offload_->ShouldOffload(11));
}

TEST_F(BlobOffloadTest, PutFetchDelete) {
  const std::string data(5000, 'x');
  BlobRef ref = PutAsync(data);
  auto got = offload_->Fetch(ref.ToString());
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  EXPECT_EQ(*got, data);
  EXPECT_EQ(Files(), 1u);
  EXPECT_NE(metrics_.Render().find("shoal_blob_offloaded_total{kind=\"request\"} 1"), std::string::npos);
  ASSERT_TRUE(offload_->Delete(ref.ToString()).ok());
  EXPECT_EQ(Files(), 0u);
}

TEST_F(BlobOffloadTest, PiecesAreStoredAsOneBlob) {
  // Pieces larger and smaller than the store's write buffer, and empty ones.
  std::vector<std::string> pieces = {"head:", std::string(3 << 20, 'a'), "", std::string(7, 'b'),
                                     std::string(200000, 'c'), ":tail"};
  std::string whole;
  for (const auto& p : pieces) whole += p;
  std::promise<Result<BlobRef>> done;
  offload_->PutAsync(std::move(pieces), "request", [&done](Result<BlobRef> r) { done.set_value(std::move(r)); });
  auto ref = done.get_future().get();
  ASSERT_TRUE(ref.ok()) << ref.status().ToString();
  EXPECT_EQ(ref->size, whole.size());
  auto got = offload_->Fetch(ref->ToString());
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  EXPECT_TRUE(*got == whole);
  EXPECT_NE(metrics_.Render().find("shoal_blob_offloaded_bytes_total{kind=\"request\"} " + std::to_string(whole.size())),
            std::string::npos);
}

TEST_F(BlobOffloadTest, MissingAndTamperedPayloadsAreClearErrors) {
  BlobRef ref = PutAsync("payload bytes, long enough");
  {
    std::ofstream f(dir_ / ref.name, std::ios::binary | std::ios::trunc);
    f << "payload bytes, LONG enough";
  }
  auto tampered = offload_->Fetch(ref.ToString());
  ASSERT_FALSE(tampered.ok());
  EXPECT_EQ(tampered.status().code(), StatusCode::kBadGateway);
  EXPECT_EQ(tampered.status().reason(), kBlobCorrupt);
  ASSERT_TRUE(offload_->Delete(ref.ToString()).ok());
  auto missing = offload_->Fetch(ref.ToString());
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().code(), StatusCode::kBadGateway);
  EXPECT_EQ(missing.status().reason(), kBlobNotFound);
  auto garbage = offload_->Fetch("file://local/../../etc/passwd?size=1&sha256=00");
  ASSERT_FALSE(garbage.ok());
  EXPECT_EQ(garbage.status().reason(), kBlobRefInvalid);
}

// A store that fails to read a payload for a reason of its own (here the
// open fails: ELOOP; EMFILE, EACCES or EIO alike) says nothing about the
// payload: 503 blob_store_unavailable, which the worker retries, not a
// terminal 502 blob_not_found.
TEST_F(BlobOffloadTest, AStoreReadErrorIsUnavailableNotMissing) {
  BlobRef ref = PutAsync("payload bytes, long enough");
  std::filesystem::rename(dir_ / ref.name, dir_ / "elsewhere");
  std::filesystem::create_symlink(dir_ / "elsewhere", dir_ / ref.name);
  auto got = offload_->Fetch(ref.ToString());
  ASSERT_FALSE(got.ok());
  EXPECT_EQ(got.status().code(), StatusCode::kUnavailable) << got.status().ToString();
  EXPECT_EQ(got.status().reason(), "blob_store_unavailable");
}

// A reference of another store names nothing here: deleting it leaves this
// store's blob of the same name alone.
TEST_F(BlobOffloadTest, AnotherStoresReferenceDeletesNothingHere) {
  BlobRef ref = PutAsync("payload bytes, long enough");
  BlobRef foreign = ref;
  foreign.store = "another";
  EXPECT_EQ(offload_->Delete(foreign.ToString()).reason(), kBlobStoreMismatch);
  EXPECT_EQ(Files(), 1u);
  EXPECT_TRUE(offload_->Fetch(ref.ToString()).ok());
}

// SIGSTOP takes effect as each thread of `pid` next enters the kernel:
// true once every one shows state T (stopped), false after 5 s.
bool WaitUntilStopped(pid_t pid) {
  const std::string tasks = "/proc/" + std::to_string(pid) + "/task";
  for (int i = 0; i < 5000; ++i) {
    bool all = true, any = false;
    std::error_code ec;
    for (auto it = std::filesystem::directory_iterator(tasks, ec); !ec && it != std::filesystem::directory_iterator();
         it.increment(ec)) {
      std::ifstream in(it->path() / "stat");
      std::string stat;
      std::getline(in, stat);
      const size_t close = stat.rfind(')');
      if (close == std::string::npos || close + 2 >= stat.size()) continue;  // gone since the listing
      any = true;
      all = all && stat[close + 2] == 'T';
    }
    if (any && all) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return false;
}

// A NATS object store that does not answer in time (here: its server is
// stopped) is a retryable 503 blob_store_unavailable, not a terminal 502
// blob_not_found: the payload is still there, as the next fetch shows.
TEST(BlobOffloadNats, AStoreThatDoesNotAnswerIsUnavailableNotMissing) {
  testing::TestNatsServer server;
  NatsOptions no;
  no.url = server.url();
  no.js_api_timeout_ms = 300;
  auto client = NatsClient::Connect(no);
  ASSERT_TRUE(client.ok()) << client.status().ToString();
  MetricsRegistry metrics;
  BlobOffloadOptions o;
  o.store_url = "nats://";
  auto offload = BlobOffload::Create(o, client->get(), &metrics);
  ASSERT_TRUE(offload.ok()) << offload.status().ToString();
  auto ref = (*offload)->Put("a payload that travels by reference", "request");
  ASSERT_TRUE(ref.ok()) << ref.status().ToString();
  ASSERT_EQ(::kill(server.process().pid(), SIGSTOP), 0);
  // Once it has stopped (a fetch sent before that could still be answered:
  // the test failed that way once under a parallel ctest).
  const bool stopped = WaitUntilStopped(server.process().pid());
  if (!stopped) ::kill(server.process().pid(), SIGCONT);
  ASSERT_TRUE(stopped) << "nats-server (pid " << server.process().pid() << ") never showed as stopped";
  auto stalled = (*offload)->Fetch(ref->ToString());
  ASSERT_EQ(::kill(server.process().pid(), SIGCONT), 0);
  ASSERT_FALSE(stalled.ok());
  EXPECT_EQ(stalled.status().code(), StatusCode::kUnavailable) << stalled.status().ToString();
  EXPECT_EQ(stalled.status().reason(), "blob_store_unavailable");
  auto later = (*offload)->Fetch(ref->ToString());
  ASSERT_TRUE(later.ok()) << later.status().ToString();
  EXPECT_EQ(*later, "a payload that travels by reference");
}

TEST_F(BlobOffloadTest, SweepRemovesOnlyOrphansOlderThanTheTtl) {
  PutAsync("an old orphaned payload");
  clock_.AdvanceUs(int64_t{61} * 1000 * 1000);
  BlobRef fresh = PutAsync("a fresh payload in flight");
  auto n = offload_->SweepNow();
  ASSERT_TRUE(n.ok()) << n.status().ToString();
  EXPECT_EQ(*n, 1u);
  EXPECT_EQ(Files(), 1u);
  EXPECT_TRUE(offload_->Fetch(fresh.ToString()).ok());
}

// Payloads waiting for a slow store are bounded: past max_queued_bytes a
// put is refused at once (503 blob_store_busy at the gateway); one larger
// than the bound alone still goes when nothing else waits.
TEST_F(BlobOffloadTest, PutsWaitingForTheStoreAreBounded) {
  BlobOffloadOptions o = offload_->options();
  o.threads = 1;
  o.max_queued_bytes = 100;
  auto b = BlobOffload::Create(o, nullptr, &metrics_, &clock_);
  ASSERT_TRUE(b.ok()) << b.status().ToString();
  std::unique_ptr<BlobOffload> offload = std::move(b).value();
  shoal::testing::HeldOffloadThread held(*offload);  // the store is "slow"
  // Shared with the callbacks: an assertion that returns early releases the
  // store, and a put's callback may then still run.
  auto first = std::make_shared<std::promise<Result<BlobRef>>>();
  offload->PutAsync(std::string(60, 'a'), "request", [first](Result<BlobRef> r) { first->set_value(std::move(r)); });
  auto second = std::make_shared<std::optional<Result<BlobRef>>>();
  offload->PutAsync(std::string(60, 'b'), "request", [second](Result<BlobRef> r) { *second = std::move(r); });
  ASSERT_TRUE(second->has_value()) << "a refused put answers at once";
  ASSERT_FALSE((*second)->ok());
  EXPECT_EQ((*second)->status().code(), StatusCode::kUnavailable);
  EXPECT_EQ((*second)->status().reason(), "blob_store_busy");
  held.Open();
  auto r = first->get_future().get();
  EXPECT_TRUE(r.ok()) << r.status().ToString();
  std::promise<Result<BlobRef>> large;
  offload->PutAsync(std::string(500, 'c'), "request", [&large](Result<BlobRef> r) { large.set_value(std::move(r)); });
  r = large.get_future().get();
  EXPECT_TRUE(r.ok()) << r.status().ToString();
  BlobOffloadOptions bad = o;
  bad.max_queued_bytes = 0;
  EXPECT_EQ(bad.Validate().code(), StatusCode::kInvalidArgument);
}

// A delete the store fails (here: its directory is briefly not one) is
// tried again a second later, not left for the sweep.
TEST_F(BlobOffloadTest, AFailedDeleteIsTriedAgain) {
  BlobRef ref = PutAsync("to be deleted once the store answers again");
  const std::filesystem::path moved = dir_.string() + ".away";
  std::filesystem::rename(dir_, moved);
  { std::ofstream(dir_) << "not a directory"; }
  offload_->DeleteAsync(ref.ToString());
  std::this_thread::sleep_for(std::chrono::milliseconds(300));  // the first try has failed
  std::filesystem::remove(dir_);
  std::filesystem::rename(moved, dir_);
  ASSERT_EQ(Files(), 1u);
  EXPECT_TRUE(shoal::testing::Eventually([&] { return Files() == 0; }, std::chrono::seconds(5)));
}

TEST_F(BlobOffloadTest, DeleteAsyncRunsBeforeDestruction) {
  BlobRef ref = PutAsync("to be deleted soon, please");
  offload_->DeleteAsync(ref.ToString());
  offload_.reset();  // drains the queue
  EXPECT_EQ(Files(), 0u);
}

}  // namespace
}  // namespace shoal
