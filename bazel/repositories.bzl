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

def jaxkv_repositories(offline_stand_ins = "bazel/offline"):
    """Declares @jaxkv_python, @jaxkv_cuda and, for Bazel 4, the offline stand-ins.

    Args:
      offline_stand_ins: directory of the stand-ins, relative to the main workspace root.
        A workspace that uses jaxkv as an external repository (say under third_party/jaxkv)
        passes "third_party/jaxkv/bazel/offline", or None where it declares rules_cc,
        rules_java and remote_coverage_tools itself. Repositories already declared are kept.
    """
    if offline_stand_ins and needs_offline_stand_ins():
        existing = native.existing_rules()
        for name in _OFFLINE_STAND_INS:
            if name not in existing:
                native.local_repository(
                    name = name,
                    path = offline_stand_ins + "/" + name,
                )
    python_configure(name = "jaxkv_python")
    cuda_configure(name = "jaxkv_cuda")
