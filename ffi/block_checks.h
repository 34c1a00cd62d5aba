// Host-side validation shared by the CPU and CUDA handlers. Every check runs before any byte
// is written, so a rejected call leaves every buffer untouched.
#ifndef JAXKV_FFI_BLOCK_CHECKS_H_
#define JAXKV_FFI_BLOCK_CHECKS_H_

#include <cstdint>
#include <string_view>

#include "xla/ffi/api/ffi.h"

namespace jaxkv {

// Number of blocks and bytes per block of a blocks-first buffer `[num_blocks, *block]`.
struct BlockGeometry {
  int64_t num_blocks = 0;
  int64_t block_bytes = 0;
};

// Geometry of a blocks-first buffer; fails for rank-0 buffers.
xla::ffi::ErrorOr<BlockGeometry> BlocksFirstGeometry(const xla::ffi::AnyBuffer& buffer,
                                                     std::string_view name);

// Fails unless both buffers have the same element type and the same per-block shape
// (every dimension after the first).
xla::ffi::Error CheckSameBlockShape(const xla::ffi::AnyBuffer& a, std::string_view a_name,
                                    const xla::ffi::AnyBuffer& b, std::string_view b_name);

// Fails unless `actual` equals `expected`; `what` names the quantity in the message.
xla::ffi::Error CheckCount(int64_t actual, int64_t expected, std::string_view what);

// Fails if an id is >= num_blocks. Negative ids are padding and always accepted.
xla::ffi::Error CheckIdsInRange(const int32_t* ids, int64_t count, int64_t num_blocks,
                                std::string_view name);

// Fails if a non-negative id occurs twice.
xla::ffi::Error CheckIdsUnique(const int32_t* ids, int64_t count, std::string_view name);

// Fails if a non-negative id occurs in both lists (an in-place copy would then depend on
// the order in which pairs run).
xla::ffi::Error CheckIdsDisjoint(const int32_t* a, std::string_view a_name, const int32_t* b,
                                 std::string_view b_name, int64_t count);

}  // namespace jaxkv

#endif  // JAXKV_FFI_BLOCK_CHECKS_H_
