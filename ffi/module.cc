// Python modules jaxkv._ffi_cpu and jaxkv._ffi_cuda: the custom-call handlers as PyCapsules
// for jax.ffi.register_ffi_target. The file is compiled once per platform; defining
// JAXKV_PLATFORM_CUDA selects the CUDA handlers and module name.
#include <pybind11/pybind11.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "block_ops.h"

#if defined(JAXKV_PLATFORM_CUDA)
#include "block_copy_cuda.h"
#define JAXKV_MODULE_NAME _ffi_cuda
#define JAXKV_HANDLER(op) jaxkv::op##Cuda_Handler
#define JAXKV_PLATFORM_DOC "CUDA"
#else
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
