#include "block_checks.h"

#include <algorithm>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace jaxkv {
namespace {

namespace ffi = xla::ffi;

std::string Str(std::string_view s) { return std::string(s); }

#define JAXKV_CHECKS_RETURN_IF_ERROR(expr)   \
  do {                                       \
    ffi::Error error_ = (expr);              \
    if (error_.failure()) return error_;     \
  } while (0)

// Non-negative ids of a list, sorted, each with its position in the list.
std::vector<std::pair<int32_t, int64_t>> SortedValidIds(const int32_t* ids, int64_t count) {
  std::vector<std::pair<int32_t, int64_t>> sorted;
  sorted.reserve(static_cast<size_t>(count));
  for (int64_t i = 0; i < count; ++i) {
    if (ids[i] >= 0) sorted.emplace_back(ids[i], i);
  }
  std::sort(sorted.begin(), sorted.end());
  return sorted;
}

}  // namespace

int64_t ElementBits(ffi::DataType type) {
  switch (type) {
    case ffi::DataType::S1:
    case ffi::DataType::U1:
      return 1;
    case ffi::DataType::S2:
    case ffi::DataType::U2:
      return 2;
    case ffi::DataType::S4:
    case ffi::DataType::U4:
    case ffi::DataType::F4E2M1FN:
      return 4;
    case ffi::DataType::PRED:
    case ffi::DataType::S8:
    case ffi::DataType::U8:
    case ffi::DataType::F8E5M2:
    case ffi::DataType::F8E4M3:
    case ffi::DataType::F8E4M3FN:
    case ffi::DataType::F8E4M3B11FNUZ:
    case ffi::DataType::F8E5M2FNUZ:
    case ffi::DataType::F8E4M3FNUZ:
    case ffi::DataType::F8E3M4:
    case ffi::DataType::F8E8M0FNU:
      return 8;
    case ffi::DataType::S16:
    case ffi::DataType::U16:
    case ffi::DataType::F16:
    case ffi::DataType::BF16:
      return 16;
    case ffi::DataType::S32:
    case ffi::DataType::U32:
    case ffi::DataType::F32:
      return 32;
    case ffi::DataType::S64:
    case ffi::DataType::U64:
    case ffi::DataType::F64:
    case ffi::DataType::C64:
      return 64;
    case ffi::DataType::C128:
      return 128;
    default:
      return 0;
  }
}

int64_t BufferBytes(const ffi::AnyBuffer& buffer) {
  const int64_t bits = ElementBits(buffer.element_type());
  if (bits >= 8) return static_cast<int64_t>(buffer.element_count()) * (bits / 8);
  const int64_t per_byte = bits > 0 ? 8 / bits : 1;
  const int64_t elements = static_cast<int64_t>(buffer.element_count());
  return elements / per_byte + (elements % per_byte != 0 ? 1 : 0);
}

ffi::ErrorOr<BlockGeometry> BlocksFirstGeometry(const ffi::AnyBuffer& buffer,
                                                std::string_view name) {
  const auto dims = buffer.dimensions();
  if (dims.size() < 1) {
    return ffi::Unexpected(ffi::Error::InvalidArgument(
        Str(name) + " must be blocks-first with shape [num_blocks, *block]; got a scalar"));
  }
  BlockGeometry geometry;
  geometry.element_bits = ElementBits(buffer.element_type());
  if (geometry.element_bits == 0) {
    return ffi::Unexpected(ffi::Error::InvalidArgument(
        Str(name) + " has an element type (XLA FFI type " +
        std::to_string(static_cast<int>(buffer.element_type())) +
        ") the jaxkv handlers do not support"));
  }
  geometry.num_blocks = dims[0];
  int64_t block_elements = 1;
  for (size_t i = 1; i < dims.size(); ++i) block_elements *= dims[i];
  const int64_t block_bits = block_elements * geometry.element_bits;
  if (block_bits % 8 != 0) {
    return ffi::Unexpected(ffi::Error::InvalidArgument(
        Str(name) + ": a block of " + std::to_string(block_elements) + " packed " +
        std::to_string(geometry.element_bits) +
        "-bit elements is not a whole number of bytes; sub-byte element types need blocks of "
        "a multiple of " + std::to_string(8 / geometry.element_bits) + " elements"));
  }
  geometry.block_bytes = block_bits / 8;
  return geometry;
}

ffi::Error CheckSameBlockShape(const ffi::AnyBuffer& a, std::string_view a_name,
                               const ffi::AnyBuffer& b, std::string_view b_name) {
  if (a.element_type() != b.element_type()) {
    return ffi::Error::InvalidArgument(Str(a_name) + " and " + Str(b_name) +
                                       " have different element types");
  }
  const auto a_dims = a.dimensions();
  const auto b_dims = b.dimensions();
  bool same = a_dims.size() == b_dims.size() && a_dims.size() >= 1;
  for (size_t i = 1; same && i < a_dims.size(); ++i) same = a_dims[i] == b_dims[i];
  if (!same) {
    return ffi::Error::InvalidArgument(Str(a_name) + " and " + Str(b_name) +
                                       " have different per-block shapes");
  }
  return ffi::Error::Success();
}

ffi::Error CheckCount(int64_t actual, int64_t expected, std::string_view what) {
  if (actual != expected) {
    return ffi::Error::InvalidArgument(Str(what) + ": expected " + std::to_string(expected) +
                                       ", got " + std::to_string(actual));
  }
  return ffi::Error::Success();
}

ffi::Error CheckIdsInRange(const int32_t* ids, int64_t count, int64_t num_blocks,
                           std::string_view name) {
  for (int64_t i = 0; i < count; ++i) {
    if (ids[i] >= num_blocks) {
      return ffi::Error::InvalidArgument(
          Str(name) + "[" + std::to_string(i) + "] = " + std::to_string(ids[i]) +
          " is out of range for a buffer of " + std::to_string(num_blocks) + " blocks");
    }
  }
  return ffi::Error::Success();
}

ffi::Error CheckIdsUnique(const int32_t* ids, int64_t count, std::string_view name) {
  const auto sorted = SortedValidIds(ids, count);
  for (size_t i = 1; i < sorted.size(); ++i) {
    if (sorted[i].first == sorted[i - 1].first) {
      return ffi::Error::InvalidArgument(
          "duplicate id " + std::to_string(sorted[i].first) + " in " + Str(name) +
          " (positions " + std::to_string(sorted[i - 1].second) + " and " +
          std::to_string(sorted[i].second) + ")");
    }
  }
  return ffi::Error::Success();
}

ffi::Error CheckIdsDisjoint(const int32_t* a, std::string_view a_name, const int32_t* b,
                            std::string_view b_name, int64_t count) {
  const auto sorted_a = SortedValidIds(a, count);
  const auto sorted_b = SortedValidIds(b, count);
  size_t i = 0;
  size_t j = 0;
  while (i < sorted_a.size() && j < sorted_b.size()) {
    if (sorted_a[i].first < sorted_b[j].first) {
      ++i;
    } else if (sorted_b[j].first < sorted_a[i].first) {
      ++j;
    } else {
      return ffi::Error::InvalidArgument(
          "block " + std::to_string(sorted_a[i].first) + " is both in " + Str(a_name) +
          " and in " + Str(b_name) + "; an in-place copy needs disjoint sources and destinations");
    }
  }
  return ffi::Error::Success();
}

ffi::Error CheckLayout(std::string_view layout, int64_t rank, std::string_view name) {
  const std::string message_prefix = Str(name) + " '" + Str(layout) + "'";
  if (static_cast<int64_t>(layout.size()) != rank) {
    return ffi::Error::InvalidArgument(message_prefix + " has " + std::to_string(layout.size()) +
                                       " axes; the blocks have " + std::to_string(rank));
  }
  constexpr std::string_view kLetters = "LKHTD";
  for (size_t i = 0; i < layout.size(); ++i) {
    if (kLetters.find(layout[i]) == std::string_view::npos ||
        layout.find(layout[i]) != i) {
      return ffi::Error::InvalidArgument(message_prefix +
                                         " must use distinct axis letters from LKHTD");
    }
  }
  if (layout.find('T') == std::string_view::npos) {
    return ffi::Error::InvalidArgument(message_prefix + " lacks the token axis 'T'");
  }
  return ffi::Error::Success();
}

ffi::Error CheckLayoutPair(std::string_view src_layout, std::string_view dst_layout,
                           int64_t rank) {
  JAXKV_CHECKS_RETURN_IF_ERROR(CheckLayout(src_layout, rank, "src_layout"));
  JAXKV_CHECKS_RETURN_IF_ERROR(CheckLayout(dst_layout, rank, "dst_layout"));
  for (char letter : src_layout) {
    if (dst_layout.find(letter) == std::string_view::npos) {
      return ffi::Error::InvalidArgument("layouts '" + Str(src_layout) + "' and '" +
                                         Str(dst_layout) + "' have different axes");
    }
  }
  return ffi::Error::Success();
}

ffi::Error CheckBox(const int64_t* dims, const int64_t* starts, const int64_t* sizes,
                    int64_t rank, std::string_view what) {
  for (int64_t i = 0; i < rank; ++i) {
    // Compared as starts <= dims - sizes: starts + sizes may overflow for raw attributes.
    if (sizes[i] < 1 || starts[i] < 0 || starts[i] > dims[i] - sizes[i]) {
      return ffi::Error::InvalidArgument(
          Str(what) + ": axis " + std::to_string(i) + " starts at " + std::to_string(starts[i]) +
          " and spans " + std::to_string(sizes[i]) + " of a block axis of " +
          std::to_string(dims[i]));
    }
  }
  return ffi::Error::Success();
}

ffi::Error CheckBoxesDisjoint(const int64_t* starts, const int64_t* sizes, int64_t count,
                              int64_t rank) {
  for (int64_t a = 0; a < count; ++a) {
    for (int64_t b = a + 1; b < count; ++b) {
      bool overlap = true;
      for (int64_t i = 0; i < rank && overlap; ++i) {
        const int64_t a0 = starts[a * rank + i];
        const int64_t b0 = starts[b * rank + i];
        overlap = a0 < b0 + sizes[b * rank + i] && b0 < a0 + sizes[a * rank + i];
      }
      if (overlap) {
        return ffi::Error::InvalidArgument("buffers " + std::to_string(a) + " and " +
                                           std::to_string(b) +
                                           " cover overlapping parts of a block");
      }
    }
  }
  return ffi::Error::Success();
}

}  // namespace jaxkv
