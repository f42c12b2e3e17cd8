// shoal_blob_tool: drives a Shoal blob store from the command line, for the
// interoperability tests with other NATS clients (tests/js) and for poking at
// a store by hand.
//
//   shoal_blob_tool [--nats URL] --store URL put NAME FILE   prints the ref
//   shoal_blob_tool [--nats URL] --store URL get NAME FILE   by name (Stat + Get)
//   shoal_blob_tool [--nats URL] --store URL getref REF FILE
//   shoal_blob_tool [--nats URL] --store URL delete NAME
//   shoal_blob_tool [--nats URL] --store URL sweep OLDER_THAN_MS
//
// Exit status: 0 done, 2 not found, 3 corrupt, 1 any other error.
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iostream>
#include <string>
#include <vector>

#include "blob/blob_store.h"
#include "queue/nats_client.h"

namespace {

int Fail(const shoal::Status& s) {
  std::cerr << "error: " << s.ToString() << " [" << s.ReasonOrDefault() << "]\n";
  if (s.reason() == shoal::kBlobNotFound) return 2;
  if (s.reason() == shoal::kBlobCorrupt) return 3;
  return 1;
}

int Usage() {
  std::cerr << "usage: shoal_blob_tool [--nats URL] --store URL (put NAME FILE | get NAME FILE | "
               "getref REF FILE | delete NAME | sweep OLDER_THAN_MS)\n";
  return 1;
}

shoal::Status WriteTo(shoal::BlobStore& store, const shoal::BlobRef& ref, const std::string& path) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) return shoal::Internal("cannot write " + path);
  shoal::Status s = store.GetTo(ref, [&](std::string_view piece) {
    out.write(piece.data(), static_cast<std::streamsize>(piece.size()));
    return out ? shoal::Status::Ok() : shoal::Internal("write " + path);
  });
  out.close();
  if (!s.ok()) std::remove(path.c_str());  // unverified bytes must not stay
  return s;
}

}  // namespace

int main(int argc, char** argv) {
  std::string nats_url, store_url;
  std::vector<std::string> args;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--nats" && i + 1 < argc) nats_url = argv[++i];
    else if (a == "--store" && i + 1 < argc) store_url = argv[++i];
    else args.push_back(a);
  }
  if (store_url.empty() || args.empty()) return Usage();

  std::unique_ptr<shoal::NatsClient> client;
  if (!nats_url.empty()) {
    shoal::NatsOptions o;
    o.url = nats_url;
    o.retry_forever = false;
    auto c = shoal::NatsClient::Connect(o);
    if (!c.ok()) return Fail(c.status());
    client = std::move(c).value();
  }
  auto opened = shoal::OpenBlobStore(store_url, client.get());
  if (!opened.ok()) return Fail(opened.status());
  shoal::BlobStore& store = **opened;

  const std::string& cmd = args[0];
  if (cmd == "put" && args.size() == 3) {
    std::ifstream in(args[2], std::ios::binary);
    if (!in) return Fail(shoal::InvalidArgument("cannot read " + args[2]));
    shoal::BlobSource source = [&](char* buf, size_t cap) -> shoal::Result<size_t> {
      in.read(buf, static_cast<std::streamsize>(cap));
      if (in.bad()) return shoal::Internal("read " + args[2]);
      return static_cast<size_t>(in.gcount());
    };
    auto ref = store.PutFrom(source, args[1]);
    if (!ref.ok()) return Fail(ref.status());
    std::cout << ref->ToString() << "\n";
    return 0;
  }
  if (cmd == "get" && args.size() == 3) {
    auto ref = store.Stat(args[1]);
    if (!ref.ok()) return Fail(ref.status());
    if (auto s = WriteTo(store, *ref, args[2]); !s.ok()) return Fail(s);
    std::cout << ref->ToString() << "\n";
    return 0;
  }
  if (cmd == "getref" && args.size() == 3) {
    auto ref = shoal::ParseBlobRef(args[1]);
    if (!ref.ok()) return Fail(ref.status());
    if (auto s = WriteTo(store, *ref, args[2]); !s.ok()) return Fail(s);
    return 0;
  }
  if (cmd == "delete" && args.size() == 2) {
    if (auto s = store.Delete(args[1]); !s.ok()) return Fail(s);
    return 0;
  }
  if (cmd == "sweep" && args.size() == 2) {
    auto n = store.Sweep(std::stoll(args[1]));
    if (!n.ok()) return Fail(n.status());
    std::cout << *n << "\n";
    return 0;
  }
  return Usage();
}
