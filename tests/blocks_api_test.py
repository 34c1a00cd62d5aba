"""The jaxkv.blocks package: no JAX at import, explicit exports, documented public API."""

import doctest
import inspect
import json
import os
import subprocess
import sys

from absl.testing import absltest, parameterized

from jaxkv import blocks

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_MODULES = ("_errors", "_events", "_free_queue", "_hashing", "_manager", "_metrics", "_pool",
            "_sizing")


class ApiTest(parameterized.TestCase):

    def test_import_does_not_load_jax(self):
        code = ("import sys, jaxkv.blocks; "
                "bad = [m for m in sys.modules if m == 'jax' or m.startswith('jax.')]; "
                "assert not bad, bad")
        env = dict(os.environ, PYTHONPATH=_REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
        subprocess.run([sys.executable, "-c", code], env=env, check=True)

    def test_all_is_exact(self):
        public = {name for name in vars(blocks) if not name.startswith("_")}
        public -= {name for name in public if inspect.ismodule(getattr(blocks, name))}
        self.assertEqual(sorted(blocks.__all__), sorted(public))

    def test_public_callables_are_documented(self):
        for name in blocks.__all__:
            value = getattr(blocks, name)
            if not (inspect.isclass(value) or inspect.isfunction(value)):
                continue
            self.assertIn("Example", inspect.getdoc(value) or "", f"{name} lacks an example")
            if inspect.isclass(value):
                for attr, member in vars(value).items():
                    if isinstance(member, (classmethod, staticmethod)):
                        member = member.__func__
                    if attr.startswith("_") or not inspect.isfunction(member):
                        continue
                    self.assertIn("Example", inspect.getdoc(member) or "",
                                  f"{name}.{attr} lacks a docstring example")

    def test_benchmark_smoke(self):
        out = os.path.join(absltest.get_default_test_tmpdir(), "bench_blocks.json")
        script = os.path.join(_REPO, "benchmarks", "bench_blocks.py")
        if not os.path.exists(script):  # e.g. under Bazel, whose runfiles hold only tests/.
            self.skipTest("benchmarks/bench_blocks.py is not available here")
        subprocess.run(
            [sys.executable, script, "--repeats=1", "--batch_blocks=16", "--num_blocks=64",
             "--prompt_tokens=256", f"--json_out={out}"],
            check=True, capture_output=True, text=True,
        )
        with open(out) as handle:
            result = json.load(handle)
        self.assertEqual(
            set(result["checks"]),
            {"allocate", "free", "full_prefix_hit", "sha256_hashing",
             "bookkeeping_32k_sha256_incl_hashing", "bookkeeping_32k_xxh3_incl_hashing",
             "bookkeeping_32k_excl_hashing", "vs_reference", "all_targets_pass"},
        )
        self.assertIn("not installable", result["targets"]["source"])
        self.assertGreater(result["jaxkv"]["pool"]["allocate"]["blocks_per_s"], 0)

    @parameterized.parameters(*_MODULES)
    def test_docstring_examples(self, module_name):
        module = getattr(blocks, module_name)
        result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
        self.assertEqual(result.failed, 0)
        if module_name not in ("_errors",):
            self.assertGreater(result.attempted, 0)


if __name__ == "__main__":
    absltest.main()
