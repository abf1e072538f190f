#include "held_buffers.h"

#include <algorithm>

namespace fastckpt {

void HeldBuffers::release(BufferPool& pool, const std::vector<int>& unreaped) noexcept {
  for (int b : held_) {
    if (std::find(unreaped.begin(), unreaped.end(), b) != unreaped.end()) pool.quarantine(b);
    else pool.release(b);
  }
  held_.clear();
  free_.clear();
}

}  // namespace fastckpt
