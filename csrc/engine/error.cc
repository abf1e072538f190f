#include "error.h"

#include <cerrno>
#include <cstring>
#include <sstream>

namespace fastckpt {

std::string format_io_message(const std::string& op, const std::string& path, int64_t offset,
                              uint64_t length, int err) {
  std::ostringstream os;
  os << op << ' ' << path;
  if (offset >= 0) os << " off=" << offset;
  if (length > 0) os << " len=" << length;
  os << ": " << std::strerror(err);
  return os.str();
}

IoError::IoError(std::string op, std::string path, int64_t offset, uint64_t length, int err)
    : std::runtime_error(format_io_message(op, path, offset, length, err)),
      op_(std::move(op)),
      path_(std::move(path)),
      offset_(offset),
      length_(length),
      err_(err) {}

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
