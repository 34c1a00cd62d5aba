"""Checks of the Bazel set-up itself (not of jaxkv's behaviour).

- the interpreter is the one @jaxkv_python configured (not some python3 on PATH);
- `jaxkv` and `jaxkv._ffi_cpu` are imported from the Bazel runfiles, i.e. the Bazel-built
  extension is what the tests exercise, not a copy installed in the environment;
- the module exposes the FFI targets as capsules, and JAX accepts them.
"""

import ast
import os
import sys
import unittest


def _read_info(path):
    info = {}
    with open(path, encoding="utf-8") as f:
        for node in ast.parse(f.read()).body:
            if isinstance(node, ast.Assign):
                info[node.targets[0].id] = ast.literal_eval(node.value)
    return info


INFO_PATH = sys.argv.pop(1) if len(sys.argv) > 1 else None


class BazelSetupTest(unittest.TestCase):

    def setUp(self):
        super().setUp()
        self.assertIsNotNone(INFO_PATH, "expects the path of @jaxkv_python//:info.bzl")
        self.info = _read_info(INFO_PATH)

    def test_interpreter_is_the_configured_one(self):
        configured = self.info["PYTHON"]
        # Compare the venv-level paths: both name the same interpreter *and* environment.
        self.assertEqual(os.path.abspath(sys.executable), os.path.abspath(configured),
                         f"py_test ran under {sys.executable}, not the configured {configured}")
        self.assertEqual("{}.{}.{}".format(*sys.version_info[:3]), self.info["PYTHON_VERSION"])

    def test_package_and_extension_come_from_runfiles(self):
        import jaxkv
        from jaxkv import _ffi_cpu

        runfiles = os.environ.get("RUNFILES_DIR") or os.path.abspath(os.getcwd())
        for module in (jaxkv, _ffi_cpu):
            path = os.path.realpath(module.__file__)
            self.assertNotIn("site-packages", path,
                             f"{module.__name__} imported from an installed copy: {path}")
        self.assertTrue(_ffi_cpu.__file__.endswith(os.path.join("jaxkv", "_ffi_cpu.so")),
                        _ffi_cpu.__file__)
        self.assertTrue(os.path.abspath(_ffi_cpu.__file__).startswith(
            os.path.abspath(runfiles)), (_ffi_cpu.__file__, runfiles))

    def test_registrations(self):
        from jaxkv import _ffi_cpu

        targets = _ffi_cpu.registrations()
        # The set of targets grows with jaxkv; the Bazel build only has to deliver them.
        self.assertTrue(
            {"jaxkv_copy_blocks", "jaxkv_gather_blocks", "jaxkv_scatter_blocks"} <= set(targets),
            sorted(targets))
        import jax

        for name, capsule in targets.items():
            # Registering under a distinct name keeps jaxkv's own registration untouched.
            jax.ffi.register_ffi_target("bazel_setup_test_" + name, capsule, platform="cpu")

    def test_cuda_module_when_built(self):
        import jaxkv

        path = os.path.join(os.path.dirname(jaxkv.__file__), "_ffi_cuda.so")
        if not os.path.exists(path):
            self.skipTest("built without --config=cuda")
        from jaxkv import _ffi_cuda  # loads without a GPU: static cudart, lazy driver

        self.assertEqual(os.path.realpath(_ffi_cuda.__file__), os.path.realpath(path))
        self.assertTrue(
            {"jaxkv_copy_blocks", "jaxkv_gather_blocks", "jaxkv_scatter_blocks"}
            <= set(_ffi_cuda.registrations()))


if __name__ == "__main__":
    unittest.main()
