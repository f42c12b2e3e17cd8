#include "blob/blob_store.h"

#include <algorithm>
#include <charconv>
#include <cstring>
#include <optional>

#include "blob/internal/codec.h"
#include "blob/local_dir_blob_store.h"
#include "blob/nats_object_store.h"

namespace shoal {

namespace {

bool IsAlnum(char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9'); }

Status BadRef(const std::string& why, std::string_view text) {
  std::string shown(text.substr(0, 200));
  return InvalidArgument("invalid blob reference \"" + shown + "\": " + why, kBlobRefInvalid);
}

Result<uint64_t> ParseUint(std::string_view s) {
  uint64_t v = 0;
  auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (s.empty() || ec != std::errc() || p != s.data() + s.size()) return InvalidArgument("not a number");
  return v;
}

// Splits "a=1&b=2" into its pairs; false on a pair without '='.
bool ParseQuery(std::string_view q, std::vector<std::pair<std::string_view, std::string_view>>& out) {
  while (!q.empty()) {
    size_t amp = q.find('&');
    std::string_view pair = q.substr(0, amp);
    size_t eq = pair.find('=');
    if (eq == std::string_view::npos) return false;
    out.emplace_back(pair.substr(0, eq), pair.substr(eq + 1));
    if (amp == std::string_view::npos) break;
    q.remove_prefix(amp + 1);
  }
  return true;
}

}  // namespace

bool ValidStoreId(std::string_view s) {
  if (s.empty() || s.size() > 255) return false;
  return std::all_of(s.begin(), s.end(), [](char c) { return IsAlnum(c) || c == '_' || c == '-'; });
}

Status ValidateBlobName(std::string_view name) {
  if (name.empty() || name.size() > 255) {
    return InvalidArgument("blob name must have 1 to 255 characters", kBlobRefInvalid);
  }
  if (!IsAlnum(name[0])) {
    return InvalidArgument("blob name must start with a letter or digit", kBlobRefInvalid);
  }
  for (char c : name) {
    if (!IsAlnum(c) && c != '.' && c != '_' && c != '-') {
      return InvalidArgument("blob name may only hold [A-Za-z0-9._-]", kBlobRefInvalid);
    }
  }
  return Status::Ok();
}

std::string BlobRef::Sha256Hex() const { return blob_internal::HexEncode(sha256); }

std::string BlobRef::ToString() const {
  return scheme + "://" + store + "/" + name + "?size=" + std::to_string(size) + "&sha256=" + Sha256Hex();
}

Result<BlobRef> ParseBlobRef(std::string_view text) {
  BlobRef ref;
  size_t sep = text.find("://");
  if (sep == std::string_view::npos) return BadRef("no scheme", text);
  ref.scheme = std::string(text.substr(0, sep));
  if (ref.scheme != "nats-os" && ref.scheme != "file") {
    return BadRef("unknown scheme \"" + ref.scheme + "\" (nats-os or file)", text);
  }
  std::string_view rest = text.substr(sep + 3);
  size_t q = rest.find('?');
  if (q == std::string_view::npos) return BadRef("no size and digest", text);
  std::string_view path = rest.substr(0, q);
  std::string_view query = rest.substr(q + 1);
  size_t slash = path.find('/');
  if (slash == std::string_view::npos) return BadRef("no name", text);
  std::string_view store = path.substr(0, slash);
  std::string_view name = path.substr(slash + 1);
  if (!ValidStoreId(store)) return BadRef("bad store id", text);
  if (Status s = ValidateBlobName(name); !s.ok()) return BadRef(s.message(), text);
  ref.store = std::string(store);
  ref.name = std::string(name);

  std::vector<std::pair<std::string_view, std::string_view>> pairs;
  if (!ParseQuery(query, pairs)) return BadRef("bad query", text);
  bool have_size = false, have_digest = false;
  for (auto& [k, v] : pairs) {
    if (k == "size") {
      auto n = ParseUint(v);
      if (!n.ok()) return BadRef("bad size", text);
      ref.size = *n;
      have_size = true;
    } else if (k == "sha256") {
      auto d = blob_internal::HexDecodeDigest(v);
      if (!d) return BadRef("bad sha256 (64 hex digits)", text);
      ref.sha256 = *d;
      have_digest = true;
    }
    // Unknown keys are ignored: later writers may add hints.
  }
  if (!have_size || !have_digest) return BadRef("size and sha256 are required", text);
  return ref;
}

Result<BlobRef> BlobStore::Put(std::string_view data, const std::string& name, bool fresh_name) {
  size_t offset = 0;
  BlobSource source = [&](char* buf, size_t cap) -> Result<size_t> {
    size_t n = std::min(cap, data.size() - offset);
    std::memcpy(buf, data.data() + offset, n);
    offset += n;
    return n;
  };
  return PutFrom(source, name, fresh_name);
}

Result<std::string> BlobStore::Get(const BlobRef& ref) {
  std::string out;
  // The size comes from a message: reserve, but not without bound.
  out.reserve(static_cast<size_t>(std::min<uint64_t>(ref.size, uint64_t{64} << 20)));
  Status s = GetTo(ref, [&](std::string_view piece) {
    out.append(piece);
    return Status::Ok();
  });
  if (!s.ok()) return s;
  return out;
}

Status BlobStore::CheckRef(const BlobRef& ref) const {
  if (ref.scheme != scheme() || ref.store != store_id()) {
    return InvalidArgument("blob reference " + ref.scheme + "://" + ref.store + "/" + ref.name +
                               " does not belong to this store (" + std::string(scheme()) + "://" +
                               store_id() + ")",
                           kBlobStoreMismatch);
  }
  return ValidateBlobName(ref.name);
}

namespace {

struct Url {
  std::string scheme, host, path;
  std::vector<std::pair<std::string, std::string>> query;
};

Result<Url> SplitUrl(std::string_view url) {
  Url u;
  size_t sep = url.find("://");
  if (sep == std::string_view::npos) return InvalidArgument("blob store URL without scheme: " + std::string(url));
  u.scheme = std::string(url.substr(0, sep));
  std::string_view rest = url.substr(sep + 3);
  size_t q = rest.find('?');
  std::string_view query = q == std::string_view::npos ? std::string_view() : rest.substr(q + 1);
  rest = rest.substr(0, q);
  size_t slash = rest.find('/');
  u.host = std::string(rest.substr(0, slash));
  u.path = slash == std::string_view::npos ? std::string() : std::string(rest.substr(slash));
  std::vector<std::pair<std::string_view, std::string_view>> pairs;
  if (!ParseQuery(query, pairs)) return InvalidArgument("bad query in blob store URL: " + std::string(url));
  for (auto& [k, v] : pairs) u.query.emplace_back(std::string(k), std::string(v));
  return u;
}

// What a store URL asks for, parsed and checked, nothing opened.
struct BlobStoreSpec {
  std::optional<LocalDirBlobStoreOptions> file;
  std::optional<NatsObjectStoreOptions> nats;
};

Result<BlobStoreSpec> ParseBlobStoreUrl(std::string_view url) {
  ASSIGN_OR_RETURN(Url u, SplitUrl(url));
  BlobStoreSpec spec;
  if (u.scheme == "file") {
    if (!u.host.empty() && u.host != "localhost") {
      return InvalidArgument("file blob store URL must be file:///absolute/dir, got " + std::string(url));
    }
    LocalDirBlobStoreOptions& o = spec.file.emplace();
    o.dir = u.path;
    for (auto& [k, v] : u.query) {
      if (k == "id") o.id = v;
      else return InvalidArgument("unknown file blob store option " + k);
    }
    return spec;
  }
  if (u.scheme == "nats" || u.scheme == "nats-os") {
    if (!u.path.empty() && u.path != "/") {
      return InvalidArgument("NATS object store URL is nats://<bucket>, got " + std::string(url));
    }
    NatsObjectStoreOptions& o = spec.nats.emplace();
    if (!u.host.empty()) o.bucket = u.host;
    for (auto& [k, v] : u.query) {
      auto n = ParseUint(v);
      if (!n.ok()) return InvalidArgument("blob store option " + k + " must be a number");
      if (k == "chunk_bytes") o.chunk_bytes = static_cast<int64_t>(*n);
      else if (k == "max_age_ms") o.max_age_ms = static_cast<int64_t>(*n);
      else if (k == "max_bytes") o.max_bytes = static_cast<int64_t>(*n);
      else if (k == "replicas") o.replicas = static_cast<int>(*n);
      else if (k == "direct_reads") o.direct_reads = *n != 0;
      else if (k == "stream_read_min_chunks") o.stream_read_min_chunks = static_cast<int>(*n);
      else return InvalidArgument("unknown NATS blob store option " + k);
    }
    return spec;
  }
  return InvalidArgument("unknown blob store scheme \"" + u.scheme + "\" (file or nats)");
}

}  // namespace

Status CheckBlobStoreUrl(std::string_view url) { return ParseBlobStoreUrl(url).status(); }

Result<std::unique_ptr<BlobStore>> OpenBlobStore(std::string_view url, NatsClient* nats, const Clock* clock) {
  ASSIGN_OR_RETURN(BlobStoreSpec spec, ParseBlobStoreUrl(url));
  if (spec.file) {
    spec.file->clock = clock;
    ASSIGN_OR_RETURN(auto store, LocalDirBlobStore::Create(*spec.file));
    return std::unique_ptr<BlobStore>(std::move(store));
  }
  if (nats == nullptr) return InvalidArgument("the NATS object store needs a NATS connection");
  spec.nats->clock = clock;
  ASSIGN_OR_RETURN(auto store, NatsObjectStore::Open(*nats, *spec.nats));
  return std::unique_ptr<BlobStore>(std::move(store));
}

}  // namespace shoal
