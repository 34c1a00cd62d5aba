"""The jaxkv.blocks package: no JAX at import, explicit exports, documented public API."""

import doctest
import inspect
import json
import os
import subprocess
import sys

from absl.testing import absltest, parameterized

from jaxkv import blocks

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
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
        out = os.path.join(self.create_tempdir().full_path, "bench_blocks.json")
        script = os.path.join(_REPO, "benchmarks", "bench_blocks.py")
        if not os.path.exists(script):  # e.g. under Bazel, whose runfiles hold only tests/.
            self.skipTest("benchmarks/bench_blocks.py is not available here")
        # Asserts that the benchmark runs and writes well-formed JSON, never how fast it is:
        # missed targets (likely at these tiny sizes on a busy machine) are reported in the
        # JSON and do not change the exit status.
        process = subprocess.run(
            [sys.executable, script, "--repeats=1", "--batch_blocks=16", "--num_blocks=64",
             "--prompt_tokens=256", "--decode_requests=4", f"--json_out={out}"],
            capture_output=True, text=True, check=False,
        )
        self.assertEqual(process.returncode, 0, process.stderr[-2000:])
        with open(out) as handle:
            result = json.load(handle)
        self.assertEqual(
            set(result["checks"]),
            {"allocate", "free", "full_prefix_hit", "sha256_hashing",
             "bookkeeping_32k_sha256_incl_hashing", "bookkeeping_32k_xxh3_incl_hashing",
             "bookkeeping_32k_excl_hashing", "vs_reference", "decode_alloc_free_1",
             "decode_alloc_free_2", "decode_alloc_free_4", "decode_decode_step",
             "all_targets_pass"},
        )
        for check in result["checks"].values():
            if isinstance(check, dict) and "pass" in check:
                self.assertIsInstance(check["pass"], bool)
        self.assertIsInstance(result["checks"]["all_targets_pass"], bool)
        self.assertIn("not installable", result["targets"]["source"])
        self.assertGreater(result["jaxkv"]["pool"]["allocate"]["blocks_per_s"], 0)
        self.assertGreater(result["decode"]["jaxkv"]["decode_step"]["us"], 0)

    def test_benchmark_fail_on_target_policy(self):
        """--fail_on_target: exit status 1 exactly when the JSON says a target was missed."""
        out = os.path.join(self.create_tempdir().full_path, "bench_blocks_gate.json")
        script = os.path.join(_REPO, "benchmarks", "bench_blocks.py")
        if not os.path.exists(script):
            self.skipTest("benchmarks/bench_blocks.py is not available here")
        process = subprocess.run(
            [sys.executable, script, "--repeats=1", "--batch_blocks=16", "--num_blocks=64",
             "--prompt_tokens=256", "--decode_requests=4", "--fail_on_target",
             f"--json_out={out}"],
            capture_output=True, text=True, check=False,
        )
        with open(out) as handle:
            passed = json.load(handle)["checks"]["all_targets_pass"]
        self.assertEqual(process.returncode, 0 if passed else 1, process.stderr[-2000:])
        if not passed:
            self.assertIn("targets missed", process.stderr)

    @parameterized.parameters(*_MODULES)
    def test_docstring_examples(self, module_name):
        module = getattr(blocks, module_name)
        result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
        self.assertEqual(result.failed, 0)
        if module_name not in ("_errors",):
            self.assertGreater(result.attempted, 0)


if __name__ == "__main__":
    absltest.main()
