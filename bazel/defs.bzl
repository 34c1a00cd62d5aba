"""Build macros of jaxkv: the FFI extension modules, nvcc compilation, the absltest suites."""

load("@jaxkv_cuda//:defs.bzl", "CUDA_ARCHS", "CUDA_FOUND", "NVCC")
load("@rules_cc//cc:defs.bzl", "cc_binary", "cc_library")
load("//bazel:python.bzl", "py_test")

# As CMakeLists.txt: C++17, -Wall -Wextra -Werror=return-type (PIC comes with the shared link).
JAXKV_COPTS = [
    "-std=c++17",
    "-Wall",
    "-Wextra",
    "-Werror=return-type",
]

# Targets carrying this are skipped unless --config=cuda (--define=jaxkv_cuda=1) is given:
# `bazel build //...` then builds the CPU parts only, even where nvcc exists.
CUDA_ONLY = select({
    "//bazel:cuda_enabled": [],
    "//conditions:default": ["//bazel:cuda_disabled"],
})

def pybind_extension(name, srcs, deps = [], copts = [], local_defines = [], **kwargs):
    """A Python extension module `<name>.so` (as pybind11_add_module: hidden visibility).

    `name` may contain a package path: "jaxkv/_ffi_cpu" gives bazel-bin/jaxkv/_ffi_cpu.so,
    importable as jaxkv._ffi_cpu from the runfiles.
    """
    cc_binary(
        name = name + ".so",
        srcs = srcs,
        copts = JAXKV_COPTS + ["-fvisibility=hidden"] + copts,
        local_defines = local_defines,
        linkshared = True,
        linkstatic = True,
        deps = deps + ["@jaxkv_python//:pybind11"],
        **kwargs
    )

_NO_CUDA_CMD = ("echo 'jaxkv: --config=cuda was given but no CUDA toolkit was found: put nvcc " +
                "on PATH or set JAXKV_CUDA_PATH (or CUDA_PATH) to the toolkit root, then run " +
                "bazel sync --configure (or bazel shutdown).' >&2; exit 1")

def cuda_library(name, srcs, hdrs = [], deps = [], nvcc_flags = [], **kwargs):
    """Compiles .cu files with nvcc (position-independent objects) into a cc_library.

    Links CUDA's static runtime, as CMake's CUDA::cudart_static. Architectures come from
    @jaxkv_cuda (default sm_80 and sm_90, with PTX of each, like CMAKE_CUDA_ARCHITECTURES).
    """
    gencode = []
    for arch in CUDA_ARCHS:
        gencode.append("--generate-code=arch=compute_%s,code=[compute_%s,sm_%s]" % (arch, arch, arch))
    objects = []
    for src in srcs:
        stem = src.rsplit("/", 1)[-1].rsplit(".", 1)[0]
        obj = "_%s_nvcc/%s.pic.o" % (name, stem)
        native.genrule(
            name = "_%s_nvcc_%s" % (name, stem),
            srcs = [src] + hdrs,
            outs = [obj],
            cmd = _NO_CUDA_CMD if not CUDA_FOUND else " ".join([
                NVCC,
                "-std=c++17",
                "-O3",
                "-DNDEBUG",
                "-Xcompiler=-fPIC",
                "-Xcompiler=-fvisibility=hidden",
            ] + gencode + nvcc_flags + [
                "-c",
                "$(location %s)" % src,
                "-o",
                "$@",
            ]),
            message = "nvcc %s" % src,
            target_compatible_with = kwargs.get("target_compatible_with", []),
            tags = kwargs.get("tags", []),
        )
        objects.append(obj)
    cc_library(
        name = name,
        srcs = objects,
        hdrs = hdrs,
        deps = deps + ["@jaxkv_cuda//:cudart_static", "@jaxkv_cuda//:cuda_headers"],
        alwayslink = True,
        **kwargs
    )

def jaxkv_py_tests(srcs, strip_prefix = "tests/", deps = [], data = [], env = {},
                   timeout = "long", **kwargs):
    """One py_test per absltest file: tests/a/b_test.py -> //:a/b_test (tests/foo_test.py ->
    //:foo_test).

    The file is run as a script (its `absltest.main()`), with the @jaxkv_python interpreter.
    Each test also depends on @jaxkv_python//:info.bzl, whose fingerprint of the Python
    environment invalidates cached results when packages change. Timeout "long" (900 s): the
    JAX suites take ~30 s alone but several times that on a busy 2-core machine (one run of
    cache_test took 283 s there, close to the default 300 s). Returns the test names.
    """
    names = []
    for src in srcs:
        name = src[len(strip_prefix):] if src.startswith(strip_prefix) else src
        name = name[:-len(".py")]
        py_test(
            name = name,
            srcs = [src],
            main = src,
            deps = deps,
            data = data + ["@jaxkv_python//:info.bzl"],
            env = env,
            timeout = timeout,
            python_version = "PY3",
            srcs_version = "PY3",
            legacy_create_init = False,
            **kwargs
        )
        names.append(name)
    return names
