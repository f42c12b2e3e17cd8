// Byte-level helpers shared by the blob stores: SHA-256 (OpenSSL libcrypto),
// hex and base64url, random ids, RFC 3339 times. Internal to src/blob.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>

namespace shoal::blob_internal {

using Sha256Digest = std::array<uint8_t, 32>;

// Incremental SHA-256. Not thread-safe; one per stream of bytes.
class Sha256 {
 public:
  Sha256();
  ~Sha256();
  Sha256(const Sha256&) = delete;
  Sha256& operator=(const Sha256&) = delete;
  void Update(std::string_view bytes);
  Sha256Digest Final();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

Sha256Digest Sha256Of(std::string_view bytes);

std::string HexEncode(const Sha256Digest& d);
std::optional<Sha256Digest> HexDecodeDigest(std::string_view hex);

// RFC 4648 section 5 alphabet; `pad` adds '=' (the NATS object store pads).
std::string Base64UrlEncode(std::string_view bytes, bool pad);
// Accepts the url and the standard alphabet, padded or not.
std::optional<std::string> Base64Decode(std::string_view text);

// 22 random characters from [0-9A-Za-z] (~131 bits), like a NATS NUID.
// Thread-safe.
std::string RandomId();

// "2026-12-01T00:10:00.123Z" for Unix ms.
std::string FormatRfc3339Ms(int64_t unix_ms);
// Parses RFC 3339 with optional fraction and Z or +hh:mm; nullopt if unreadable.
std::optional<int64_t> ParseRfc3339Ms(std::string_view text);

}  // namespace shoal::blob_internal
