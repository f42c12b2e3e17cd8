#include "gateway/fleet_control.h"

#include <algorithm>
#include <future>
#include <limits>

#include <nlohmann/json.hpp>

#include "common/clock.h"
#include "common/json_text.h"
#include "common/log.h"
#include "wire/work_message.h"

namespace shoal {
namespace {

using nlohmann::json;

bool KnownAction(const std::string& a) { return a == "load" || a == "unload" || a == "pin" || a == "unpin"; }

// Room a worker has left for another model (unlimited: the largest value):
// on a GPU worker, a model whose runtime computes on the host (every
// runtime but TorchScript) takes the host memory budget's room.
int64_t FreeBytes(const WorkerInfo& w, bool host_model) {
  const bool host = host_model && w.device != "cpu";
  const int64_t budget = host ? w.host_memory_budget_bytes : w.memory_budget_bytes;
  if (budget <= 0) return std::numeric_limits<int64_t>::max();
  return budget - (host ? w.host_memory_used_bytes : w.memory_used_bytes);
}

Status QueuedPastDeadline() {
  return DeadlineExceeded("the action waited its whole timeout behind other model actions on this gateway",
                          "deadline_exceeded");
}

int Resident(const WorkerInfo& w) {
  int n = 0;
  for (const auto& [name, m] : w.models) n += m.state == "loaded" || m.state == "loading" ? 1 : 0;
  return n;
}

}  // namespace

Status FleetControlOptions::Validate() const {
  if (threads < 1) return InvalidArgument("fleet control: threads must be >= 1");
  if (load_timeout_ms < 1 || timeout_ms < 1) return InvalidArgument("fleet control: timeouts must be >= 1 ms");
  return Status::Ok();
}

Result<std::unique_ptr<FleetControl>> FleetControl::Create(const FleetControlOptions& options, NatsClient* client,
                                                           SnapshotFn snapshot) {
  RETURN_IF_ERROR(options.Validate());
  auto c = std::unique_ptr<FleetControl>(new FleetControl());
  c->options_ = options;
  c->client_ = client;
  c->snapshot_ = std::move(snapshot);
  for (int i = 0; i < options.threads; ++i) c->threads_.emplace_back([p = c.get()] { p->Loop(); });
  c->expirer_ = std::thread([p = c.get()] { p->ExpireLoop(); });
  return c;
}

FleetControl::~FleetControl() { Stop(); }

void FleetControl::BeginStop() {
  std::deque<Job> left;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stop_) return;
    stop_ = true;
    cancel_ = true;
    left.swap(jobs_);
  }
  cv_.notify_all();
  expire_cv_.notify_all();
  for (Job& j : left) j.done(Unavailable("the gateway is shutting down", "shutting_down"));
}

void FleetControl::Stop() {
  BeginStop();
  for (auto& t : threads_)
    if (t.joinable()) t.join();
  if (expirer_.joinable()) expirer_.join();
}

void FleetControl::Act(const std::string& action, const std::string& model, const std::string& worker,
                       ControlCallback done) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!stop_) {
      const auto timeout =
          std::chrono::milliseconds(action == "load" || action == "pin" ? options_.load_timeout_ms : options_.timeout_ms);
      jobs_.push_back({action, model, worker, std::move(done), std::chrono::steady_clock::now() + timeout});
      cv_.notify_one();
      expire_cv_.notify_one();
      return;
    }
  }
  done(Unavailable("the gateway is shutting down", "shutting_down"));
}

void FleetControl::Loop() {
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    cv_.wait(lock, [this] { return stop_ || !jobs_.empty(); });
    if (stop_) return;
    Job job = std::move(jobs_.front());
    jobs_.pop_front();
    lock.unlock();
    Result<ControlOutcome> outcome = Run(job);
    // Given up part-way: the outcome is not the workers'.
    if (cancel_) outcome = Unavailable("the gateway is shutting down", "shutting_down");
    job.done(std::move(outcome));
    lock.lock();
  }
}

void FleetControl::ExpireLoop() {
  std::unique_lock<std::mutex> lock(mu_);
  while (!stop_) {
    const auto now = std::chrono::steady_clock::now();
    auto next = std::chrono::steady_clock::time_point::max();
    std::vector<Job> expired;
    for (auto it = jobs_.begin(); it != jobs_.end();) {
      if (it->deadline <= now) {
        expired.push_back(std::move(*it));
        it = jobs_.erase(it);
      } else {
        next = std::min(next, it->deadline);
        ++it;
      }
    }
    if (!expired.empty()) {
      lock.unlock();
      for (Job& j : expired) j.done(QueuedPastDeadline());
      lock.lock();
      continue;
    }
    if (next == std::chrono::steady_clock::time_point::max()) {
      expire_cv_.wait(lock);
    } else {
      expire_cv_.wait_until(lock, next);
    }
  }
}

Result<std::vector<FleetControl::Target>> FleetControl::Plan(const FleetSnapshot& snap, const std::string& action,
                                                             const std::string& model, const std::string& worker,
                                                             const std::map<std::string, int>& busy) {
  if (!KnownAction(action)) {
    return NotFound("unknown model action '" + action + "' (load, unload, pin, unpin)", "route_not_found");
  }
  if (snap.models.count(model) == 0) return NotFound("The model '" + model + "' does not exist", "model_not_found");
  // Without NATS the registry is empty: an unload would find nothing to do
  // and say so with 200. (The catalog outlives the connection.)
  if (!snap.nats_connected) {
    return Unavailable("NATS is not reachable from this gateway; the fleet cannot be asked", "queue_unavailable");
  }
  std::vector<const WorkerInfo*> serving;  // live workers with the model in their catalog
  for (const auto& w : snap.workers)
    if (w.models.count(model) != 0) serving.push_back(&w);
  if (!worker.empty()) {
    auto it = std::find_if(serving.begin(), serving.end(), [&](const WorkerInfo* w) { return w->id == worker; });
    if (it == serving.end()) {
      return NotFound("no live worker '" + worker + "' serves model '" + model + "'", "worker_not_found");
    }
    return std::vector<Target>{{worker, action}};
  }
  std::vector<Target> out;
  auto with_state = [&](std::initializer_list<const char*> states) {
    for (const WorkerInfo* w : serving)
      for (const char* s : states)
        if (w->Has(model, s)) out.push_back({w->id, action});
  };
  if (action == "unload") {
    with_state({"loaded", "loading", "failed"});
    return out;
  }
  if (action == "unpin") {
    // Only where it is pinned: a worker runs one action at a time, so an
    // unpin sent to every replica would wait behind their unrelated loads.
    for (const WorkerInfo* w : serving)
      if (w->models.at(model).pinned) out.push_back({w->id, action});
    return out;
  }
  // load / pin: where it is resident already, else on the worker with the most room.
  with_state({"loaded", "loading"});
  if (!out.empty()) return out;
  if (serving.empty()) {
    return Unavailable("no live worker serves model '" + model + "'", "no_worker");
  }
  // Most room first. The registry can be a heartbeat behind, and room is
  // not all a load needs (pinned residents, --max-models): the others are
  // alternatives, in the same order.
  const bool host = snap.models.at(model).runtime != "torchscript";
  const auto under_way = [&busy](const WorkerInfo* w) {
    const auto it = busy.find(w->id);
    return it == busy.end() ? 0 : it->second;
  };
  std::sort(serving.begin(), serving.end(), [&](const WorkerInfo* a, const WorkerInfo* b) {
    if (under_way(a) != under_way(b)) return under_way(a) < under_way(b);
    if (FreeBytes(*a, host) != FreeBytes(*b, host)) return FreeBytes(*a, host) > FreeBytes(*b, host);
    if (Resident(*a) != Resident(*b)) return Resident(*a) < Resident(*b);
    return a->id < b->id;
  });
  for (const WorkerInfo* w : serving) out.push_back({w->id, action, /*alternative=*/true});
  return out;
}

Result<ControlOutcome> FleetControl::Run(const Job& job) {
  auto snap = snapshot_();
  std::map<std::string, int> busy;
  {
    std::lock_guard<std::mutex> lock(mu_);
    busy = busy_;
  }
  ASSIGN_OR_RETURN(const std::vector<Target> plan, Plan(*snap, job.action, job.model, job.worker, busy));
  ControlOutcome out;
  out.model = job.model;
  out.action = job.action;
  const auto left_ms = [&] {
    return std::chrono::duration_cast<std::chrono::milliseconds>(job.deadline - std::chrono::steady_clock::now())
        .count();
  };
  if (left_ms() <= 0) return QueuedPastDeadline();  // taken off the queue just as its time ran out
  auto ask = [&](const Target& t) {
    ControlResult r;
    r.worker = t.worker;
    struct UnderWay {  // counted in busy_ while the worker is asked
      FleetControl* self;
      std::string worker;
      UnderWay(FleetControl* s, std::string w) : self(s), worker(std::move(w)) {
        std::lock_guard<std::mutex> lock(self->mu_);
        ++self->busy_[worker];
      }
      ~UnderWay() {
        std::lock_guard<std::mutex> lock(self->mu_);
        if (--self->busy_[worker] <= 0) self->busy_.erase(worker);
      }
    } under_way(this, t.worker);
    const int64_t timeout = std::max<int64_t>(1, left_ms());
    // The worker does not start an action its caller has stopped waiting for.
    json req = {{"action", t.action}, {"model", job.model}, {"deadline_unix_ms", SystemClock::Get()->NowUnixMs() + timeout}};
    auto reply = client_->Request(wire::ControlSubject(t.worker), DumpJson(req), timeout, cancel_);
    if (!reply.ok()) {
      r.status = reply.status().code() == StatusCode::kUnavailable
                     ? Unavailable("worker '" + t.worker + "' did not answer (gone?)", "worker_unavailable")
                     : reply.status();
    } else {
      try {
        json j = json::parse(*reply);
        if (j.value("ok", false)) {
          r.status_json = DumpJson(j.value("status", json::object()));
        } else {
          const json e = j.value("error", json::object());
          r.status = Status(ParseFailureCode(e.value("kind", "")), e.value("message", "worker error"),
                            e.value("code", ""));
        }
      } catch (const std::exception& ex) {
        r.status = Internal(std::string("unreadable reply from worker '") + t.worker + "': " + ex.what());
      }
    }
    return r;
  };
  if (!plan.empty() && plan.front().alternative) {
    // One at a time, until one has room and answers; only that one is
    // reported.
    for (const Target& t : plan) {
      ControlResult r = ask(t);
      // No room, or a worker that cannot load anything now (gone, stopping,
      // its GPU failed): the next one may.
      const std::string_view why = r.status.reason();
      const bool try_next = why == "no_room_for_model" || why == "worker_unavailable" || why == "shutting_down" ||
                            why == "device_fault";
      const bool last = &t == &plan.back() || left_ms() <= 0 || cancel_;
      if (!try_next || last) {
        out.results.push_back(std::move(r));
        break;
      }
      LOG_INFO("gateway", job.action << " " << job.model << ": worker " << t.worker << " cannot ("
                                     << r.status.ToString() << "); asking the next");
    }
  } else {
    // Every worker at once: a load or pin can take minutes on each, and one
    // after another they would add up (and outlast the caller's timeout).
    std::vector<std::future<ControlResult>> asked;
    for (const Target& t : plan) asked.push_back(std::async(std::launch::async, ask, std::cref(t)));
    for (auto& f : asked) out.results.push_back(f.get());
  }
  (void)snapshot_();  // the next GET /v1/models shows what was done
  return out;
}

}  // namespace shoal
