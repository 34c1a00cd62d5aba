// Host-side validation shared by the CPU and CUDA handlers. Every check runs before any byte
// is written, so a rejected call leaves every buffer untouched.
#ifndef JAXKV_FFI_BLOCK_CHECKS_H_
#define JAXKV_FFI_BLOCK_CHECKS_H_

#include <cstdint>
#include <string_view>

#include "xla/ffi/api/ffi.h"

namespace jaxkv {

// Bits per element as XLA lays the type out in the buffers it hands a handler: sub-byte types
// (S1/U1, S2/U2, S4/U4, F4E2M1FN) are packed, several elements per byte, so their size is NOT
// ffi::ByteWidth() (which says 1). 0 for types the handlers do not know (TOKEN, INVALID, types
// newer than these headers).
int64_t ElementBits(xla::ffi::DataType type);

// Bytes of the whole buffer as XLA allocates it (packed sub-byte elements, rounded up);
// use instead of AnyBuffer::size_bytes(), which is wrong for packed types.
int64_t BufferBytes(const xla::ffi::AnyBuffer& buffer);

// Number of blocks and bytes per block of a blocks-first buffer `[num_blocks, *block]`.
struct BlockGeometry {
  int64_t num_blocks = 0;
  int64_t block_bytes = 0;
  int64_t element_bits = 0;  // bits per element (less than 8 for packed types)
};

// Geometry of a blocks-first buffer. Fails for rank-0 buffers, element types the handlers do
// not know, and packed sub-byte blocks that are not a whole number of bytes (two blocks would
// then share a byte, and no byte copy could move one alone).
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

// Fails unless `layout` names the `rank` axes of a block: distinct letters from "LKHTD",
// including 'T'.
xla::ffi::Error CheckLayout(std::string_view layout, int64_t rank, std::string_view name);

// CheckLayout for both, and fails unless they hold the same letters (another order).
xla::ffi::Error CheckLayoutPair(std::string_view src_layout, std::string_view dst_layout,
                                int64_t rank);

// Fails unless the box [starts, starts + sizes) lies inside a block of `dims` (all of length
// `rank`, sizes >= 1); `what` names the box in the message.
xla::ffi::Error CheckBox(const int64_t* dims, const int64_t* starts, const int64_t* sizes,
                         int64_t rank, std::string_view what);

// Fails if two of `count` boxes (starts and sizes of `rank` axes each, back to back) overlap.
// Each box must have passed CheckBox (so starts + sizes cannot overflow).
xla::ffi::Error CheckBoxesDisjoint(const int64_t* starts, const int64_t* sizes, int64_t count,
                                   int64_t rank);

}  // namespace jaxkv

#endif  // JAXKV_FFI_BLOCK_CHECKS_H_
