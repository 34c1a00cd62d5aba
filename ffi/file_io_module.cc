// Python module jaxkv._file_io: the file tier's native I/O (block_file_io.h) for
// jaxkv/offload/_file.py. Both functions release the GIL while they checksum or read.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cerrno>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "block_file_io.h"

namespace {

namespace py = pybind11;

using RegionList = std::vector<std::pair<int64_t, int64_t>>;

std::vector<jaxkv::MemoryRegion> ToRegions(const RegionList& regions) {
  std::vector<jaxkv::MemoryRegion> out;
  out.reserve(regions.size());
  for (const auto& [address, bytes] : regions) {
    if (bytes < 0 || (bytes > 0 && address == 0)) {
      throw py::value_error("a region must be (address, nbytes) with nbytes >= 0 and a "
                            "non-null address, got (" + std::to_string(address) + ", " +
                            std::to_string(bytes) + ")");
    }
    out.push_back(jaxkv::MemoryRegion{reinterpret_cast<char*>(address), bytes});
  }
  return out;
}

// Four big-endian CRCs: the hex of the bytes reads stripe by stripe.
py::bytes ChecksumBytes(const uint32_t crc[4]) {
  char out[16];
  for (int k = 0; k < 4; ++k) {
    for (int b = 0; b < 4; ++b) out[4 * k + b] = static_cast<char>((crc[k] >> (24 - 8 * b)) & 0xFF);
  }
  return py::bytes(out, sizeof(out));
}

py::bytes Checksum(const RegionList& regions, bool software) {
  const std::vector<jaxkv::MemoryRegion> spans = ToRegions(regions);
  uint32_t crc[4];
  {
    py::gil_scoped_release release;
    jaxkv::StripedCrc32c(spans.data(), static_cast<int64_t>(spans.size()), crc, software);
  }
  return ChecksumBytes(crc);
}

py::list ReadBlocks(const std::vector<int>& fds, const std::vector<py::buffer>& headers,
                    const std::vector<RegionList>& regions, unsigned threads) {
  if (headers.size() != fds.size() || regions.size() != fds.size()) {
    throw py::value_error("read_blocks: fds, headers and regions must have the same length");
  }
  const size_t count = fds.size();
  std::vector<py::buffer_info> header_infos;
  std::vector<std::vector<jaxkv::MemoryRegion>> spans;
  header_infos.reserve(count);
  spans.reserve(count);
  for (size_t i = 0; i < count; ++i) {
    header_infos.push_back(headers[i].request(/*writable=*/true));
    if (header_infos.back().ndim != 1 || header_infos.back().itemsize != 1) {
      throw py::value_error("read_blocks: each header must be a 1-d byte buffer (bytearray)");
    }
    spans.push_back(ToRegions(regions[i]));
  }
  std::vector<jaxkv::BlockFileRead> reads(count);
  for (size_t i = 0; i < count; ++i) {
    reads[i].fd = fds[i];
    reads[i].header = static_cast<char*>(header_infos[i].ptr);
    reads[i].header_bytes = header_infos[i].size;
    reads[i].regions = spans[i].data();
    reads[i].num_regions = static_cast<int64_t>(spans[i].size());
  }
  {
    py::gil_scoped_release release;
    jaxkv::ReadBlockFiles(reads.data(), static_cast<int64_t>(count), threads);
  }
  for (const auto& read : reads) {
    if (read.error != 0) {
      errno = read.error;
      PyErr_SetFromErrno(PyExc_OSError);
      throw py::error_already_set();
    }
  }
  py::list out;
  for (const auto& read : reads) {
    out.append(py::make_tuple(read.bytes_read,
                              read.checksummed ? py::object(ChecksumBytes(read.checksum))
                                               : py::object(py::none())));
  }
  return out;
}

PYBIND11_MODULE(_file_io, m) {
  m.doc() = "jaxkv file tier native I/O: payload checksums and batched block-file reads";
  m.def("checksum", &Checksum, py::arg("regions"), py::arg("software") = false,
        "The 16-byte payload checksum of the memory regions [(address, nbytes), ...]: the\n"
        "CRC-32C of each of four stripes, big-endian. `software` forces the table\n"
        "implementation (same values). Releases the GIL.");
  m.def("read_blocks", &ReadBlocks, py::arg("fds"), py::arg("headers"), py::arg("regions"),
        py::arg("threads") = 1,
        "Reads block files: for each, header buffer then payload regions from offset 0, then\n"
        "the payload checksum. Returns [(bytes read, checksum or None when short), ...].\n"
        "Raises OSError for a failed read (after every block was attempted). Releases the GIL.");
  m.def("stripe_bytes", &jaxkv::StripeBytes, py::arg("total"),
        "The checksum's stripe length for a payload of `total` bytes.");
  m.def("hardware_crc32c", &jaxkv::HardwareCrc32c,
        "Whether checksums use the CPU's CRC-32C instruction on this machine.");
}

}  // namespace
