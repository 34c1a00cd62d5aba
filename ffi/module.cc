// Python modules jaxkv._ffi_cpu and jaxkv._ffi_cuda: the custom-call handlers as PyCapsules
// for jax.ffi.register_ffi_target. The file is compiled once per platform; defining
// JAXKV_PLATFORM_CUDA selects the CUDA handlers and module name.
#include <pybind11/pybind11.h>

#include "block_ops.h"

#if defined(JAXKV_PLATFORM_CUDA)
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
}

}  // namespace
