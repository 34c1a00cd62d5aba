"""Offline stand-in for @rules_cc//cc:defs.bzl: forwards every rule to Bazel's native one.

Bazel 4.2.3's own @bazel_tools (and the local_config_cc toolchain it generates) load this file;
the real rules_cc of that era is itself a thin wrapper around the same native rules, adding
the tag below (so that --incompatible_load_cc_rules_from_bzl accepts them).
"""

_MIGRATION_TAG = "__CC_RULES_MIGRATION_DO_NOT_USE_WILL_BREAK__"

def _add_tags(attrs):
    attrs["tags"] = list(attrs.get("tags") or []) + [_MIGRATION_TAG]
    return attrs

def cc_binary(**attrs):
    native.cc_binary(**_add_tags(attrs))

def cc_test(**attrs):
    native.cc_test(**_add_tags(attrs))

def cc_library(**attrs):
    native.cc_library(**_add_tags(attrs))

def cc_import(**attrs):
    native.cc_import(**_add_tags(attrs))

def cc_proto_library(**attrs):
    native.cc_proto_library(**_add_tags(attrs))

def fdo_prefetch_hints(**attrs):
    native.fdo_prefetch_hints(**_add_tags(attrs))

def fdo_profile(**attrs):
    native.fdo_profile(**_add_tags(attrs))

def cc_toolchain(**attrs):
    native.cc_toolchain(**_add_tags(attrs))

def cc_toolchain_suite(**attrs):
    native.cc_toolchain_suite(**_add_tags(attrs))

def objc_library(**attrs):
    native.objc_library(**_add_tags(attrs))

def objc_import(**attrs):
    native.objc_import(**_add_tags(attrs))
