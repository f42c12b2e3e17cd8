#include "worker/model_manager.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <set>
#include <stdexcept>
#include <system_error>
#include <thread>
#include <vector>

namespace shoal {
namespace {

namespace fs = std::filesystem;

// Polls `pred` until it holds; false after 10 s. Synchronisation only, never
// a timing assertion.
template <typename Pred>
bool Eventually(Pred pred) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (!pred()) {
    if (std::chrono::steady_clock::now() > until) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return true;
}

class FakeLoader;

class FakeRuntime final : public Runtime {
 public:
  FakeRuntime(FakeLoader* owner, std::string name, int64_t bytes)
      : owner_(owner), name_(std::move(name)), bytes_(bytes) {}
  Status Load(const ModelConfig&) override { return Status::Ok(); }
  Result<Embeddings> Run(const TokenBatch&) override {
    if (unloaded_) return Internal("ran an unloaded model");
    return Embeddings{};
  }
  void Unload() override;
  int64_t MemoryBytes() const override { return bytes_; }
  int Dim() const override { return 4; }
  Status Health() const override;

 private:
  FakeLoader* owner_;
  std::string name_;
  int64_t bytes_;
  std::atomic<bool> unloaded_{false};
};

// Makes FakeRuntimes with a configured footprint, or fails; can hold a
// model's loads open until the test lets them finish. Must outlive the
// manager that uses it.
class FakeLoader {
 public:
  struct Spec {
    int64_t bytes = 100;
    bool fail = false;
    bool device_fault = false;  // the load breaks the device (Unavailable, device_fault)
    bool report_via_runtime = false;  // leave LoadedModel::memory_bytes at 0
    bool throw_on_start = false;      // its attachment throws when started
  };

  void Set(const std::string& name, Spec spec) {
    std::lock_guard<std::mutex> lock(mu_);
    specs_[name] = spec;
  }
  void Hold(const std::string& name) {
    std::lock_guard<std::mutex> lock(mu_);
    held_.insert(name);
  }
  void Open(const std::string& name) {
    std::lock_guard<std::mutex> lock(mu_);
    held_.erase(name);
    cv_.notify_all();
  }
  // Blocks until `n` loads of `name` have started (false after 10 s).
  bool WaitStarted(const std::string& name, int n) {
    std::unique_lock<std::mutex> lock(mu_);
    return cv_.wait_for(lock, std::chrono::seconds(10), [&] { return started_[name] >= n; });
  }
  int loads(const std::string& name) {
    std::lock_guard<std::mutex> lock(mu_);
    return started_[name];
  }
  int unloads(const std::string& name) {
    std::lock_guard<std::mutex> lock(mu_);
    return unloads_[name];
  }
  // Attachments of `name` started (the manager kept the model).
  int starts(const std::string& name) {
    std::lock_guard<std::mutex> lock(mu_);
    return starts_[name];
  }
  void OnStart(const std::string& name) {
    std::lock_guard<std::mutex> lock(mu_);
    ++starts_[name];
    if (specs_[name].throw_on_start) throw std::system_error(EAGAIN, std::generic_category(), "thread");
  }
  void OnUnload(const std::string& name) {
    std::unique_lock<std::mutex> lock(mu_);
    ++unloads_[name];
    events_.push_back("unload " + name);
    cv_.notify_all();
    cv_.wait(lock, [&] { return held_unloads_.count(name) == 0; });
    if (throw_on_unload_.count(name)) throw std::runtime_error("CUDA error: an illegal memory access");
  }
  // Unloads of `name` wait in the runtime (its memory still being freed)
  // until OpenUnload.
  void HoldUnload(const std::string& name) {
    std::lock_guard<std::mutex> lock(mu_);
    held_unloads_.insert(name);
  }
  void OpenUnload(const std::string& name) {
    std::lock_guard<std::mutex> lock(mu_);
    held_unloads_.erase(name);
    cv_.notify_all();
  }
  // Blocks until `n` unloads of `name` have started (false after 10 s).
  bool WaitUnloadStarted(const std::string& name, int n) {
    std::unique_lock<std::mutex> lock(mu_);
    return cv_.wait_for(lock, std::chrono::seconds(10), [&] { return unloads_[name] >= n; });
  }
  void OnDetach(const std::string& name) {
    std::lock_guard<std::mutex> lock(mu_);
    events_.push_back("detach " + name);
  }
  // Attachments destroyed and runtimes unloaded, in order.
  std::vector<std::string> events() {
    std::lock_guard<std::mutex> lock(mu_);
    return events_;
  }
  // Runtimes of `name` throw from Unload() from now on.
  void ThrowOnUnload(const std::string& name) {
    std::lock_guard<std::mutex> lock(mu_);
    throw_on_unload_.insert(name);
  }
  // What the runtimes of `name` report as their health from now on.
  void SetHealth(const std::string& name, Status health) {
    std::lock_guard<std::mutex> lock(mu_);
    health_[name] = std::move(health);
  }
  Status HealthOf(const std::string& name) {
    std::lock_guard<std::mutex> lock(mu_);
    return health_[name];
  }

  ModelLoader AsLoader() {
    return [this](const ModelConfig& config) -> Result<std::unique_ptr<LoadedModel>> {
      std::unique_lock<std::mutex> lock(mu_);
      ++started_[config.name];
      cv_.notify_all();
      cv_.wait(lock, [&] { return held_.count(config.name) == 0; });
      const Spec spec = specs_[config.name];
      lock.unlock();
      if (spec.fail) return NotFound("no such file: " + config.ModelPath());
      if (spec.device_fault)
        return Unavailable("device cuda:0 failed: CUDA error: an illegal memory access was encountered",
                           "device_fault");
      auto m = std::make_unique<LoadedModel>();
      m->config = config;
      m->runtime = std::make_unique<FakeRuntime>(this, config.name, spec.bytes);
      m->memory_bytes = spec.report_via_runtime ? 0 : spec.bytes;
      m->attachment = std::make_unique<RecordingAttachment>(this, config.name);
      return m;
    };
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<std::string, Spec> specs_;
  std::set<std::string> held_;
  std::set<std::string> held_unloads_;
  std::map<std::string, int> started_;
  std::map<std::string, int> unloads_;
  std::map<std::string, int> starts_;
  std::map<std::string, Status> health_;
  std::set<std::string> throw_on_unload_;
  std::vector<std::string> events_;

  // Says when it is destroyed (the model stops being used).
  class RecordingAttachment final : public ModelAttachment {
   public:
    RecordingAttachment(FakeLoader* owner, std::string name) : owner_(owner), name_(std::move(name)) {}
    ~RecordingAttachment() override { owner_->OnDetach(name_); }
    void Start() override { owner_->OnStart(name_); }

   private:
    FakeLoader* owner_;
    std::string name_;
  };
};

Status FakeRuntime::Health() const { return owner_->HealthOf(name_); }

void FakeRuntime::Unload() {
  if (!unloaded_.exchange(true)) owner_->OnUnload(name_);
}

class ModelManagerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::path(::testing::TempDir()) /
           ("model_manager_" + std::to_string(::getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  // A catalog model whose file is `file_bytes` long (-1: no file) and which
  // measures `measured_bytes` once loaded.
  ModelConfig Model(const std::string& name, int64_t measured_bytes, int64_t file_bytes = -2) {
    if (file_bytes == -2) file_bytes = measured_bytes;
    ModelConfig c;
    c.name = name;
    c.runtime = "null";
    c.dir = (dir_ / name).string();
    if (file_bytes >= 0) {
      fs::create_directories(c.dir);
      std::ofstream(c.ModelPath()).close();
      fs::resize_file(c.ModelPath(), static_cast<uintmax_t>(file_bytes));
    }
    loader_.Set(name, {.bytes = measured_bytes});
    return c;
  }

  // Estimates equal file sizes unless a test says otherwise.
  static ModelManagerOptions Options(int64_t budget, std::vector<std::string> pinned = {},
                                     int max_models = 0) {
    ModelManagerOptions o;
    o.memory_budget_bytes = budget;
    o.pinned = std::move(pinned);
    o.max_models = max_models;
    o.file_size_factor = 1.0;
    return o;
  }

  std::unique_ptr<ModelManager> Make(ModelManagerOptions options,
                                     std::vector<ModelConfig> catalog) {
    return std::make_unique<ModelManager>(std::move(options), std::move(catalog),
                                          loader_.AsLoader(), &clock_, &metrics_);
  }

  int64_t Far() const { return clock_.NowMonoUs() + 3'600'000'000LL; }

  static ModelStatus StatusOf(const ModelManager& mm, const std::string& name) {
    for (ModelStatus& s : mm.Statuses()) {
      if (s.name == name) return s;
    }
    ADD_FAILURE() << "no status for " << name;
    return {};
  }
  static ModelState StateOf(const ModelManager& mm, const std::string& name) {
    return StatusOf(mm, name).state;
  }

  // Acquires and immediately releases: one use of the model.
  void Use(ModelManager& mm, const std::string& name) {
    Result<ModelLease> lease = mm.Acquire(name, Far());
    ASSERT_TRUE(lease.ok()) << name << ": " << lease.status().ToString();
    EXPECT_TRUE(lease->runtime().Run(TokenBatch{}).ok());
  }

  int64_t Evictions(const std::string& model) {
    return metrics_.GetCounter("shoal_worker_model_evictions_total", "", {{"model", model}})
        ->Value();
  }
  int64_t LoadWaits(const std::string& model) {
    return metrics_.GetCounter("shoal_worker_load_waits_total", "", {{"model", model}})->Value();
  }
  int64_t Loads(const std::string& model, const std::string& result) {
    return metrics_
        .GetCounter("shoal_worker_model_loads_total", "", {{"model", model}, {"result", result}})
        ->Value();
  }

  fs::path dir_;
  FakeLoader loader_;  // outlives every manager a test makes
  FakeClock clock_;
  MetricsRegistry metrics_;
};

TEST(ModelManagerOptions, Validate) {
  EXPECT_TRUE(ModelManagerOptions{}.Validate().ok());
  ModelManagerOptions o;
  o.memory_budget_bytes = -1;
  EXPECT_EQ(o.Validate().code(), StatusCode::kInvalidArgument);
  o = {};
  o.pinned = {"a", "a"};
  EXPECT_EQ(o.Validate().code(), StatusCode::kInvalidArgument);
  o = {};
  o.pinned = {"a", "b"};
  o.max_models = 1;
  EXPECT_EQ(o.Validate().code(), StatusCode::kInvalidArgument);
  o = {};
  o.load_threads = 0;
  EXPECT_EQ(o.Validate().code(), StatusCode::kInvalidArgument);
  o = {};
  o.file_size_factor = 0;
  EXPECT_EQ(o.Validate().code(), StatusCode::kInvalidArgument);
}

TEST_F(ModelManagerTest, LazyLoadsOnFirstAcquire) {
  auto mm = Make(Options(0), {Model("a", 100)});
  ASSERT_TRUE(mm->Start().ok());
  EXPECT_FALSE(mm->IsLoaded("a"));
  EXPECT_EQ(StateOf(*mm, "a"), ModelState::kNotLoaded);
  Result<ModelLease> lease = mm->Acquire("a", Far());
  ASSERT_TRUE(lease.ok()) << lease.status().ToString();
  EXPECT_TRUE(mm->IsLoaded("a"));
  EXPECT_EQ(lease->config().name, "a");
  EXPECT_EQ(lease->model().memory_bytes, 100);
  EXPECT_EQ(StatusOf(*mm, "a").leases, 1);
  EXPECT_EQ(StatusOf(*mm, "a").last_used_unix_ms, clock_.NowUnixMs());
  EXPECT_EQ(loader_.loads("a"), 1);
  EXPECT_EQ(Loads("a", "ok"), 1);
  EXPECT_EQ(LoadWaits("a"), 1);
}

TEST_F(ModelManagerTest, UnknownModelIsNotFound) {
  auto mm = Make(Options(0), {Model("a", 100)});
  Result<ModelLease> lease = mm->Acquire("nope", Far());
  EXPECT_EQ(lease.status().code(), StatusCode::kNotFound);
  EXPECT_EQ(lease.status().reason(), "model_not_found");
  EXPECT_EQ(mm->Load("nope").code(), StatusCode::kNotFound);
  EXPECT_EQ(mm->Unload("nope").code(), StatusCode::kNotFound);
  EXPECT_EQ(mm->Pin("nope").code(), StatusCode::kNotFound);
  EXPECT_EQ(mm->Unpin("nope").code(), StatusCode::kNotFound);
  EXPECT_EQ(mm->StartLoad("nope").code(), StatusCode::kNotFound);
  EXPECT_FALSE(mm->IsLoaded("nope"));
}

TEST_F(ModelManagerTest, BudgetForTwoWithTrafficForThreeEvictsLeastRecentlyUsedNeverPinned) {
  // Room for the pinned model and two more.
  auto mm = Make(Options(300, {"p"}),
                 {Model("p", 100), Model("a", 100), Model("b", 100), Model("c", 100)});
  ASSERT_TRUE(mm->Start().ok());
  EXPECT_TRUE(mm->IsLoaded("p"));
  Use(*mm, "a");
  Use(*mm, "b");
  Use(*mm, "a");  // b is now the least recently used unpinned model
  Use(*mm, "c");
  EXPECT_EQ(StateOf(*mm, "b"), ModelState::kNotLoaded);
  EXPECT_TRUE(mm->IsLoaded("a"));
  EXPECT_TRUE(mm->IsLoaded("c"));
  EXPECT_TRUE(mm->IsLoaded("p"));  // least recently used of all, but pinned
  EXPECT_EQ(Evictions("b"), 1);
  EXPECT_EQ(loader_.unloads("b"), 1);
  EXPECT_EQ(mm->memory_used_bytes(), 300);

  Use(*mm, "b");  // a is now the least recently used unpinned model
  EXPECT_EQ(StateOf(*mm, "a"), ModelState::kNotLoaded);
  EXPECT_TRUE(mm->IsLoaded("b"));
  EXPECT_TRUE(mm->IsLoaded("c"));
  EXPECT_TRUE(mm->IsLoaded("p"));
  EXPECT_EQ(Evictions("a"), 1);
  EXPECT_EQ(Evictions("c"), 0);
  EXPECT_EQ(Evictions("p"), 0);
  EXPECT_EQ(loader_.unloads("p"), 0);
  EXPECT_EQ(metrics_.GetGauge("shoal_worker_models_loaded", "")->Value(), 3);
  EXPECT_EQ(mm->memory_used_bytes(), 300);
}

// An operator's load of a model already loaded is a no-op: it does not
// move the model to the back of the eviction order (a check is not a use).
TEST_F(ModelManagerTest, LoadingALoadedModelLeavesItsPlaceInTheEvictionOrder) {
  auto mm = Make(Options(200, {}), {Model("a", 100), Model("b", 100), Model("c", 100)});
  ASSERT_TRUE(mm->Start().ok());
  Use(*mm, "a");
  Use(*mm, "b");
  ASSERT_TRUE(mm->Load("a").ok());  // already loaded: a stays the least recently used
  Use(*mm, "c");
  EXPECT_EQ(StateOf(*mm, "a"), ModelState::kNotLoaded);
  EXPECT_TRUE(mm->IsLoaded("b"));
  EXPECT_TRUE(mm->IsLoaded("c"));
}

TEST(EvictionPolicy, ParsesItsNames) {
  EXPECT_EQ(*ParseEvictionPolicy("lru"), EvictionPolicy::kLru);
  EXPECT_EQ(*ParseEvictionPolicy("gdsf"), EvictionPolicy::kGdsf);
  EXPECT_EQ(EvictionPolicyName(EvictionPolicy::kGdsf), "gdsf");
  EXPECT_EQ(ParseEvictionPolicy("LFU").status().code(), StatusCode::kInvalidArgument);
}

// GDSF keeps what is used often and small: the large model goes although a
// small one was used less recently, and a model used often survives one
// used once since.
TEST_F(ModelManagerTest, GdsfEvictsTheLargeRarelyUsedModelBeforeSmallBusyOnes) {
  ModelManagerOptions o = Options(400);
  o.eviction = EvictionPolicy::kGdsf;
  auto mm = Make(o, {Model("a", 100), Model("b", 100), Model("big", 200), Model("c", 100)});
  ASSERT_TRUE(mm->Start().ok());
  Use(*mm, "a");  // a: least recently used from here on
  Use(*mm, "big");
  Use(*mm, "b");
  Use(*mm, "b");
  Use(*mm, "big");
  Use(*mm, "b");
  // Used as often per byte as nothing else: a (3 uses / 100) and b (7 / 100)
  // beat big (5 / 200). LRU would evict a.
  Use(*mm, "c");
  EXPECT_EQ(StateOf(*mm, "big"), ModelState::kNotLoaded);
  EXPECT_TRUE(mm->IsLoaded("a"));
  EXPECT_TRUE(mm->IsLoaded("b"));
  EXPECT_TRUE(mm->IsLoaded("c"));
  EXPECT_EQ(Evictions("big"), 1);
  EXPECT_EQ(mm->memory_used_bytes(), 300);

  // The same traffic under LRU evicts a (and only a: room for big stays).
  auto lru = Make(Options(400), {Model("a2", 100), Model("b2", 100), Model("big2", 200), Model("c2", 100)});
  ASSERT_TRUE(lru->Start().ok());
  for (const char* m : {"a2", "big2", "b2", "b2", "big2", "b2", "c2"}) Use(*lru, m);
  EXPECT_EQ(StateOf(*lru, "a2"), ModelState::kNotLoaded);
  EXPECT_TRUE(lru->IsLoaded("big2"));
}

TEST_F(ModelManagerTest, GdsfAgesOutModelsNoLongerUsed) {
  ModelManagerOptions o = Options(200);
  o.eviction = EvictionPolicy::kGdsf;
  auto mm = Make(o, {Model("old", 100), Model("x", 100), Model("y", 100), Model("z", 100)});
  ASSERT_TRUE(mm->Start().ok());
  for (int i = 0; i < 3; ++i) Use(*mm, "old");  // popular once: 7 uses
  // A stream of other models: each eviction raises L, so the new models'
  // priorities pass old's stale one and old goes, though it was used most.
  for (const char* m : {"x", "y", "z", "x", "y", "z", "x", "y", "z"}) Use(*mm, m);
  EXPECT_EQ(StateOf(*mm, "old"), ModelState::kNotLoaded);
  EXPECT_EQ(Evictions("old"), 1);
}

TEST_F(ModelManagerTest, EvictsOnlyAsManyAsNeeded) {
  auto mm = Make(Options(300), {Model("a", 100), Model("b", 100), Model("c", 100),
                                Model("big", 200)});
  Use(*mm, "a");
  Use(*mm, "b");
  Use(*mm, "c");
  Use(*mm, "big");  // needs two slots' worth: a and b go, c stays
  EXPECT_EQ(StateOf(*mm, "a"), ModelState::kNotLoaded);
  EXPECT_EQ(StateOf(*mm, "b"), ModelState::kNotLoaded);
  EXPECT_TRUE(mm->IsLoaded("c"));
  EXPECT_TRUE(mm->IsLoaded("big"));
  EXPECT_EQ(mm->memory_used_bytes(), 300);
}

TEST_F(ModelManagerTest, LeasedModelIsNeverEvicted) {
  auto mm = Make(Options(200), {Model("a", 100), Model("b", 100), Model("c", 100)});
  Result<ModelLease> lease_a = mm->Acquire("a", Far());
  ASSERT_TRUE(lease_a.ok());
  Use(*mm, "b");
  Result<ModelLease> lease_c = mm->Acquire("c", Far());  // a is older but leased: b goes
  ASSERT_TRUE(lease_c.ok());
  EXPECT_TRUE(mm->IsLoaded("a"));
  EXPECT_EQ(StateOf(*mm, "b"), ModelState::kNotLoaded);
  EXPECT_TRUE(lease_a->runtime().Run(TokenBatch{}).ok());

  // Everything resident is leased: no room, fail fast, no load, no eviction.
  Result<ModelLease> lease_b = mm->Acquire("b", Far());
  EXPECT_EQ(lease_b.status().code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(lease_b.status().reason(), "no_room_for_model");
  EXPECT_EQ(loader_.loads("b"), 1);
  EXPECT_TRUE(mm->IsLoaded("a"));
  EXPECT_TRUE(mm->IsLoaded("c"));

  lease_a->Release();
  EXPECT_FALSE(lease_a->valid());
  Use(*mm, "b");  // a is free now and the least recently used
  EXPECT_EQ(StateOf(*mm, "a"), ModelState::kNotLoaded);
  EXPECT_TRUE(mm->IsLoaded("c"));
  EXPECT_TRUE(lease_c->runtime().Run(TokenBatch{}).ok());
}

TEST_F(ModelManagerTest, LeaseMovesAndCountsOnce) {
  auto mm = Make(Options(0), {Model("a", 100)});
  Result<ModelLease> r = mm->Acquire("a", Far());
  ASSERT_TRUE(r.ok());
  ModelLease lease = std::move(r).value();
  ModelLease other = std::move(lease);
  EXPECT_FALSE(lease.valid());
  EXPECT_TRUE(other.valid());
  EXPECT_EQ(StatusOf(*mm, "a").leases, 1);
  ModelLease third;
  third = std::move(other);
  EXPECT_EQ(StatusOf(*mm, "a").leases, 1);
  third.Release();
  third.Release();
  EXPECT_EQ(StatusOf(*mm, "a").leases, 0);
}

TEST_F(ModelManagerTest, ConcurrentAcquiresForAColdModelShareOneLoad) {
  auto mm = Make(Options(0), {Model("a", 100)});
  loader_.Hold("a");
  constexpr int kCallers = 8;
  std::vector<Status> results(kCallers);
  std::vector<std::thread> threads;
  for (int i = 0; i < kCallers; ++i) {
    threads.emplace_back([&, i] {
      Result<ModelLease> lease = mm->Acquire("a", Far());
      results[i] = lease.status();
      if (lease.ok() && !lease->runtime().Run(TokenBatch{}).ok()) results[i] = Internal("run");
    });
  }
  ASSERT_TRUE(loader_.WaitStarted("a", 1));
  ASSERT_TRUE(Eventually([&] { return LoadWaits("a") == kCallers; }));
  EXPECT_EQ(StateOf(*mm, "a"), ModelState::kLoading);
  EXPECT_FALSE(mm->IsLoaded("a"));
  loader_.Open("a");
  for (std::thread& t : threads) t.join();
  for (const Status& s : results) EXPECT_TRUE(s.ok()) << s.ToString();
  EXPECT_EQ(loader_.loads("a"), 1);
  EXPECT_EQ(Loads("a", "ok"), 1);
  EXPECT_EQ(metrics_.GetHistogram("shoal_worker_load_wait_seconds", "", {{"model", "a"}}, LatencyBuckets())
                ->Count(),
            kCallers);
}

TEST_F(ModelManagerTest, AModelWhoseRuntimeGaveUpIsUnloadedAndFailedPinnedOrNot) {
  auto mm = Make(Options(0, {"p"}), {Model("a", 100), Model("b", 100), Model("p", 100)});
  ASSERT_TRUE(mm->Start().ok());
  ASSERT_TRUE(mm->Load("a").ok());
  ASSERT_TRUE(mm->Load("b").ok());
  EXPECT_TRUE(mm->FailUnhealthy().empty());
  const Status gave_up(StatusCode::kBadGateway, "its runtime failed to start 5 times in a row", "runtime_failed");
  loader_.SetHealth("a", gave_up);
  loader_.SetHealth("p", gave_up);
  EXPECT_EQ(mm->FailUnhealthy(), (std::vector<std::string>{"a", "p"}));
  EXPECT_EQ(StateOf(*mm, "a"), ModelState::kFailed);
  EXPECT_EQ(StateOf(*mm, "p"), ModelState::kFailed);
  EXPECT_EQ(StateOf(*mm, "b"), ModelState::kLoaded);
  EXPECT_EQ(loader_.unloads("a"), 1);
  EXPECT_EQ(loader_.unloads("p"), 1);
  EXPECT_EQ(mm->memory_used_bytes(), 100);
  // Counted as failed loads, beside the load that had succeeded.
  EXPECT_EQ(Loads("a", "error"), 1);
  EXPECT_EQ(Loads("p", "error"), 1);
  EXPECT_EQ(Loads("a", "ok"), 1);
  EXPECT_EQ(Loads("b", "error"), 0);
  // Callers get the failure at once, as after a failed load, and no load.
  Result<ModelLease> lease = mm->Acquire("a", Far());
  ASSERT_FALSE(lease.ok());
  EXPECT_EQ(lease.status().code(), StatusCode::kBadGateway);
  EXPECT_EQ(lease.status().reason(), "model_load_failed");
  EXPECT_NE(lease.status().message().find("5 times in a row"), std::string::npos) << lease.status().message();
  EXPECT_EQ(loader_.loads("a"), 1);
  // A model in use is left until its lease ends.
  loader_.SetHealth("b", gave_up);
  {
    Result<ModelLease> held = mm->Acquire("b", Far());
    ASSERT_TRUE(held.ok());
    EXPECT_TRUE(mm->FailUnhealthy().empty());
    EXPECT_EQ(StateOf(*mm, "b"), ModelState::kLoaded);
  }
  EXPECT_EQ(mm->FailUnhealthy(), std::vector<std::string>{"b"});
  // An explicit load tries again with a fresh runtime.
  loader_.SetHealth("a", Status::Ok());
  ASSERT_TRUE(mm->Load("a").ok());
  EXPECT_EQ(StateOf(*mm, "a"), ModelState::kLoaded);
  EXPECT_EQ(loader_.loads("a"), 2);
}

// A load that breaks the device is the device's failure, not the model's:
// the model is not loaded (its waiting work stays for other workers, not
// answered with model_load_failed) and the manager reports the device.
TEST_F(ModelManagerTest, ALoadThatBreaksTheDeviceIsNotTheModelsFailure) {
  ModelConfig a = Model("a", 100), b = Model("b", 100);
  auto mm = Make(Options(0), {a, b});
  ASSERT_TRUE(mm->Load("b").ok());
  EXPECT_TRUE(mm->DeviceHealth().ok());
  loader_.Set("a", {.device_fault = true});
  Status s = mm->Load("a");
  EXPECT_EQ(s.code(), StatusCode::kUnavailable) << s.ToString();
  EXPECT_EQ(s.reason(), "device_fault");
  EXPECT_EQ(StatusOf(*mm, "a").state, ModelState::kNotLoaded);
  EXPECT_TRUE(mm->LoadError("a").ok()) << mm->LoadError("a").ToString();
  EXPECT_EQ(Loads("a", "error"), 0);
  const Status device = mm->DeviceHealth();
  EXPECT_EQ(device.reason(), "device_fault") << device.ToString();
  EXPECT_NE(device.message().find("illegal memory access"), std::string::npos) << device.message();
  // Later loads fail at once, without the loader and without evicting.
  EXPECT_EQ(mm->Load("a").reason(), "device_fault");
  EXPECT_EQ(loader_.loads("a"), 1);
  EXPECT_TRUE(mm->IsLoaded("b"));
}

TEST_F(ModelManagerTest, LoadFailureReachesEveryWaiterOnceThenFailsFast) {
  ModelConfig a = Model("a", 100);
  loader_.Set("a", {.fail = true});
  auto mm = Make(Options(0), {a});
  loader_.Hold("a");
  constexpr int kCallers = 5;
  std::vector<Status> results(kCallers);
  std::vector<std::thread> threads;
  for (int i = 0; i < kCallers; ++i) {
    threads.emplace_back([&, i] { results[i] = mm->Acquire("a", Far()).status(); });
  }
  ASSERT_TRUE(loader_.WaitStarted("a", 1));
  ASSERT_TRUE(Eventually([&] { return LoadWaits("a") == kCallers; }));
  loader_.Open("a");
  for (std::thread& t : threads) t.join();
  for (const Status& s : results) {
    EXPECT_EQ(s.code(), StatusCode::kBadGateway) << s.ToString();
    EXPECT_EQ(s.reason(), "model_load_failed");
    EXPECT_NE(s.message().find("no such file"), std::string::npos) << s.message();
  }
  EXPECT_EQ(loader_.loads("a"), 1);
  EXPECT_EQ(Loads("a", "error"), 1);

  // Later callers fail fast with the same error and cause no second load.
  Status again = mm->Acquire("a", Far()).status();
  EXPECT_EQ(again.code(), StatusCode::kBadGateway);
  EXPECT_EQ(again.reason(), "model_load_failed");
  EXPECT_EQ(mm->StartLoad("a").reason(), "model_load_failed");
  EXPECT_EQ(loader_.loads("a"), 1);
  ModelStatus st = StatusOf(*mm, "a");
  EXPECT_EQ(st.state, ModelState::kFailed);
  EXPECT_NE(st.error.find("failed to load"), std::string::npos);
  EXPECT_EQ(st.memory_bytes, 0);
  EXPECT_EQ(mm->memory_used_bytes(), 0);

  // An explicit Load() tries again.
  loader_.Set("a", {.bytes = 100});
  EXPECT_TRUE(mm->Load("a").ok());
  EXPECT_EQ(loader_.loads("a"), 2);
  Use(*mm, "a");
}

TEST_F(ModelManagerTest, ExplicitLoadOfAFailingModelReportsTheError) {
  ModelConfig a = Model("a", 100);
  loader_.Set("a", {.fail = true});
  auto mm = Make(Options(0), {a});
  Status s = mm->Load("a");
  EXPECT_EQ(s.code(), StatusCode::kBadGateway);
  EXPECT_EQ(s.reason(), "model_load_failed");
  s = mm->Load("a");  // explicit: tries again
  EXPECT_EQ(s.reason(), "model_load_failed");
  EXPECT_EQ(loader_.loads("a"), 2);
  // Unload clears the failure; the next Acquire loads again.
  EXPECT_TRUE(mm->Unload("a").ok());
  EXPECT_EQ(StateOf(*mm, "a"), ModelState::kNotLoaded);
  loader_.Set("a", {.bytes = 100});
  Use(*mm, "a");
  EXPECT_EQ(loader_.loads("a"), 3);
}

// What an operator's load does after StartLoad: it waits for the load it
// started, and when that has failed already, reports the failure rather
// than load the model a second time. Pin likewise.
TEST_F(ModelManagerTest, LoadWithoutRetryReportsTheFailureOfTheLoadJustStarted) {
  ModelConfig a = Model("a", 100);
  loader_.Set("a", {.fail = true});
  auto mm = Make(Options(0), {a});
  ASSERT_TRUE(mm->StartLoad("a").ok());
  ASSERT_TRUE(Eventually([&] { return StateOf(*mm, "a") == ModelState::kFailed; }));
  EXPECT_EQ(mm->Load("a", /*retry_failed=*/false).reason(), "model_load_failed");
  EXPECT_EQ(mm->Pin("a", /*retry_failed=*/false).reason(), "model_load_failed");
  EXPECT_EQ(loader_.loads("a"), 1);
  EXPECT_FALSE(StatusOf(*mm, "a").pinned);
  EXPECT_EQ(mm->Load("a").reason(), "model_load_failed");  // retrying: loads again
  EXPECT_EQ(loader_.loads("a"), 2);
  // StartLoad fails fast on a failed model, unless told to retry it.
  EXPECT_EQ(mm->StartLoad("a").reason(), "model_load_failed");
  EXPECT_EQ(loader_.loads("a"), 2);
  EXPECT_TRUE(mm->StartLoad("a", /*retry_failed=*/true).ok());
  EXPECT_TRUE(loader_.WaitStarted("a", 3));
}

// A load or pin that outlasts its caller's deadline answers then; the load
// goes on, and a pin is not left behind.
TEST_F(ModelManagerTest, LoadAndPinStopWaitingAtTheirDeadline) {
  ModelConfig a = Model("a", 100);
  auto mm = Make(Options(0), {a});
  loader_.Hold("a");
  EXPECT_EQ(mm->Pin("a", true, clock_.NowMonoUs()).code(), StatusCode::kDeadlineExceeded);
  EXPECT_FALSE(StatusOf(*mm, "a").pinned);
  EXPECT_EQ(mm->Load("a", true, clock_.NowMonoUs()).code(), StatusCode::kDeadlineExceeded);
  EXPECT_EQ(StateOf(*mm, "a"), ModelState::kLoading);
  loader_.Open("a");
  EXPECT_TRUE(mm->Load("a").ok());
  EXPECT_EQ(loader_.loads("a"), 1);
}

TEST_F(ModelManagerTest, FailedModelIsRetriedAfterRetryInterval) {
  ModelConfig a = Model("a", 100);
  loader_.Set("a", {.fail = true});
  ModelManagerOptions o = Options(0);
  o.retry_failed_after_us = 1000;
  auto mm = Make(o, {a});
  EXPECT_EQ(mm->Acquire("a", Far()).status().reason(), "model_load_failed");
  loader_.Set("a", {.bytes = 100});
  clock_.AdvanceUs(999);
  EXPECT_EQ(mm->Acquire("a", Far()).status().reason(), "model_load_failed");
  EXPECT_EQ(loader_.loads("a"), 1);
  clock_.AdvanceUs(1);
  // LoadError reports the failure, due retry or not, and never retries.
  EXPECT_EQ(mm->LoadError("a").reason(), "model_load_failed");
  EXPECT_EQ(loader_.loads("a"), 1);
  Use(*mm, "a");
  EXPECT_EQ(loader_.loads("a"), 2);
  EXPECT_TRUE(mm->LoadError("a").ok());
}

TEST_F(ModelManagerTest, NoRoomWhenEverythingIsPinned) {
  auto mm = Make(Options(200, {"a", "b"}), {Model("a", 100), Model("b", 100), Model("c", 100)});
  ASSERT_TRUE(mm->Start().ok());
  Result<ModelLease> lease = mm->Acquire("c", Far());
  EXPECT_EQ(lease.status().code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(lease.status().reason(), "no_room_for_model");
  EXPECT_EQ(mm->StartLoad("c").reason(), "no_room_for_model");
  EXPECT_EQ(mm->Load("c").reason(), "no_room_for_model");
  EXPECT_EQ(loader_.loads("c"), 0);
  EXPECT_EQ(StateOf(*mm, "c"), ModelState::kNotLoaded);
  EXPECT_TRUE(mm->IsLoaded("a"));
  EXPECT_TRUE(mm->IsLoaded("b"));
}

TEST_F(ModelManagerTest, ModelLargerThanTheBudgetHasNoRoom) {
  auto mm = Make(Options(200), {Model("a", 100), Model("huge", 500)});
  Use(*mm, "a");
  EXPECT_EQ(mm->Acquire("huge", Far()).status().reason(), "no_room_for_model");
  EXPECT_TRUE(mm->IsLoaded("a"));  // nothing evicted for a hopeless load
  EXPECT_EQ(loader_.loads("huge"), 0);
}

TEST_F(ModelManagerTest, MaxModelsIsRespected) {
  auto mm = Make(Options(0, {}, /*max_models=*/2), {Model("a", 100), Model("b", 100),
                                                    Model("c", 100)});
  Use(*mm, "a");
  Use(*mm, "b");
  Use(*mm, "c");
  EXPECT_EQ(StateOf(*mm, "a"), ModelState::kNotLoaded);
  EXPECT_TRUE(mm->IsLoaded("b"));
  EXPECT_TRUE(mm->IsLoaded("c"));
  EXPECT_EQ(Evictions("a"), 1);
  Result<ModelLease> lb = mm->Acquire("b", Far());
  Result<ModelLease> lc = mm->Acquire("c", Far());
  ASSERT_TRUE(lb.ok() && lc.ok());
  EXPECT_EQ(mm->Acquire("a", Far()).status().reason(), "no_room_for_model");
}

TEST_F(ModelManagerTest, UnloadRefusesPinnedAndBusyModels) {
  auto mm = Make(Options(0, {"p"}), {Model("p", 100), Model("a", 100)});
  ASSERT_TRUE(mm->Start().ok());
  Status s = mm->Unload("p");
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(s.reason(), "model_pinned");
  EXPECT_TRUE(mm->IsLoaded("p"));

  Result<ModelLease> lease = mm->Acquire("a", Far());
  ASSERT_TRUE(lease.ok());
  s = mm->Unload("a");
  EXPECT_EQ(s.code(), StatusCode::kUnavailable);
  EXPECT_EQ(s.reason(), "model_busy");
  EXPECT_TRUE(mm->IsLoaded("a"));
  lease->Release();

  EXPECT_TRUE(mm->Unload("a").ok());
  EXPECT_FALSE(mm->IsLoaded("a"));
  EXPECT_EQ(loader_.unloads("a"), 1);
  EXPECT_EQ(Evictions("a"), 0);  // an explicit unload is not an eviction
  EXPECT_EQ(StatusOf(*mm, "a").memory_bytes, 0);
  EXPECT_EQ(mm->memory_used_bytes(), 100);
  EXPECT_TRUE(mm->Unload("a").ok());  // not loaded: nothing to do
}

TEST_F(ModelManagerTest, UnloadRefusesALoadingModel) {
  auto mm = Make(Options(0), {Model("a", 100)});
  loader_.Hold("a");
  ASSERT_TRUE(mm->StartLoad("a").ok());
  ASSERT_TRUE(loader_.WaitStarted("a", 1));
  EXPECT_EQ(mm->Unload("a").reason(), "model_busy");
  loader_.Open("a");
  EXPECT_TRUE(mm->Load("a").ok());
  EXPECT_EQ(loader_.loads("a"), 1);
}

TEST_F(ModelManagerTest, PinLoadsAndProtectsUnpinMakesEvictable) {
  auto mm = Make(Options(200), {Model("a", 100), Model("b", 100), Model("c", 100)});
  ASSERT_TRUE(mm->Pin("a").ok());
  EXPECT_TRUE(mm->IsLoaded("a"));
  EXPECT_TRUE(StatusOf(*mm, "a").pinned);
  EXPECT_TRUE(mm->Pin("a").ok());  // idempotent
  EXPECT_EQ(loader_.loads("a"), 1);
  Use(*mm, "b");
  Use(*mm, "c");  // a is older but pinned: b goes
  EXPECT_TRUE(mm->IsLoaded("a"));
  EXPECT_EQ(StateOf(*mm, "b"), ModelState::kNotLoaded);

  ASSERT_TRUE(mm->Unpin("a").ok());
  EXPECT_FALSE(StatusOf(*mm, "a").pinned);
  EXPECT_TRUE(mm->IsLoaded("a"));  // unpinning does not unload
  Use(*mm, "b");                   // now a is the least recently used
  EXPECT_EQ(StateOf(*mm, "a"), ModelState::kNotLoaded);
  EXPECT_TRUE(mm->IsLoaded("c"));
}

TEST_F(ModelManagerTest, PinOfAFailingModelLeavesItUnpinned) {
  ModelConfig a = Model("a", 100);
  loader_.Set("a", {.fail = true});
  auto mm = Make(Options(0), {a});
  EXPECT_EQ(mm->Pin("a").reason(), "model_load_failed");
  EXPECT_FALSE(StatusOf(*mm, "a").pinned);
  EXPECT_EQ(StateOf(*mm, "a"), ModelState::kFailed);
}

// Two pins of a loading model: the first gives up at its deadline while
// the second waits on. The second's pin, which succeeds, is kept (the first
// used to unpin the model on its way out).
TEST_F(ModelManagerTest, APinThatGivesUpDoesNotUndoAnotherThatSucceeds) {
  auto mm = Make(Options(0), {Model("a", 100)});
  loader_.Hold("a");
  Status impatient, patient;
  std::thread first([&] { impatient = mm->Pin("a", true, clock_.NowMonoUs() + 1000); });
  EXPECT_TRUE(loader_.WaitStarted("a", 1));  // not ASSERT: `first` runs
  std::thread second([&] { patient = mm->Pin("a"); });
  std::this_thread::sleep_for(std::chrono::milliseconds(300));  // the second waits too
  clock_.AdvanceUs(1000);
  first.join();
  EXPECT_EQ(impatient.code(), StatusCode::kDeadlineExceeded) << impatient.ToString();
  loader_.Open("a");
  second.join();
  ASSERT_TRUE(patient.ok()) << patient.ToString();
  EXPECT_TRUE(StatusOf(*mm, "a").pinned);
  EXPECT_EQ(loader_.loads("a"), 1);
}

TEST_F(ModelManagerTest, StatusesAndAccountingUseMeasuredBytesAfterLoad) {
  // File of 100 bytes: estimate 130 with the default factor; measures 500.
  ModelConfig a = Model("a", 500, /*file_bytes=*/100);
  ModelManagerOptions o;
  auto mm = Make(o, {a});
  loader_.Hold("a");
  ASSERT_TRUE(mm->StartLoad("a").ok());
  ASSERT_TRUE(loader_.WaitStarted("a", 1));
  EXPECT_EQ(StatusOf(*mm, "a").state, ModelState::kLoading);
  EXPECT_EQ(StatusOf(*mm, "a").memory_bytes, 130);  // the reservation
  EXPECT_EQ(StatusOf(*mm, "a").measured_bytes, 0);  // never loaded yet
  EXPECT_EQ(mm->memory_used_bytes(), 130);
  loader_.Open("a");
  ASSERT_TRUE(mm->Load("a").ok());
  EXPECT_EQ(StatusOf(*mm, "a").memory_bytes, 500);
  EXPECT_EQ(mm->memory_used_bytes(), 500);
  EXPECT_EQ(metrics_.GetGauge("shoal_worker_model_memory_bytes", "", {{"model", "a"}})->Value(),
            500);
  EXPECT_TRUE(mm->Unload("a").ok());
  EXPECT_EQ(metrics_.GetGauge("shoal_worker_model_memory_bytes", "", {{"model", "a"}})->Value(),
            0);
  EXPECT_EQ(mm->memory_used_bytes(), 0);
  // Not resident, but what it measured is still known (and reported).
  EXPECT_EQ(StatusOf(*mm, "a").memory_bytes, 0);
  EXPECT_EQ(StatusOf(*mm, "a").measured_bytes, 500);
}

TEST_F(ModelManagerTest, FootprintFromRuntimeWhenLoaderLeavesItZero) {
  ModelConfig a = Model("a", 0, /*file_bytes=*/-1);
  loader_.Set("a", {.bytes = 321, .report_via_runtime = true});
  auto mm = Make(Options(0), {a});
  Use(*mm, "a");
  EXPECT_EQ(StatusOf(*mm, "a").memory_bytes, 321);
  EXPECT_EQ(mm->memory_used_bytes(), 321);
}

TEST_F(ModelManagerTest, LastMeasuredFootprintDecidesTheNextLoad) {
  // a's file says 100 but it measures 400. Budget 450.
  auto mm = Make(Options(450), {Model("a", 400, /*file_bytes=*/100), Model("b", 100)});
  Use(*mm, "a");
  ASSERT_TRUE(mm->Unload("a").ok());
  Use(*mm, "b");
  // By its file a would fit beside b; by its measured footprint b must go
  // before a loads.
  loader_.Hold("a");
  ASSERT_TRUE(mm->StartLoad("a").ok());
  ASSERT_TRUE(loader_.WaitStarted("a", 2));
  EXPECT_EQ(StateOf(*mm, "b"), ModelState::kNotLoaded);
  EXPECT_EQ(loader_.unloads("b"), 1);
  EXPECT_EQ(StatusOf(*mm, "a").memory_bytes, 400);
  loader_.Open("a");
  ASSERT_TRUE(mm->Load("a").ok());
  EXPECT_EQ(mm->memory_used_bytes(), 400);
}

TEST_F(ModelManagerTest, LowEstimateIsCorrectedByEvictingAfterLoad) {
  // No model files: nothing is known until a model loads.
  auto mm = Make(Options(250), {Model("a", 100, -1), Model("b", 100, -1), Model("c", 100, -1)});
  Use(*mm, "a");
  Use(*mm, "b");
  Use(*mm, "c");  // estimated 0, measured 100: a (least recently used) goes
  EXPECT_EQ(StateOf(*mm, "a"), ModelState::kNotLoaded);
  EXPECT_TRUE(mm->IsLoaded("b"));
  EXPECT_TRUE(mm->IsLoaded("c"));
  EXPECT_EQ(Evictions("a"), 1);
  // a's memory counts as used until its unload on the loader thread is done.
  EXPECT_TRUE(Eventually([&] { return mm->memory_used_bytes() == 200; }));
  EXPECT_EQ(loader_.unloads("a"), 1);
}

TEST_F(ModelManagerTest, DeadlineWhileWaitingForASlowLoadThenLoadCompletes) {
  auto mm = Make(Options(0), {Model("a", 100)});
  loader_.Hold("a");
  Status waited;
  std::thread caller([&] { waited = mm->Acquire("a", clock_.NowMonoUs() + 1000).status(); });
  ASSERT_TRUE(loader_.WaitStarted("a", 1));
  ASSERT_TRUE(Eventually([&] { return LoadWaits("a") == 1; }));
  clock_.AdvanceUs(1000);
  caller.join();
  EXPECT_EQ(waited.code(), StatusCode::kDeadlineExceeded) << waited.ToString();
  EXPECT_EQ(StateOf(*mm, "a"), ModelState::kLoading);

  loader_.Open("a");
  Use(*mm, "a");
  EXPECT_EQ(loader_.loads("a"), 1);
}

TEST_F(ModelManagerTest, PastDeadlineStillServesALoadedModel) {
  auto mm = Make(Options(0), {Model("a", 100)});
  ASSERT_TRUE(mm->Load("a").ok());
  EXPECT_TRUE(mm->Acquire("a", clock_.NowMonoUs() - 1).ok());
}

// A load that evicts several models stops every use of all of them before
// any runtime unloads: a victim still in use while another's runtime
// unloads (a GPU's can take a second) would go on pulling work, only to
// hand it back.
TEST_F(ModelManagerTest, EveryVictimIsDetachedBeforeAnyRuntimeUnloads) {
  ModelConfig a = Model("a", 100), b = Model("b", 100), c = Model("c", 200);
  auto mm = Make(Options(200), {a, b, c});
  Use(*mm, "a");
  Use(*mm, "b");
  Use(*mm, "c");  // needs both a's and b's room
  EXPECT_FALSE(mm->IsLoaded("a"));
  EXPECT_FALSE(mm->IsLoaded("b"));
  std::vector<std::string> events = loader_.events();
  ASSERT_EQ(events.size(), 4u);
  EXPECT_EQ(events[0].rfind("detach ", 0), 0u) << events[0];
  EXPECT_EQ(events[1].rfind("detach ", 0), 0u) << events[1];
  EXPECT_EQ(events[2].rfind("unload ", 0), 0u) << events[2];
  EXPECT_EQ(events[3].rfind("unload ", 0), 0u) << events[3];
}

// A runtime that throws as it unloads (a device that failed) neither ends
// the loader thread nor leaves its bytes counted as being freed.
TEST_F(ModelManagerTest, ARuntimeThatThrowsOnUnloadStillFreesItsRoom) {
  // a is larger than b: 50 of its bytes are counted as being freed until
  // its unload ends.
  auto mm = Make(Options(150), {Model("a", 150), Model("b", 100)});
  ASSERT_TRUE(mm->Load("a").ok());
  loader_.ThrowOnUnload("a");
  ASSERT_TRUE(mm->Load("b").ok());  // evicts a, whose Unload throws
  EXPECT_EQ(loader_.unloads("a"), 1);
  ASSERT_TRUE(Eventually([&] { return mm->memory_used_bytes() == 100; })) << mm->memory_used_bytes();
  ASSERT_TRUE(mm->Unload("b").ok());
  ASSERT_TRUE(Eventually([&] { return mm->memory_used_bytes() == 0; }));
  ASSERT_TRUE(mm->Load("a").ok());  // the loader thread lives on
  EXPECT_EQ(StateOf(*mm, "a"), ModelState::kLoaded);
}

// The change hook (on which the worker's demand starts its next load) runs
// once the loader is free: a load started from it chooses its victims at
// once, instead of being told to wait for the loader it is announced by.
TEST_F(ModelManagerTest, ALoadStartedWhenALoadIsAnnouncedDoesNotWaitForThatLoader) {
  // Declared before the manager: its hook may run until the manager is gone.
  bool fired = false;  // the hook's own (one loader thread)
  Status c_started;
  std::atomic<bool> tried{false};
  auto mm = Make(Options(200), {Model("a", 100), Model("b", 100), Model("c", 100)});
  mm->SetOnChange([&] {  // before any load: the loader thread calls it
    if (fired || !mm->IsLoaded("b")) return;
    fired = true;
    c_started = mm->StartLoad("c");  // needs a's room
    tried = true;
  });
  ASSERT_TRUE(mm->Load("a").ok());
  ASSERT_TRUE(mm->Load("b").ok());
  ASSERT_TRUE(Eventually([&] { return tried.load(); }));
  EXPECT_TRUE(c_started.ok()) << c_started.ToString();
  ASSERT_TRUE(Eventually([&] { return mm->IsLoaded("c"); }));
  EXPECT_EQ(Evictions("a"), 1);
}

// A load that needs room while the loader is busy with another chooses its
// victims only once the loader is free: a victim evicted for a queued load
// would go on serving for the whole other load while shown not loaded.
TEST_F(ModelManagerTest, VictimsAreChosenWhenTheLoaderIsFreeNotWhileItIsBusy) {
  auto mm = Make(Options(200), {Model("a", 100), Model("b", 100), Model("c", 100)});
  // Every load is announced when it starts, c's too, though it began after
  // waiting for the loader rather than in a StartLoad (the worker publishes
  // its heartbeat then, so peers see "loading").
  std::mutex started_mu;
  std::vector<std::pair<std::string, ModelState>> started;
  mm->SetOnLoadStart([&](const std::string& model) {
    const ModelState state = StateOf(*mm, model);
    std::lock_guard<std::mutex> lock(started_mu);
    started.emplace_back(model, state);
  });
  ASSERT_TRUE(mm->Load("a").ok());
  loader_.Hold("b");
  ASSERT_TRUE(mm->StartLoad("b").ok());  // fits beside a: no eviction
  ASSERT_TRUE(loader_.WaitStarted("b", 1));
  // c needs a's room, and the loader is busy with b: nothing is evicted yet.
  EXPECT_EQ(mm->StartLoad("c").reason(), "memory_being_freed");
  EXPECT_EQ(StateOf(*mm, "a"), ModelState::kLoaded) << "evicted for a load that could not start yet";
  EXPECT_EQ(StateOf(*mm, "c"), ModelState::kNotLoaded);
  EXPECT_EQ(Evictions("a"), 0);
  Status c_loaded;
  std::thread control([&] { c_loaded = mm->Load("c"); });  // waits for the loader
  loader_.Open("b");
  control.join();
  EXPECT_TRUE(c_loaded.ok()) << c_loaded.ToString();
  EXPECT_EQ(StateOf(*mm, "b"), ModelState::kLoaded);
  EXPECT_EQ(StateOf(*mm, "c"), ModelState::kLoaded);
  EXPECT_EQ(StateOf(*mm, "a"), ModelState::kNotLoaded);
  EXPECT_EQ(Evictions("a"), 1);
  std::lock_guard<std::mutex> lock(started_mu);
  EXPECT_EQ(started, (std::vector<std::pair<std::string, ModelState>>{
                         {"a", ModelState::kLoading}, {"b", ModelState::kLoading}, {"c", ModelState::kLoading}}));
}

// Room that an unload under way will free is waited for, not taken again
// from another resident model: evicting b as well would leave the budget
// half empty once a's unload ends. The same for a model count.
TEST_F(ModelManagerTest, ALoadWaitsForMemoryBeingFreedInsteadOfEvictingMore) {
  for (const bool by_count : {false, true}) {
    SCOPED_TRACE(by_count ? "max_models 2" : "budget of 2 models");
    auto mm = Make(by_count ? Options(0, {}, /*max_models=*/2) : Options(200),
                   {Model("a", 100), Model("b", 100), Model("c", 100)});
    ASSERT_TRUE(mm->Load("a").ok());
    ASSERT_TRUE(mm->Load("b").ok());
    const int unloads_before = loader_.unloads("a");
    const int64_t evictions_before = Evictions("b");
    loader_.HoldUnload("a");
    std::thread unload([&] { EXPECT_TRUE(mm->Unload("a").ok()); });
    ASSERT_TRUE(loader_.WaitUnloadStarted("a", unloads_before + 1));
    EXPECT_EQ(mm->StartLoad("c").reason(), "memory_being_freed");
    EXPECT_EQ(StateOf(*mm, "b"), ModelState::kLoaded) << "evicted while a's room was being freed";
    Status c_loaded;
    std::thread waiter([&] { c_loaded = mm->Load("c"); });
    loader_.OpenUnload("a");
    unload.join();
    waiter.join();
    EXPECT_TRUE(c_loaded.ok()) << c_loaded.ToString();
    EXPECT_EQ(StateOf(*mm, "b"), ModelState::kLoaded);
    EXPECT_EQ(StateOf(*mm, "c"), ModelState::kLoaded);
    EXPECT_EQ(Evictions("b"), evictions_before);
    mm.reset();
  }
}

TEST_F(ModelManagerTest, StartLoadDoesNotWait) {
  auto mm = Make(Options(0), {Model("a", 100)});
  loader_.Hold("a");
  EXPECT_FALSE(mm->LoadedOrLoading("a"));
  EXPECT_TRUE(mm->StartLoad("a").ok());
  EXPECT_TRUE(mm->StartLoad("a").ok());  // already loading: same load
  EXPECT_FALSE(mm->IsLoaded("a"));
  EXPECT_TRUE(mm->LoadedOrLoading("a"));
  loader_.Open("a");
  ASSERT_TRUE(Eventually([&] { return mm->IsLoaded("a"); }));
  EXPECT_EQ(loader_.loads("a"), 1);
  EXPECT_EQ(LoadWaits("a"), 0);
}

TEST_F(ModelManagerTest, StartRejectsBadPinnedSets) {
  {
    auto mm = Make(Options(0, {"ghost"}), {Model("a", 100)});
    EXPECT_EQ(mm->Start().code(), StatusCode::kNotFound);
  }
  {
    ModelConfig a = Model("a", 100);
    loader_.Set("a", {.fail = true});
    auto mm = Make(Options(0, {"a"}), {a});
    Status s = mm->Start();
    EXPECT_EQ(s.code(), StatusCode::kBadGateway);
    EXPECT_EQ(s.reason(), "model_load_failed");
  }
  {
    // Estimates fit (no files), measured footprints do not.
    auto mm = Make(Options(300, {"x", "y"}), {Model("x", 200, -1), Model("y", 200, -1)});
    Status s = mm->Start();
    EXPECT_EQ(s.code(), StatusCode::kResourceExhausted);
    EXPECT_EQ(s.reason(), "pinned_models_exceed_budget");
  }
  {
    // Estimates (file sizes) that do not fit: the same error, naming the model.
    auto mm = Make(Options(300, {"x", "y"}), {Model("x", 100, 200), Model("y", 100, 250)});
    Status s = mm->Start();
    EXPECT_EQ(s.code(), StatusCode::kResourceExhausted);
    EXPECT_EQ(s.reason(), "pinned_models_exceed_budget") << s.ToString();
    EXPECT_NE(s.message().find("pinned model 'y'"), std::string::npos) << s.message();
  }
  {
    auto mm = Make(Options(0), {Model("a", 100), Model("a", 100)});
    EXPECT_EQ(mm->Start().code(), StatusCode::kInvalidArgument);
  }
}

TEST_F(ModelManagerTest, DestructorFinishesTheLoadInFlightAndUnloadsEverything) {
  auto mm = Make(Options(0), {Model("a", 100), Model("b", 100)});
  Use(*mm, "a");
  loader_.Hold("b");
  ASSERT_TRUE(mm->StartLoad("b").ok());
  ASSERT_TRUE(loader_.WaitStarted("b", 1));
  std::thread destroyer([&] { mm.reset(); });
  loader_.Open("b");
  destroyer.join();
  EXPECT_EQ(loader_.unloads("a"), 1);
  EXPECT_EQ(loader_.unloads("b"), 1);
}

TEST_F(ModelManagerTest, ConcurrentTrafficNeverUnloadsALeasedModelNorExceedsBudget) {
  std::vector<ModelConfig> catalog;
  const std::vector<std::string> names = {"m0", "m1", "m2", "m3", "m4"};
  for (const std::string& n : names) catalog.push_back(Model(n, 100));
  ModelManagerOptions o = Options(300);
  o.load_threads = 2;
  auto mm = Make(o, catalog);
  std::atomic<int> served{0};
  std::atomic<int> bad{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 150; ++i) {
        const std::string& name = names[(t * 7 + i * (t + 1)) % names.size()];
        Result<ModelLease> lease = mm->Acquire(name, Far());
        if (!lease.ok()) {
          // All resident models leased by the other callers: allowed.
          if (lease.status().reason() != "no_room_for_model") {
            ++bad;
            ADD_FAILURE() << lease.status().ToString();
          }
          continue;
        }
        if (!lease->runtime().Run(TokenBatch{}).ok()) {
          ++bad;
          ADD_FAILURE() << "ran an unloaded model";
        }
        if (mm->memory_used_bytes() > 300) {
          ++bad;
          std::string dump;
          for (const ModelStatus& st : mm->Statuses()) {
            dump += st.name + ":" + std::string(ModelStateName(st.state)) + ":" +
                    std::to_string(st.memory_bytes) + " ";
          }
          ADD_FAILURE() << "over budget: " << mm->memory_used_bytes() << " " << dump;
        }
        ++served;
      }
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(bad.load(), 0);
  EXPECT_GT(served.load(), 0);
  EXPECT_LE(mm->memory_used_bytes(), 300);
  int loaded = 0;
  for (const ModelStatus& s : mm->Statuses()) {
    EXPECT_EQ(s.leases, 0);
    loaded += s.state == ModelState::kLoaded ? 1 : 0;
  }
  EXPECT_LE(loaded, 3);
}

}  // namespace
}  // namespace shoal

namespace shoal {
namespace {

// Records when it is destroyed relative to its model's runtime unload.
class OrderAttachment final : public ModelAttachment {
 public:
  OrderAttachment(FakeLoader* loader, std::string name, std::vector<std::string>* log, std::mutex* mu)
      : loader_(loader), name_(std::move(name)), log_(log), mu_(mu) {}
  ~OrderAttachment() override {
    std::lock_guard<std::mutex> lock(*mu_);
    log_->push_back("detach " + name_ + " after " + std::to_string(loader_->unloads(name_)) + " unloads");
  }

 private:
  FakeLoader* loader_;
  std::string name_;
  std::vector<std::string>* log_;
  std::mutex* mu_;
};

TEST_F(ModelManagerTest, AttachmentGoesBeforeUnloadTouchOrdersLruAndChangesAreReported) {
  std::vector<ModelConfig> catalog = {Model("a", 100), Model("b", 100), Model("c", 100)};
  std::vector<std::string> log;
  std::mutex log_mu;
  ModelLoader inner = loader_.AsLoader();
  ModelLoader loader = [&](const ModelConfig& c) -> Result<std::unique_ptr<LoadedModel>> {
    ASSIGN_OR_RETURN(auto m, inner(c));
    m->attachment = std::make_unique<OrderAttachment>(&loader_, c.name, &log, &log_mu);
    return m;
  };
  ModelManager mm(Options(250), catalog, loader, &clock_, &metrics_);
  std::atomic<int> changes{0};
  mm.SetOnChange([&] { ++changes; });
  ASSERT_TRUE(mm.Start().ok());
  ASSERT_TRUE(mm.Load("a").ok());
  ASSERT_TRUE(mm.Load("b").ok());
  EXPECT_TRUE(Eventually([&] { return changes.load() == 2; }));
  EXPECT_FALSE(mm.FitsWithoutEviction("c"));  // 200 used + 100 > 250
  // "a" was loaded first, but a touch makes "b" the least recently used.
  mm.Touch("a");
  mm.Touch("nope");  // unknown: ignored
  ASSERT_TRUE(mm.StartLoad("c").ok());
  EXPECT_TRUE(Eventually([&] { return mm.IsLoaded("c"); }));
  EXPECT_EQ(StateOf(mm, "b"), ModelState::kNotLoaded);
  EXPECT_TRUE(mm.IsLoaded("a"));
  EXPECT_TRUE(Eventually([&] { return changes.load() == 3; }));
  std::lock_guard<std::mutex> lock(log_mu);
  EXPECT_EQ(log, std::vector<std::string>{"detach b after 0 unloads"});
}

// Says whether its model holds pulled work, as a test sets it.
class WorkAttachment final : public ModelAttachment {
 public:
  explicit WorkAttachment(const std::atomic<bool>* holds) : holds_(holds) {}
  bool HoldsWork() const override { return holds_->load(); }

 private:
  const std::atomic<bool>* holds_;
};

TEST_F(ModelManagerTest, ModelHoldingPulledWorkIsNotEvicted) {
  std::vector<ModelConfig> catalog = {Model("a", 100), Model("b", 100), Model("c", 100)};
  std::map<std::string, std::atomic<bool>> holds;
  for (const auto& c : catalog) holds[c.name] = false;
  ModelLoader inner = loader_.AsLoader();
  ModelLoader loader = [&](const ModelConfig& c) -> Result<std::unique_ptr<LoadedModel>> {
    ASSIGN_OR_RETURN(auto m, inner(c));
    m->attachment = std::make_unique<WorkAttachment>(&holds.at(c.name));
    return m;
  };
  ModelManager mm(Options(200), catalog, loader, &clock_, &metrics_);
  ASSERT_TRUE(mm.Start().ok());
  Use(mm, "a");
  Use(mm, "b");
  // "a" is the least recently used, but work for it waits: "b" goes.
  holds["a"] = true;
  Use(mm, "c");
  EXPECT_TRUE(mm.IsLoaded("a"));
  EXPECT_EQ(StateOf(mm, "b"), ModelState::kNotLoaded);
  EXPECT_EQ(Evictions("a"), 0);

  // Every resident model holds work: no room, nothing evicted, no load.
  holds["c"] = true;
  Result<ModelLease> lease_b = mm.Acquire("b", Far());
  EXPECT_EQ(lease_b.status().code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(lease_b.status().reason(), "no_room_for_model");
  EXPECT_EQ(loader_.loads("b"), 1);
  EXPECT_TRUE(mm.IsLoaded("a"));
  EXPECT_TRUE(mm.IsLoaded("c"));

  // Once "a" has run its work it is the least recently used again.
  holds["a"] = false;
  Use(mm, "b");
  EXPECT_EQ(StateOf(mm, "a"), ModelState::kNotLoaded);
  EXPECT_TRUE(mm.IsLoaded("c"));
  EXPECT_EQ(Evictions("a"), 1);
}

TEST_F(ModelManagerTest, FitsWithoutEvictionCountsModels) {
  ModelManager mm(Options(0, {}, 1), {Model("a", 10), Model("b", 10)}, loader_.AsLoader(), &clock_,
                  &metrics_);
  ASSERT_TRUE(mm.Start().ok());
  EXPECT_TRUE(mm.FitsWithoutEviction("a"));
  EXPECT_FALSE(mm.FitsWithoutEviction("missing"));
  ASSERT_TRUE(mm.Load("a").ok());
  EXPECT_FALSE(mm.FitsWithoutEviction("b"));
}

// A model whose measured footprint exceeds the whole budget (its file said
// far less) does not stay loaded over the budget: it is unloaded again,
// nothing else is evicted, and its callers get no_room_for_model; the next
// ask fails at once on the measured size.
TEST_F(ModelManagerTest, AModelMeasuredLargerThanTheWholeBudgetIsUnloadedAgain) {
  auto mm = Make(Options(300), {Model("a", 100), Model("b", 100), Model("huge", /*measured=*/500, /*file=*/10)});
  ASSERT_TRUE(mm->Start().ok());
  Use(*mm, "a");
  Use(*mm, "b");
  Result<ModelLease> lease = mm->Acquire("huge", Far());
  EXPECT_EQ(lease.status().reason(), "no_room_for_model") << lease.status().ToString();
  EXPECT_NE(lease.status().message().find("more than the whole memory budget"), std::string::npos)
      << lease.status().message();
  EXPECT_EQ(StateOf(*mm, "huge"), ModelState::kNotLoaded);
  EXPECT_TRUE(mm->IsLoaded("a"));
  EXPECT_TRUE(mm->IsLoaded("b"));
  // Unloaded just after its waiters hear (the loader frees it once the
  // lock is given up).
  EXPECT_TRUE(Eventually([&] { return loader_.unloads("huge") == 1; }));
  EXPECT_TRUE(Eventually([&] { return mm->memory_used_bytes() == 200; }));
  EXPECT_EQ(mm->Acquire("huge", Far()).status().reason(), "no_room_for_model");
  EXPECT_EQ(loader_.loads("huge"), 1);  // not loaded a second time
  // Never started: a worker's model server pulls no work for it (which it
  // would hand back, at the cost of a delivery). The models kept were.
  EXPECT_EQ(loader_.starts("huge"), 0);
  EXPECT_EQ(loader_.starts("a"), 1);
  EXPECT_EQ(loader_.starts("b"), 1);
}

// A model that loads but cannot start serving (no thread to be had) is
// unloaded again and its callers hear why; the manager goes on loading.
TEST_F(ModelManagerTest, AModelThatCannotStartServingIsUnloadedAgain) {
  auto mm = Make(Options(300), {Model("a", 100), Model("b", 100)});
  loader_.Set("a", {.bytes = 100, .throw_on_start = true});
  Result<ModelLease> lease = mm->Acquire("a", Far());
  EXPECT_EQ(lease.status().code(), StatusCode::kInternal) << lease.status().ToString();
  EXPECT_NE(lease.status().message().find("could not start serving"), std::string::npos)
      << lease.status().message();
  EXPECT_EQ(StateOf(*mm, "a"), ModelState::kNotLoaded);
  EXPECT_TRUE(Eventually([&] { return loader_.unloads("a") == 1; }));
  EXPECT_TRUE(Eventually([&] { return mm->memory_used_bytes() == 0; }));
  Use(*mm, "b");
  EXPECT_TRUE(mm->IsLoaded("b"));
}

// Preloading fills what is free and never evicts: a model that fits by its
// estimate but not by its measured footprint is unloaded again, not the
// models preloaded before it.
// A preload that joins a load under way (a request's) does not change what
// that load does when the model measures more than estimated: the request's
// load evicts idle models as any load does, rather than being unloaded
// again as a preload that does not fit would be.
TEST_F(ModelManagerTest, APreloadJoiningAnotherLoadLeavesThatLoadItsRules) {
  ModelConfig a = Model("a", 100), b = Model("b", 250, /*file_bytes=*/100);
  auto mm = Make(Options(300), {a, b});
  Use(*mm, "a");
  loader_.Hold("b");
  ASSERT_TRUE(mm->StartLoad("b").ok());  // fits by its estimate (100)
  ASSERT_TRUE(loader_.WaitStarted("b", 1));
  Status preloaded;
  std::thread preload([&] { preloaded = mm->Preload("b"); });
  ASSERT_TRUE(Eventually([&] { return StatusOf(*mm, "b").state == ModelState::kLoading; }));
  std::this_thread::sleep_for(std::chrono::milliseconds(50));  // the preload waits on the load
  loader_.Open("b");
  preload.join();
  EXPECT_TRUE(preloaded.ok()) << preloaded.ToString();
  EXPECT_TRUE(mm->IsLoaded("b"));
  EXPECT_FALSE(mm->IsLoaded("a"));  // evicted for b's measured 250
  EXPECT_EQ(loader_.loads("b"), 1);
}

TEST_F(ModelManagerTest, PreloadNeverEvicts) {
  auto mm = Make(Options(300), {Model("a", 100), Model("b", 100), Model("ocr", /*measured=*/150, /*file=*/-1),
                                Model("c", 100), Model("d", 100)});
  ASSERT_TRUE(mm->Start().ok());
  EXPECT_TRUE(mm->Preload("a").ok());
  EXPECT_TRUE(mm->Preload("b").ok());
  // No model file: estimated at 0, measured at 150 > the 100 left.
  const Status s = mm->Preload("ocr");
  EXPECT_EQ(s.reason(), "no_room_for_model") << s.ToString();
  EXPECT_EQ(StateOf(*mm, "ocr"), ModelState::kNotLoaded);
  EXPECT_TRUE(mm->IsLoaded("a"));
  EXPECT_TRUE(mm->IsLoaded("b"));
  EXPECT_EQ(Evictions("a") + Evictions("b"), 0);
  EXPECT_TRUE(mm->Preload("c").ok());
  EXPECT_EQ(mm->Preload("d").reason(), "no_room_for_model");  // by its estimate: not even loaded
  EXPECT_EQ(loader_.loads("d"), 0);
  EXPECT_EQ(mm->Preload("nope").code(), StatusCode::kNotFound);
  // A request for the OCR model still loads it, evicting as it must.
  Use(*mm, "ocr");
  EXPECT_TRUE(mm->IsLoaded("ocr"));
}

// A GPU worker: models on the GPU ("g*") and models whose runtime computes
// on the host ("h*") have a budget each, and a load evicts within its own.
class PoolsTest : public ModelManagerTest {
 protected:
  ModelConfig Gpu(const std::string& name, int64_t bytes) {
    ModelConfig c = Model(name, bytes);
    c.device = "cuda:0";
    return c;
  }
  static ModelManagerOptions GpuOptions(int64_t gpu_budget, int64_t host_budget, std::vector<std::string> pinned = {},
                                        int max_models = 0) {
    ModelManagerOptions o = Options(gpu_budget, std::move(pinned), max_models);
    o.in_host_memory = [](const ModelConfig& c) { return c.device != "cuda:0"; };
    o.host_memory_budget_bytes = host_budget;
    return o;
  }
};

TEST_F(PoolsTest, AModelInHostMemoryNeitherFillsNorEvictsTheGpusBudget) {
  auto mm = Make(GpuOptions(200, 300),
                 {Gpu("g1", 100), Gpu("g2", 100), Gpu("g3", 100), Model("h1", 250), Model("h2", 250)});
  ASSERT_TRUE(mm->Start().ok());
  Use(*mm, "g1");
  Use(*mm, "g2");
  // 250 bytes of host memory: over what the GPU has left (0), within the
  // host's 300. Before pools it evicted both GPU models.
  Use(*mm, "h1");
  EXPECT_TRUE(mm->IsLoaded("g1"));
  EXPECT_TRUE(mm->IsLoaded("g2"));
  EXPECT_EQ(mm->memory_used_bytes(), 200);
  EXPECT_EQ(mm->host_memory_used_bytes(), 250);
  // A second host model evicts the first, not a GPU model used less recently.
  Use(*mm, "h2");
  EXPECT_EQ(StateOf(*mm, "h1"), ModelState::kNotLoaded);
  EXPECT_EQ(Evictions("h1"), 1);
  EXPECT_TRUE(mm->IsLoaded("g1"));
  EXPECT_TRUE(mm->IsLoaded("g2"));
  // And a GPU model evicts the GPU's least recently used, not the host model.
  Use(*mm, "g3");
  EXPECT_EQ(StateOf(*mm, "g1"), ModelState::kNotLoaded);
  EXPECT_TRUE(mm->IsLoaded("g2"));
  EXPECT_TRUE(mm->IsLoaded("h2"));
  EXPECT_EQ(mm->memory_used_bytes(), 200);
  EXPECT_EQ(mm->host_memory_used_bytes(), 250);
  EXPECT_FALSE(mm->FitsWithoutEviction("g1"));
  // A host model larger than the host budget has no room, whatever the GPU has.
  auto big = Make(GpuOptions(0, 100), {Model("h", 150)});
  ASSERT_TRUE(big->Start().ok());
  Result<ModelLease> lease = big->Acquire("h", Far());
  EXPECT_EQ(lease.status().reason(), "no_room_for_model");
  EXPECT_NE(lease.status().message().find("host memory budget"), std::string::npos) << lease.status().message();
}

TEST_F(PoolsTest, MemoryIsFreedInTheLoadsOwnPoolAndTheModelCountInEvictionOrder) {
  // Room for two models in all. g1 is the least recently used, but h2 needs
  // host memory, so h1 goes for it; only the count makes g1 go for h3.
  auto mm = Make(GpuOptions(1000, 150, {}, /*max_models=*/2), {Gpu("g1", 100), Model("h1", 100), Model("h2", 100),
                                                             Model("h3", 40)});
  ASSERT_TRUE(mm->Start().ok());
  Use(*mm, "g1");
  Use(*mm, "h1");
  Use(*mm, "h2");
  EXPECT_EQ(StateOf(*mm, "h1"), ModelState::kNotLoaded);
  EXPECT_TRUE(mm->IsLoaded("g1"));
  EXPECT_TRUE(mm->IsLoaded("h2"));
  // h3 fits the host's memory beside h2 (140 of 150) but not the count: the
  // GPU model, least recently used, goes.
  Use(*mm, "h3");
  EXPECT_EQ(StateOf(*mm, "g1"), ModelState::kNotLoaded);
  EXPECT_TRUE(mm->IsLoaded("h2"));
  EXPECT_TRUE(mm->IsLoaded("h3"));
  EXPECT_EQ(mm->memory_used_bytes(), 0);
  EXPECT_EQ(mm->host_memory_used_bytes(), 140);
}

TEST_F(PoolsTest, PinnedModelsMustFitTheirOwnPool) {
  // Each pool holds its pinned model; together they would exceed either.
  auto fits = Make(GpuOptions(100, 100, {"g", "h"}), {Gpu("g", 100), Model("h", 100)});
  EXPECT_TRUE(fits->Start().ok());
  auto over = Make(GpuOptions(1000, 100, {"h1", "h2"}), {Model("h1", 60), Model("h2", 60)});
  const Status s = over->Start();
  EXPECT_EQ(s.reason(), "pinned_models_exceed_budget") << s.ToString();
}

TEST_F(PoolsTest, AnIdleModelInTheOtherPoolMakesNoRoom) {
  auto mm = Make(GpuOptions(200, 0, {"g1"}), {Gpu("g1", 150), Gpu("g2", 100), Model("h1", 100)});
  ASSERT_TRUE(mm->Start().ok());
  Use(*mm, "h1");
  Result<ModelLease> lease = mm->Acquire("g2", Far());
  EXPECT_EQ(lease.status().reason(), "no_room_for_model");
  EXPECT_NE(lease.status().message().find("every resident model in its memory budget is pinned"), std::string::npos)
      << lease.status().message();
  EXPECT_TRUE(mm->IsLoaded("h1"));
  EXPECT_EQ(Evictions("h1"), 0);
}

TEST(ModelManagerOptions, AHostMemoryBudgetNeedsPools) {
  ModelManagerOptions o;
  o.host_memory_budget_bytes = 100;
  EXPECT_EQ(o.Validate().code(), StatusCode::kInvalidArgument);
  o.in_host_memory = [](const ModelConfig&) { return true; };
  EXPECT_TRUE(o.Validate().ok());
  o.host_memory_budget_bytes = -1;
  EXPECT_EQ(o.Validate().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace shoal
