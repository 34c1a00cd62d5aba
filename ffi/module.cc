// Python modules jaxkv._ffi_cpu and jaxkv._ffi_cuda: the custom-call handlers as PyCapsules
// for jax.ffi.register_ffi_target. The file is compiled once per platform; defining
// JAXKV_PLATFORM_CUDA selects the CUDA handlers and module name.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "block_ops.h"

#if defined(JAXKV_PLATFORM_CUDA)
#include "block_copy_cuda.h"
#define JAXKV_MODULE_NAME _ffi_cuda
#define JAXKV_HANDLER(op) jaxkv::op##Cuda_Handler
#define JAXKV_PLATFORM_DOC "CUDA"
#else
#include "block_copy_cpu.h"
#define JAXKV_MODULE_NAME _ffi_cpu
#define JAXKV_HANDLER(op) jaxkv::op##Cpu_Handler
#define JAXKV_PLATFORM_DOC "CPU"
#endif

namespace {

namespace py = pybind11;

template <typename Fn>
py::capsule Capsule(Fn* fn) {
  return py::capsule(reinterpret_cast<void*>(fn));
}

#if !defined(JAXKV_PLATFORM_CUDA)
using Int64Array = py::array_t<int64_t, py::array::c_style | py::array::forcecast>;
using Uint64Array = py::array_t<uint64_t, py::array::c_style | py::array::forcecast>;

// Byte-range copies between host memory regions (formatted reads: a producer gathers a
// request's chunks into a send buffer, a consumer scatters them from its receive buffer).
// Every row is checked against its regions' sizes before any byte moves: a row reaching
// outside its region raises and nothing is copied.
std::vector<jaxkv::ByteRow> CheckedRows(const Uint64Array& src_bases,
                                        const Int64Array& src_sizes,
                                        const Uint64Array& dst_bases,
                                        const Int64Array& dst_sizes, const Int64Array& rows) {
  constexpr int kCols = 8;  // src region, src offset, dst region, dst offset, length, count,
                            // src stride, dst stride
  if (rows.ndim() != 2 || rows.shape(1) != kCols) {
    throw std::invalid_argument("copy_rows: rows must be int64 [N, 8]");
  }
  if (src_bases.size() != src_sizes.size() || dst_bases.size() != dst_sizes.size()) {
    throw std::invalid_argument("copy_rows: one size per region base");
  }
  const int64_t n = rows.shape(0);
  const int64_t* r = rows.data();
  const int64_t num_src = src_bases.size(), num_dst = dst_bases.size();
  const uint64_t* sb = src_bases.data();
  const uint64_t* db = dst_bases.data();
  const int64_t* ss = src_sizes.data();
  const int64_t* ds = dst_sizes.data();
  auto inside = [](int64_t offset, int64_t length, int64_t count, int64_t stride,
                   int64_t size) {
    if (offset < 0 || length < 0 || count < 0 || stride < 0 || size < 0) return false;
    if (count == 0 || length == 0) return true;
    // offset + (count - 1) * stride + length <= size, without overflow
    if (count > 1 && stride > (size - length) / (count - 1)) return false;
    const int64_t last = (count - 1) * stride;
    return length <= size && offset <= size - length - last;
  };
  std::vector<jaxkv::ByteRow> copies(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    const int64_t* row = r + i * kCols;
    if (row[0] < 0 || row[0] >= num_src || row[2] < 0 || row[2] >= num_dst ||
        !inside(row[1], row[4], row[5], row[6], ss[row[0]]) ||
        !inside(row[3], row[4], row[5], row[7], ds[row[2]])) {
      throw std::out_of_range("copy_rows: row " + std::to_string(i) +
                              " reaches outside its regions");
    }
    jaxkv::ByteRow& copy = copies[static_cast<size_t>(i)];
    copy.src = reinterpret_cast<const char*>(sb[row[0]]) + row[1];
    copy.dst = reinterpret_cast<char*>(db[row[2]]) + row[3];
    copy.length = row[4];
    copy.count = row[5];
    copy.src_stride = row[6];
    copy.dst_stride = row[7];
    if (copy.count > 1 && copy.src_stride == copy.length && copy.dst_stride == copy.length) {
      copy.length *= copy.count;  // one contiguous range
      copy.count = 1;
    }
  }
  return copies;
}

void CopyRows(const Uint64Array& src_bases, const Int64Array& src_sizes,
              const Uint64Array& dst_bases, const Int64Array& dst_sizes, const Int64Array& rows) {
  const std::vector<jaxkv::ByteRow> copies =
      CheckedRows(src_bases, src_sizes, dst_bases, dst_sizes, rows);
  py::gil_scoped_release release;
  jaxkv::CopyByteRowsCpu(copies.data(), static_cast<int64_t>(copies.size()));
}

// copy_rows on a thread of its own, never taking the GIL: the caller goes on (e.g. reads the
// next chunk) and asks `done()` later, so a thread that holds the GIL (a polling loop) cannot
// delay the copy. The memory must stay valid until the copy is done (`wait`); destroying the
// object waits for it.
class RowCopy {
 public:
  RowCopy(const Uint64Array& src_bases, const Int64Array& src_sizes,
          const Uint64Array& dst_bases, const Int64Array& dst_sizes, const Int64Array& rows)
      : copies_(CheckedRows(src_bases, src_sizes, dst_bases, dst_sizes, rows)) {
    thread_ = std::thread([this] {
      jaxkv::CopyByteRowsCpu(copies_.data(), static_cast<int64_t>(copies_.size()));
      std::lock_guard<std::mutex> lock(mutex_);
      done_ = true;
      finished_.notify_all();
    });
  }
  RowCopy(const RowCopy&) = delete;
  RowCopy& operator=(const RowCopy&) = delete;
  ~RowCopy() {
    if (thread_.joinable()) thread_.join();
  }

  bool done() {
    std::lock_guard<std::mutex> lock(mutex_);
    return done_;
  }

  // Waits up to `timeout_s` seconds; whether the copy is done.
  bool wait(double timeout_s) {
    py::gil_scoped_release release;
    std::unique_lock<std::mutex> lock(mutex_);
    return finished_.wait_for(lock, std::chrono::duration<double>(std::max(timeout_s, 0.0)),
                              [this] { return done_; });
  }

 private:
  std::vector<jaxkv::ByteRow> copies_;
  std::mutex mutex_;
  std::condition_variable finished_;
  bool done_ = false;
  std::thread thread_;
};
#endif

PYBIND11_MODULE(JAXKV_MODULE_NAME, m) {
  m.doc() = "jaxkv " JAXKV_PLATFORM_DOC " custom-call handlers";
  m.def(
      "registrations",
      []() {
        py::dict targets;
        targets["jaxkv_copy_blocks"] = Capsule(JAXKV_HANDLER(CopyBlocks));
        targets["jaxkv_gather_blocks"] = Capsule(JAXKV_HANDLER(GatherBlocks));
        targets["jaxkv_gather_blocks_into"] = Capsule(JAXKV_HANDLER(GatherBlocksInto));
        targets["jaxkv_scatter_blocks"] = Capsule(JAXKV_HANDLER(ScatterBlocks));
        // permute_blocks and merge_blocks share one handler (a permute is a merge of ratio 1);
        // two target names keep the ops apart in HLO and profiles.
        targets["jaxkv_permute_blocks"] = Capsule(JAXKV_HANDLER(RearrangeBlocks));
        targets["jaxkv_merge_blocks"] = Capsule(JAXKV_HANDLER(RearrangeBlocks));
        targets["jaxkv_copy_block_prefix"] = Capsule(JAXKV_HANDLER(CopyBlockPrefix));
        targets["jaxkv_copy_block_prefix_in_place"] =
            Capsule(JAXKV_HANDLER(CopyBlockPrefixInPlace));
        targets["jaxkv_split_blocks"] = Capsule(JAXKV_HANDLER(SplitBlocks));
        targets["jaxkv_concat_blocks"] = Capsule(JAXKV_HANDLER(ConcatBlocks));
        return targets;
      },
      "Maps each custom-call target name to its " JAXKV_PLATFORM_DOC " handler capsule.");
#if !defined(JAXKV_PLATFORM_CUDA)
  m.def("copy_rows", &CopyRows, py::arg("src_bases"), py::arg("src_sizes"),
        py::arg("dst_bases"), py::arg("dst_sizes"), py::arg("rows"),
        "Copies host-memory byte ranges: each int64 row (src region, src offset, dst region, "
        "dst offset, length, count, src stride, dst stride) moves `count` chunks of `length` "
        "bytes. Regions are (base address, size) tables; a row reaching outside its regions "
        "raises IndexError before any byte moves. Releases the GIL while copying.");
  py::class_<RowCopy>(m, "RowCopy",
                      "copy_rows on a thread of its own (never taking the GIL): the rows are "
                      "checked before it starts (IndexError / ValueError as copy_rows); "
                      "done() says whether it finished, wait(timeout_s) waits for it. The "
                      "memory must stay valid until it is done; deleting it waits.")
      .def(py::init<const Uint64Array&, const Int64Array&, const Uint64Array&,
                    const Int64Array&, const Int64Array&>(),
           py::arg("src_bases"), py::arg("src_sizes"), py::arg("dst_bases"),
           py::arg("dst_sizes"), py::arg("rows"))
      .def("done", &RowCopy::done)
      .def("wait", &RowCopy::wait, py::arg("timeout_s"));
#endif
#if defined(JAXKV_PLATFORM_CUDA)
  // The device id checks (validate_ids) record failures on the device instead of failing the
  // custom call (which would need a host synchronisation): read them here.
  m.attr("ID_OUT_OF_RANGE") = jaxkv::kIdOutOfRange;
  m.attr("ID_REPEATED") = jaxkv::kIdRepeated;
  m.attr("ID_SHARED") = jaxkv::kIdShared;
  m.def(
      "take_id_errors",
      [](int device) {
        uint32_t errors = 0;
        const jaxkv::CudaStatus status = jaxkv::TakeIdErrors(device, &errors);
        if (!status.ok()) {
          throw std::runtime_error(std::string("jaxkv CUDA: ") + status.call + " failed: " +
                                   cudaGetErrorString(status.error));
        }
        return errors;
      },
      py::arg("device"),
      "Waits for CUDA device `device` (its local ordinal) and returns, then clears, the id-check "
      "failures recorded there since the last call: an OR of ID_OUT_OF_RANGE, ID_REPEATED and "
      "ID_SHARED, 0 when none. An op whose ids failed its check wrote no cache block.");
#endif
}

}  // namespace
