"""External repositories of jaxkv. Everything is local: the build never downloads anything.

Call jaxkv_repositories() from WORKSPACE, then register_toolchains("@jaxkv_python//:py_toolchain").
"""

load("//bazel:cuda_configure.bzl", "cuda_configure")
load("//bazel:python_configure.bzl", "python_configure")

# Repositories that Bazel's own WORKSPACE suffix fetches from the network. Official Bazel
# binaries embed copies of them (so they build offline); Debian's bazel-bootstrap (4.2.3)
# does not, so there they are replaced by the small stand-ins under bazel/offline/.
_OFFLINE_STAND_INS = ["rules_cc", "rules_java", "remote_coverage_tools"]

def _bazel_major():
    """Major version of the running Bazel, or 0 for builds that report none (Debian's)."""
    version = getattr(native, "bazel_version", "") or ""
    head = version.split(".")[0]
    if not head.isdigit():
        return 0
    return int(head)

def needs_offline_stand_ins():
    # Bazel 5 and later changed what @bazel_tools expects of rules_cc / rules_java; there the
    # built-in (embedded) repositories must be used, so the stand-ins are for Bazel 4 only.
    return _bazel_major() < 5

def jaxkv_repositories(name_prefix = "jaxkv"):
    """Declares @jaxkv_python, @jaxkv_cuda and, for Bazel 4, the offline stand-ins.

    Args:
      name_prefix: prefix of the generated repositories' names ("jaxkv" -> @jaxkv_python).
    """
    if needs_offline_stand_ins():
        existing = native.existing_rules()
        for name in _OFFLINE_STAND_INS:
            if name not in existing:
                native.local_repository(
                    name = name,
                    path = _here() + "/offline/" + name,
                )
    python_configure(name = name_prefix + "_python")
    cuda_configure(name = name_prefix + "_cuda")

def _here():
    # local_repository paths are relative to the main workspace root. When jaxkv is itself an
    # external repository of another workspace, the caller declares these repositories itself.
    return "bazel"
