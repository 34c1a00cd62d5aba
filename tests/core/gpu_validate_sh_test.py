"""scripts/gpu_validate.sh, the one-run GPU validation: each step runs under the GPU platforms
with its output in the output folder and a summary line, a failing step does not stop the
later ones but fails the script, and STEPS picks steps. Run on a copy of the script in a
scratch tree with a stub interpreter that records what it was asked (nothing runs for real)."""

import os
import shutil
import subprocess

from absl.testing import absltest
from support import scripts

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.realpath(__file__))))


class GpuValidateShTest(absltest.TestCase):
    def setUp(self):
        super().setUp()
        self.root = self.create_tempdir().full_path
        os.makedirs(os.path.join(self.root, "scripts"))
        shutil.copy(os.path.join(_ROOT, "scripts", "gpu_validate.sh"),
                    os.path.join(self.root, "scripts", "gpu_validate.sh"))
        self.python = os.path.join(self.root, "python")
        scripts.write_executable(self.python, scripts.STUB_PYTHON)
        self.runs = os.path.join(self.root, "runs.txt")
        self.out = os.path.join(self.root, "out")

    def _run(self, steps, fail_with=""):
        env = {k: v for k, v in os.environ.items()
               if k not in ("JAX_PLATFORMS", "JAXKV_EXPECT_GPU")}
        env.update(RUNS=self.runs, FAIL_WITH=fail_with, STEPS=steps)
        done = subprocess.run(
            ["bash", os.path.join(self.root, "scripts", "gpu_validate.sh"), self.out,
             self.python], cwd=self.root, env=env, capture_output=True, text=True, timeout=120)
        runs = scripts.read_runs(self.runs)
        with open(os.path.join(self.out, "summary.txt")) as f:
            summary = [line.split()[:2] for line in f]
        return done.returncode, runs, summary

    def test_picked_steps_run_on_the_gpu_platforms_with_their_outputs(self):
        status, runs, summary = self._run("cuda_tests,bench_block_ops")
        self.assertEqual(status, 0)
        self.assertEqual(summary, [["cuda_tests", "rc=0"], ["bench_block_ops", "rc=0"]])
        self.assertEqual([r[:2] for r in runs], [["cuda,cpu", "1"]] * 2)
        self.assertIn("tests/ops/cuda_paths_test.py", runs[0][2])
        self.assertIn("tests/integrations/torch_cuda_test.py", runs[0][2])
        self.assertIn(f"--json_out={self.out}/block_ops_gpu.json", runs[1][2])
        for name in ("cuda_tests", "bench_block_ops"):
            self.assertTrue(os.path.exists(os.path.join(self.out, f"{name}.log")))

    def test_a_failing_step_fails_the_script_after_the_later_steps(self):
        status, runs, summary = self._run("transfer_tests,bench_reshape_ops",
                                          fail_with="gpu_transfer_test")
        self.assertEqual(status, 1)
        self.assertEqual(summary, [["transfer_tests", "rc=3"], ["bench_reshape_ops", "rc=0"]])
        self.assertLen(runs, 2)


if __name__ == "__main__":
    absltest.main()
