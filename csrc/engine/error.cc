#include "error.h"

#include <cerrno>
#include <cstring>
#include <sstream>

namespace fastckpt {

std::string format_io_message(const std::string& op, const std::string& path, int64_t offset,
                              uint64_t length, int err, const std::string& target) {
  std::ostringstream os;
  os << op << ' ' << path;
  if (!target.empty()) os << " (saving " << target << ')';
  if (offset >= 0) os << " off=" << offset;
  if (length > 0) os << " len=" << length;
  os << ": " << std::strerror(err);
  return os.str();
}

IoError::IoError(std::string op, std::string path, int64_t offset, uint64_t length, int err, std::string target)
    : std::runtime_error(format_io_message(op, path, offset, length, err, target)),
      op_(std::move(op)),
      path_(std::move(path)),
      target_(std::move(target)),
      offset_(offset),
      length_(length),
      err_(err) {}

IoError IoError::saving(const std::string& target) const {
  if (!target_.empty() || target.empty()) return *this;
  // A message that already names the target ("rename A -> target", or the
  // target itself) keeps its text; the target is still recorded.
  const std::string arrow = " -> " + target;
  const bool named = path_ == target ||
                     (path_.size() >= arrow.size() && path_.compare(path_.size() - arrow.size(), arrow.size(), arrow) == 0);
  IoError e(op_, path_, offset_, length_, err_, named ? std::string() : target);
  e.target_ = target;
  return e;
}

static std::string truncated_message(const std::string& path, uint64_t offset, uint64_t length,
                                     uint64_t file_size) {
  std::ostringstream os;
  os << "read " << path << " off=" << offset << " len=" << length << ": file is truncated ("
     << file_size << " bytes)";
  return os.str();
}

TruncatedError::TruncatedError(const std::string& path, uint64_t offset, uint64_t length,
                               uint64_t file_size)
    : std::runtime_error(truncated_message(path, offset, length, file_size)), path_(path) {}

int64_t check_sys(int64_t ret, const char* op, const std::string& path, int64_t offset,
                  uint64_t length) {
  if (ret >= 0) return ret;
  throw IoError(op, path, offset, length, errno);
}

void throw_io(int err, const char* op, const std::string& path, int64_t offset, uint64_t length) {
  throw IoError(op, path, offset, length, err);
}

}  // namespace fastckpt
