// Errors raised by the engine. Every failing syscall is reported through
// fastckpt::check_sys / fastckpt::throw_io, so the message always names the
// operation, the path, the file offset, the length and the errno.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>

namespace fastckpt {

// A failed system call (or an io_uring completion carrying -errno).
class IoError : public std::runtime_error {
 public:
  // `target`, if not empty, is the user's file that was being saved when the
  // call on `path` (e.g. its temporary file) failed: the message then reads
  // "pwrite /ckpt/.a.pt.fastckpt-tmp.... (saving /ckpt/a.pt) off=0 len=4096: ...".
  IoError(std::string op, std::string path, int64_t offset, uint64_t length, int err, std::string target = "");

  const std::string& op() const { return op_; }
  const std::string& path() const { return path_; }
  int64_t offset() const { return offset_; }
  uint64_t length() const { return length_; }
  int err() const { return err_; }
  // The user's file being saved, or "" (then path() is the user's file).
  const std::string& target() const { return target_; }
  // The same error, saying that it happened while saving `target`.
  IoError saving(const std::string& target) const;

 private:
  std::string op_;
  std::string path_;
  std::string target_;
  int64_t offset_;
  uint64_t length_;
  int err_;
};

// The file is shorter than what the caller asked to read: not an OS failure
// but a property of the file (a truncated checkpoint). Python maps it to
// fastckpt.FormatError.
class TruncatedError : public std::runtime_error {
 public:
  TruncatedError(const std::string& path, uint64_t offset, uint64_t length, uint64_t file_size);
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

// A caller error (bad argument, misuse of an object). Python maps it to ValueError.
class UsageError : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

// The one checker: returns `ret` when it is >= 0, otherwise throws IoError
// built from errno. Use offset -1 / length 0 where they do not apply.
int64_t check_sys(int64_t ret, const char* op, const std::string& path, int64_t offset = -1,
                  uint64_t length = 0);

// Throws IoError for an explicit errno (positive). io_uring results are
// converted from -errno to errno exactly once, at the call of this function.
[[noreturn]] void throw_io(int err, const char* op, const std::string& path, int64_t offset = -1,
                           uint64_t length = 0);

std::string format_io_message(const std::string& op, const std::string& path, int64_t offset,
                              uint64_t length, int err, const std::string& target = "");

}  // namespace fastckpt
