"""Repository rule @jaxkv_python: the Python environment jaxkv builds and tests against.

Nothing is downloaded. The rule finds a Python interpreter, in this order:
  1. $JAXKV_PYTHON (a path, absolute or relative to the workspace root, or a command on PATH);
  2. <workspace root>/.venv/bin/python (the virtual environment the README set-up creates);
  3. python3 on PATH.
It asks that interpreter for the XLA FFI headers, the pybind11 headers
(`pybind11.get_include()`) and the Python headers, symlinks them into the generated repository,
and defines the targets below. The XLA FFI headers are, in this order (as CMakeLists.txt and
scripts/setup.sh): $JAXKV_FFI_INCLUDE_DIR; <venv>/.jaxkv-ffi-headers/jaxlib-<version> (where
scripts/setup.sh keeps the headers of the oldest supported jaxlib, 0.10.2, when the venv's own
jaxlib is newer); the interpreter's jaxlib (`jax.ffi.include_dir()`). Handlers built against
older FFI headers load in newer jaxlib, not the reverse.
  @jaxkv_python//:xla_ffi_headers   cc_library, -isystem (as CMake's SYSTEM)
  @jaxkv_python//:pybind11          cc_library, pybind11 + Python headers
  @jaxkv_python//:python_headers    cc_library
  @jaxkv_python//:py_toolchain      a Python toolchain whose runtime is that interpreter
  @jaxkv_python//:info.bzl          PYTHON, PYTHON_VERSION, JAX(LIB)_VERSION, FFI_API_VERSION,
                                    ENV_FINGERPRINT (of the interpreter and its installed packages)

The interpreter is used by path, never resolved through symlinks: a venv's bin/python is a
symlink, and resolving it would lose the venv's site-packages.
"""

_QUERY = r"""
import hashlib, importlib.util, json, os, sys, sysconfig

def has_ffi(d):
    return os.path.isfile(os.path.join(d, "xla", "ffi", "api", "ffi.h"))

def include_dir_of_jaxlib():
    requested = os.environ.get("JAXKV_FFI_INCLUDE_DIR", "").strip()
    if requested:
        if not has_ffi(requested):
            raise RuntimeError("JAXKV_FFI_INCLUDE_DIR=%s has no xla/ffi/api/ffi.h" % requested)
        return os.path.abspath(requested), "JAXKV_FFI_INCLUDE_DIR"
    pinned = os.path.join(sys.prefix, ".jaxkv-ffi-headers")
    if os.path.isdir(pinned):
        for name in sorted(os.listdir(pinned)):
            if has_ffi(os.path.join(pinned, name)):
                return os.path.join(pinned, name), "venv " + name + " headers (scripts/setup.sh)"
    spec = importlib.util.find_spec("jaxlib")
    if spec is not None and spec.origin:
        d = os.path.join(os.path.dirname(spec.origin), "include")
        if has_ffi(d):
            return d, "the interpreter's jaxlib"
    import jax  # slower: imports jax
    return jax.ffi.include_dir(), "jax.ffi.include_dir()"

def version(dist):
    try:
        from importlib import metadata
        return metadata.version(dist)
    except Exception:
        return "unknown"

out = {"executable": sys.executable, "python_version": "%d.%d.%d" % sys.version_info[:3]}
errors = []
try:
    out["ffi_include"], out["ffi_include_from"] = include_dir_of_jaxlib()
except Exception as e:
    errors.append("jax/jaxlib (XLA FFI headers): %r" % (e,))
try:
    import pybind11
    out["pybind11_include"] = pybind11.get_include()
except Exception as e:
    errors.append("pybind11: %r" % (e,))
out["python_include"] = sysconfig.get_paths()["include"]
out["jaxlib_version"] = version("jaxlib")
out["jax_version"] = version("jax")
try:
    from importlib import metadata
    dists = sorted("%s==%s" % (d.metadata["Name"], d.version) for d in metadata.distributions())
except Exception as e:
    dists = [repr(e)]
out["env_fingerprint"] = hashlib.sha256(
    "\n".join([sys.executable, sys.version] + dists).encode()).hexdigest()[:16]
out["errors"] = errors
print(json.dumps(out))
"""

def _words(line):
    return [w for w in line.replace("\t", " ").split(" ") if w]

def _own_label(target):
    """`target` in this (jaxkv's) repository, as seen from a generated repository."""
    label = Label(target)
    return "@%s//%s:%s" % (label.workspace_name, label.package, label.name)

def _workspace_root(rctx):
    root = getattr(rctx, "workspace_root", None)  # Bazel >= 6
    if root != None:
        return str(root)
    return str(rctx.path(Label("@//:WORKSPACE")).dirname)

def _find_python(rctx):
    """Returns (path string, how it was found)."""
    root = _workspace_root(rctx)
    requested = rctx.os.environ.get("JAXKV_PYTHON", "").strip()
    if requested:
        if "/" not in requested:
            found = rctx.which(requested)
            if found == None:
                fail("JAXKV_PYTHON=%s: no such command on PATH" % requested)
            return str(found), "JAXKV_PYTHON"
        path = requested if requested.startswith("/") else root + "/" + requested
        if not rctx.path(path).exists:
            fail("JAXKV_PYTHON=%s: %s does not exist" % (requested, path))
        return path, "JAXKV_PYTHON"
    venv = root + "/.venv/bin/python"
    if rctx.path(venv).exists:
        return venv, "workspace .venv"
    found = rctx.which("python3")
    if found == None:
        fail("jaxkv: no Python found: set JAXKV_PYTHON, create .venv (see README), " +
             "or put python3 on PATH")
    return str(found), "python3 on PATH"

def _ffi_api_version(rctx, ffi_include):
    c_api = rctx.read(ffi_include + "/xla/ffi/api/c_api.h")
    major = "?"
    minor = "?"
    for line in c_api.splitlines():
        parts = _words(line)
        if len(parts) == 3 and parts[0] == "#define":
            if parts[1] == "XLA_FFI_API_MAJOR":
                major = parts[2]
            elif parts[1] == "XLA_FFI_API_MINOR":
                minor = parts[2]
    return major + "." + minor

_BUILD = """\
# Generated by //bazel:python_configure.bzl from {python} ({how}).
# Python {python_version}, jax {jax_version}, jaxlib {jaxlib_version}.
# XLA FFI API {ffi_api} headers: {ffi_include} ({ffi_include_from}).
load("@bazel_tools//tools/python:toolchain.bzl", "py_runtime_pair")
load("@rules_cc//cc:defs.bzl", "cc_library")
load("{python_bzl}", "py_runtime")

package(default_visibility = ["//visibility:public"])

exports_files(["info.bzl"])

cc_library(
    name = "xla_ffi_headers",
    hdrs = glob(["ffi_include/xla/**/*.h"]),
    includes = ["ffi_include"],
)

cc_library(
    name = "python_headers",
    hdrs = glob(["python_include/**/*.h"]),
    includes = ["python_include"],
)

cc_library(
    name = "pybind11",
    hdrs = glob(["pybind11_include/pybind11/**/*.h"]),
    includes = ["pybind11_include"],
    deps = [":python_headers"],
)

py_runtime(
    name = "py3_runtime",
    interpreter_path = "{python}",
    python_version = "PY3",
)

py_runtime_pair(
    name = "py_runtime_pair",
    py3_runtime = ":py3_runtime",
)

toolchain(
    name = "py_toolchain",
    toolchain = ":py_runtime_pair",
    toolchain_type = "@bazel_tools//tools/python:toolchain_type",
)
"""

_INFO = """\
# Generated by //bazel:python_configure.bzl.
PYTHON = "{python}"
PYTHON_FOUND_BY = "{how}"
PYTHON_VERSION = "{python_version}"
JAX_VERSION = "{jax_version}"
JAXLIB_VERSION = "{jaxlib_version}"
FFI_API_VERSION = "{ffi_api}"
FFI_INCLUDE_DIR = "{ffi_include}"
FFI_INCLUDE_FROM = "{ffi_include_from}"
# Changes when the interpreter or any installed distribution changes. Every py_test depends on
# this file, so cached test results are dropped when the environment changes.
ENV_FINGERPRINT = "{env_fingerprint}"
"""

def _python_configure_impl(rctx):
    python, how = _find_python(rctx)
    env = {}
    ffi_dir = rctx.os.environ.get("JAXKV_FFI_INCLUDE_DIR", "").strip()
    if ffi_dir:
        env["JAXKV_FFI_INCLUDE_DIR"] = (ffi_dir if ffi_dir.startswith("/") else
                                        _workspace_root(rctx) + "/" + ffi_dir)
    result = rctx.execute([python, "-c", _QUERY], environment = env, timeout = 120)
    if result.return_code != 0:
        fail("jaxkv: %s (%s) failed to describe itself:\n%s%s" %
             (python, how, result.stdout, result.stderr))
    info = json.decode(result.stdout.strip().splitlines()[-1])
    if info["errors"]:
        fail("jaxkv: the Python at %s (%s) lacks what the build needs: %s\n" %
             (python, how, "; ".join(info["errors"])) +
             "Install the README's requirements there, or point JAXKV_PYTHON at one that has them.")
    for key in ["ffi_include", "pybind11_include", "python_include"]:
        if not rctx.path(info[key]).exists:
            fail("jaxkv: %s reported by %s does not exist: %s" % (key, python, info[key]))
        rctx.symlink(info[key], key)
    if not rctx.path(info["python_include"] + "/Python.h").exists:
        fail("jaxkv: no Python.h under %s (install the Python development headers)" %
             info["python_include"])

    subst = {
        "{python}": python,
        "{how}": how,
        "{python_version}": info["python_version"],
        "{jax_version}": info["jax_version"],
        "{jaxlib_version}": info["jaxlib_version"],
        "{ffi_api}": _ffi_api_version(rctx, info["ffi_include"]),
        "{env_fingerprint}": info["env_fingerprint"],
        "{python_bzl}": _own_label("//bazel:python.bzl"),
        "{ffi_include}": info["ffi_include"],
        "{ffi_include_from}": info["ffi_include_from"],
    }
    build = _BUILD
    info_bzl = _INFO
    for k, v in subst.items():
        build = build.replace(k, v)
        info_bzl = info_bzl.replace(k, v)
    rctx.file("WORKSPACE", "workspace(name = \"%s\")\n" % rctx.name)
    rctx.file("BUILD", build)
    rctx.file("info.bzl", info_bzl)

python_configure = repository_rule(
    implementation = _python_configure_impl,
    # Re-run when the interpreter choice may change; `local` makes Bazel re-run it after a
    # server restart too (cheap: one Python start-up that imports nothing heavy), so a .venv
    # created or rebuilt after the first build is picked up.
    environ = ["JAXKV_PYTHON", "JAXKV_FFI_INCLUDE_DIR", "PATH"],
    local = True,
)
