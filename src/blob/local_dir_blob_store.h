// LocalDirBlobStore: blobs as files in one local directory, the store of the
// embedded single-machine setup. Writes go to a hidden temp file that is
// renamed into place, so a reader never sees half a blob; names cannot leave
// the directory; Sweep goes by file mtime (set from the store's clock).
#pragma once

#include <memory>
#include <string>

#include "blob/blob_store.h"

namespace shoal {

struct LocalDirBlobStoreOptions {
  std::string dir;            // created if missing (parents too)
  std::string id = "local";   // the store part of refs: file://<id>/<name>
  const Clock* clock = nullptr;  // null: the system clock
  Status Validate() const;
};

class LocalDirBlobStore final : public BlobStore {
 public:
  static Result<std::unique_ptr<LocalDirBlobStore>> Create(const LocalDirBlobStoreOptions& options);

  std::string_view scheme() const override { return "file"; }
  const std::string& store_id() const override { return options_.id; }
  Result<BlobRef> PutFrom(const BlobSource& source, const std::string& name = {}, bool fresh_name = false) override;
  Status GetTo(const BlobRef& ref, const BlobSink& sink) override;
  Result<BlobRef> Stat(const std::string& name) override;
  Status Delete(const std::string& name) override;
  Result<size_t> Sweep(int64_t older_than_ms) override;

  // The file that holds `name` (for tests and operators).
  std::string PathOf(const std::string& name) const;

 private:
  explicit LocalDirBlobStore(LocalDirBlobStoreOptions options) : options_(std::move(options)) {}
  LocalDirBlobStoreOptions options_;
  const Clock* clock_ = nullptr;
};

}  // namespace shoal
