// Temporary file names of the Writer, and the removal of those that crashed
// saves left behind.
//
// A save of /dir/NAME writes /dir/.fastckpt-tmp.<key>.<pid>.<host>.<start>.<n>.<r>:
//   key    NAME itself never appears: "x" and NAME's bytes in lowercase hex
//          (NAME of at most kMaxHexName bytes), else "h" and a 16-digit hash
//          of NAME. Tools that find checkpoints by scanning a directory for
//          names (Lightning's "hpc_ckpt_", "last", "epoch=", the Trainer's
//          "checkpoint-", torchtitan's "step-", DeepSpeed's tags) can never
//          mistake a temporary for one of theirs: the name starts with a dot
//          and its only letters beside the mark are hex digits and the host.
//   pid    the writing process's id
//   host   this machine's host name, escaped to [A-Za-z0-9-] with "_xx" hex
//          escapes (a dot becomes "_2e"); longer than 40 characters: its first
//          24, "~" and a 16-digit hash
//   start  the process's start time (clock ticks since boot, /proc/PID/stat
//          field 22; 0 when unknown): with pid, it names one process even after
//          the pid is reused
//   n, r   a per-process counter and a few clock bits (decimal, hex)
// The live writer holds an exclusive flock() on its temporary file from
// creation to rename. Names of the earlier format, /dir/.NAME.fastckpt-tmp.
// <pid>.<host>.<start>.<n>.<r>, are still recognised (their leftovers are
// cleaned by the same rules); none is written any more.
//
// A leftover is removed by the next save of the same target only when all of
// these hold: the name parses exactly as above, its host is this host, its
// process is gone (no such pid, or a pid whose start time differs), it is a
// regular file owned by this user, and its lock is free (no live process, of
// any pid namespace on this machine, holds it). Another host's file is never
// removed (a shared filesystem), nor a file of a live process, nor an
// older-format name without a host.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace fastckpt {

struct TempNameInfo {
  int pid = 0;
  std::string host;     // escaped, as in the name
  uint64_t start = 0;   // 0: unknown
  std::string key;      // temp_key() of the target's name
  std::string target;   // the target's base name; empty where the name holds only its hash
};

// The longest target name spelled out (in hex) in its temporaries' names.
constexpr size_t kMaxHexName = 64;
// The part of a temporary name that stands for the target name `name`.
std::string temp_key(const std::string& name);
// "/dir/.fastckpt-tmp.<key>.<pid>.<host>.<start>.<n>.<r>" for "/dir/NAME".
std::string temp_path_for(const std::string& path);
// Parses a directory entry as a temporary name (either format); false if it is not one.
bool parse_temp_entry(const std::string& entry, TempNameInfo* out);
// Parses a directory entry as a temporary file of `target_name` (a base name).
bool parse_temp_name(const std::string& entry, const std::string& target_name, TempNameInfo* out);
// This machine's host name as it appears in temporary names.
const std::string& temp_host_token();
// Escapes a host name for temporary names (exposed for tests).
std::string escape_host(const std::string& host);
// Start time of process `pid` in clock ticks since boot, 0 when unknown.
uint64_t process_start_time(int pid);
// Whether the process that wrote a temporary file with these fields is
// certainly gone (false when in doubt).
bool temp_writer_gone(const TempNameInfo& info);

// Removes the leftovers of crashed saves of `path` (see above); returns their
// names. Best effort and never throws: a directory that cannot be listed, or a
// file that cannot be checked, is left alone.
std::vector<std::string> remove_leftovers(const std::string& path);
// The same for the temporary files of every target in directory `dir`.
std::vector<std::string> remove_leftovers_in(const std::string& dir);

// Creates a new temporary file for `target` (temp_path_for's name) with
// O_WRONLY|O_CREAT|O_EXCL|O_NOFOLLOW: never opens a file or follows a link that
// someone else put under the name (a taken name: another one, up to 16 tries).
// With *direct, tries O_DIRECT first; a filesystem that creates the file and
// then refuses O_DIRECT (EINVAL) gets that empty file removed and a buffered
// one, *direct = false and *fallback saying why. The file is flock()ed until
// the descriptor is closed (after the rename): remove_leftovers() never takes a
// live save's file. Returns the descriptor; *name is set once the file is ours.
int create_temp_file(const std::string& target, std::string* name, bool* direct, std::string* fallback);

}  // namespace fastckpt
