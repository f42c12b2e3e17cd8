#include "blob/local_dir_blob_store.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <vector>

#include "blob/internal/codec.h"
#include "common/clock.h"

namespace shoal {

namespace {

constexpr size_t kIoBytes = 1 << 20;
constexpr char kTempPrefix[] = ".tmp.";

Status Errno(const std::string& what) { return Internal(what + ": " + std::strerror(errno)); }

struct Fd {
  int fd = -1;
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
};

Status WriteAll(int fd, const char* p, size_t n, const std::string& path) {
  while (n > 0) {
    ssize_t w = ::write(fd, p, n);
    if (w < 0) {
      if (errno == EINTR) continue;
      if (errno == ENOSPC || errno == EDQUOT) {
        return ResourceExhausted("blob directory is full writing " + path, kBlobStoreFull);
      }
      return Errno("write " + path);
    }
    p += w;
    n -= static_cast<size_t>(w);
  }
  return Status::Ok();
}

}  // namespace

Status LocalDirBlobStoreOptions::Validate() const {
  if (dir.empty() || dir[0] != '/') return InvalidArgument("blob directory must be an absolute path: \"" + dir + "\"");
  if (!ValidStoreId(id)) return InvalidArgument("local blob store id must be 1 to 255 of [A-Za-z0-9_-]: \"" + id + "\"");
  return Status::Ok();
}

Result<std::unique_ptr<LocalDirBlobStore>> LocalDirBlobStore::Create(const LocalDirBlobStoreOptions& o) {
  RETURN_IF_ERROR(o.Validate());
  std::error_code ec;
  std::filesystem::create_directories(o.dir, ec);
  if (ec) return Internal("create blob directory " + o.dir + ": " + ec.message());
  if (!std::filesystem::is_directory(o.dir, ec)) return InvalidArgument("not a directory: " + o.dir);
  auto store = std::unique_ptr<LocalDirBlobStore>(new LocalDirBlobStore(o));
  store->clock_ = o.clock != nullptr ? o.clock : SystemClock::Get();
  return store;
}

std::string LocalDirBlobStore::PathOf(const std::string& name) const { return options_.dir + "/" + name; }

Result<BlobRef> LocalDirBlobStore::PutFrom(const BlobSource& source, const std::string& name_in, bool /*fresh_name*/) {
  std::string name = name_in.empty() ? blob_internal::RandomId() : name_in;
  RETURN_IF_ERROR(ValidateBlobName(name));
  const std::string final_path = PathOf(name);
  // Not named after the blob: a name of 255 characters (the most a name
  // may have) plus the prefix would be over the file system's NAME_MAX.
  const std::string temp_path = options_.dir + "/" + kTempPrefix + blob_internal::RandomId();
  blob_internal::Sha256 sha;  // before the file: neither may throw once it exists
  std::string buf(kIoBytes, '\0');
  Fd f;
  f.fd = ::open(temp_path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0640);
  if (f.fd < 0) return Errno("create " + temp_path);
  auto fail = [&](Status s) {
    ::unlink(temp_path.c_str());
    return s;
  };
  uint64_t size = 0;
  for (;;) {
    auto n = source(buf.data(), buf.size());
    if (!n.ok()) return fail(n.status());
    if (*n == 0) break;
    std::string_view piece(buf.data(), *n);
    sha.Update(piece);
    size += *n;
    if (Status s = WriteAll(f.fd, piece.data(), piece.size(), temp_path); !s.ok()) return fail(s);
  }
  // The store's clock dates the blob, so Sweep and tests agree on ages.
  const int64_t now_ms = clock_->NowUnixMs();
  struct timespec times[2];
  times[0].tv_sec = times[1].tv_sec = static_cast<time_t>(now_ms / 1000);
  times[0].tv_nsec = times[1].tv_nsec = static_cast<long>((now_ms % 1000) * 1000000);
  if (::futimens(f.fd, times) != 0) return fail(Errno("set mtime " + temp_path));
  // No fsync: blobs live for one request; after a power loss the request
  // fails anyway. rename() still makes the blob appear whole or not at all.
  if (::close(f.fd) != 0) {
    f.fd = -1;
    return fail(Errno("close " + temp_path));
  }
  f.fd = -1;
  if (::rename(temp_path.c_str(), final_path.c_str()) != 0) return fail(Errno("rename to " + final_path));
  BlobRef ref;
  ref.scheme = "file";
  ref.store = options_.id;
  ref.name = name;
  ref.size = size;
  ref.sha256 = sha.Final();
  return ref;
}

namespace {

// Opens blob `name` at `path` for reading: a regular file only. Non-blocking
// open, so a FIFO of that name (not a blob) is refused instead of blocking
// the caller until someone writes to it.
Status OpenBlobFile(const std::string& path, const std::string& name, Fd* f, struct stat* st) {
  f->fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
  if (f->fd < 0) {
    if (errno == ENOENT) return NotFound("blob " + name + " does not exist (deleted or expired)", kBlobNotFound);
    return Errno("open " + path);
  }
  if (::fstat(f->fd, st) != 0) return Errno("stat " + path);
  if (!S_ISREG(st->st_mode)) return NotFound("blob " + name + " is not a regular file", kBlobNotFound);
  return Status::Ok();
}

}  // namespace

Status LocalDirBlobStore::GetTo(const BlobRef& ref, const BlobSink& sink) {
  RETURN_IF_ERROR(CheckRef(ref));
  const std::string path = PathOf(ref.name);
  Fd f;
  struct stat st{};
  RETURN_IF_ERROR(OpenBlobFile(path, ref.name, &f, &st));
  if (static_cast<uint64_t>(st.st_size) != ref.size) {
    return Internal("blob " + ref.name + " holds " + std::to_string(st.st_size) + " bytes, its reference says " +
                        std::to_string(ref.size),
                    kBlobCorrupt);
  }
  blob_internal::Sha256 sha;
  std::string buf(kIoBytes, '\0');
  uint64_t got = 0;
  for (;;) {
    ssize_t n = ::read(f.fd, buf.data(), buf.size());
    if (n < 0) {
      if (errno == EINTR) continue;
      return Errno("read " + path);
    }
    if (n == 0) break;
    got += static_cast<uint64_t>(n);
    if (got > ref.size) break;  // grew while read: caught below
    std::string_view piece(buf.data(), static_cast<size_t>(n));
    sha.Update(piece);
    RETURN_IF_ERROR(sink(piece));
  }
  if (got != ref.size || sha.Final() != ref.sha256) {
    return Internal("blob " + ref.name + " is corrupt: its SHA-256 or size does not match the reference",
                    kBlobCorrupt);
  }
  return Status::Ok();
}

Result<BlobRef> LocalDirBlobStore::Stat(const std::string& name) {
  RETURN_IF_ERROR(ValidateBlobName(name));
  const std::string path = PathOf(name);
  Fd f;
  struct stat st{};
  RETURN_IF_ERROR(OpenBlobFile(path, name, &f, &st));
  blob_internal::Sha256 sha;
  std::string buf(kIoBytes, '\0');
  BlobRef ref;
  for (;;) {
    ssize_t n = ::read(f.fd, buf.data(), buf.size());
    if (n < 0) {
      if (errno == EINTR) continue;
      return Errno("read " + path);
    }
    if (n == 0) break;
    sha.Update(std::string_view(buf.data(), static_cast<size_t>(n)));
    ref.size += static_cast<uint64_t>(n);
  }
  ref.scheme = "file";
  ref.store = options_.id;
  ref.name = name;
  ref.sha256 = sha.Final();
  return ref;
}

Status LocalDirBlobStore::Delete(const std::string& name) {
  RETURN_IF_ERROR(ValidateBlobName(name));
  const std::string path = PathOf(name);
  if (::unlink(path.c_str()) != 0 && errno != ENOENT) return Errno("delete " + path);
  return Status::Ok();
}

Result<size_t> LocalDirBlobStore::Sweep(int64_t older_than_ms) {
  const int64_t cutoff_ms = clock_->NowUnixMs() - older_than_ms;
  DIR* d = ::opendir(options_.dir.c_str());
  if (d == nullptr) return Errno("open blob directory " + options_.dir);
  std::vector<std::string> victims;
  while (struct dirent* e = ::readdir(d)) {
    std::string_view n = e->d_name;
    const bool temp = n.substr(0, std::strlen(kTempPrefix)) == kTempPrefix;
    if (!temp && !ValidateBlobName(n).ok()) continue;  // ".", "..", foreign files
    struct stat st{};
    if (::fstatat(::dirfd(d), e->d_name, &st, AT_SYMLINK_NOFOLLOW) != 0 || !S_ISREG(st.st_mode)) continue;
    const int64_t mtime_ms = int64_t{st.st_mtim.tv_sec} * 1000 + st.st_mtim.tv_nsec / 1000000;
    if (mtime_ms < cutoff_ms) victims.emplace_back(n);
  }
  ::closedir(d);
  size_t removed = 0;
  for (const auto& v : victims) {
    if (::unlink(PathOf(v).c_str()) == 0) ++removed;
  }
  return removed;
}

}  // namespace shoal
