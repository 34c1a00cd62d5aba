#include "block_copy_cpu.h"

#include <cstdint>
#include <cstring>

#include "block_index.h"

namespace jaxkv {

void CopyBlocksCpu(const BlockCopyRequest& request) {
  const RunMap& map = request.map;
  const int64_t num_runs = map.num_runs();
  for (int64_t pair = 0; pair < request.num_pairs; ++pair) {
    const int64_t dst_block = ResolveBlock(request.dst_side, pair);
    if (dst_block < 0) continue;
    char* dst = request.dst + BlockOffset(request.dst_side, dst_block);
    const int64_t src_block = ResolveBlock(request.src_side, pair);
    if (src_block < 0) {
      if (request.zero_fill_skipped) {
        std::memset(dst, 0, static_cast<size_t>(request.dst_side.block_stride));
      }
      continue;
    }
    const char* src = request.src + BlockOffset(request.src_side, src_block);
    if (map.ndim == 0) {
      std::memcpy(dst, src, static_cast<size_t>(map.run_bytes));
      continue;
    }
    for (int64_t run = 0; run < num_runs; ++run) {
      int64_t src_offset = 0;
      int64_t dst_offset = 0;
      map.RunOffsets(run, &src_offset, &dst_offset);
      std::memcpy(dst + dst_offset, src + src_offset, static_cast<size_t>(map.run_bytes));
    }
  }
}

}  // namespace jaxkv
