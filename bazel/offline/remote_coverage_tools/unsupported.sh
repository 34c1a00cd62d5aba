#!/bin/sh
echo "jaxkv: 'bazel coverage' is not supported with the offline stand-in for remote_coverage_tools" >&2
exit 1
