"""py_library / py_binary / py_test for jaxkv's BUILD files: the one place the Python rules
come from.

Bazel 4-7 have them built in (native.*) and Bazel 4.2.3 offline has no rules_python to load
them from; where a newer Bazel needs them from @rules_python, only this file changes:
    load("@rules_python//python:defs.bzl", _py_binary = "py_binary", ...)
The tag below is what rules_python's own wrappers add, so builds under
--incompatible_load_python_rules_from_bzl accept these as loaded rules.
"""

_MIGRATION_TAG = "__PYTHON_RULES_MIGRATION_DO_NOT_USE_WILL_BREAK__"

def _add_tags(attrs):
    attrs["tags"] = list(attrs.get("tags") or []) + [_MIGRATION_TAG]
    return attrs

def py_library(**attrs):
    native.py_library(**_add_tags(attrs))

def py_binary(**attrs):
    native.py_binary(**_add_tags(attrs))

def py_test(**attrs):
    native.py_test(**_add_tags(attrs))

def py_runtime(**attrs):
    native.py_runtime(**_add_tags(attrs))
