"""scripts/test.sh, the suite's one entry point, decides how pytest runs: unchanged where no GPU
is found; where nvidia-smi finds one, the GPU test files in their own process with
JAXKV_EXPECT_GPU=1 and the rest under JAX_PLATFORMS=cpu; the whole suite's files on parallel
workers, named files in one process. Run on a copy of the script in a scratch tree whose
setup.sh, python and nvidia-smi are stubs that record what they were asked (so nothing is
built or tested for real)."""

import os
import shutil
import subprocess

from absl.testing import absltest
from support import scripts

# The source tree (realpath: under Bazel this file is a runfiles link into it).
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.realpath(__file__))))
_GPU_FILES = [
    "tests/ops/cuda_test.py", "tests/ops/reshape_cuda_test.py", "tests/ops/cuda_paths_test.py",
    "tests/transfer/gpu_transfer_test.py", "tests/integrations/torch_cuda_test.py"]
_PYTEST = ["-P", "-m", "pytest", "-p", "no:cacheprovider"]
_PARALLEL = ["-n", "2", "--dist", "loadfile"]  # JAXKV_TEST_WORKERS=2, as _run sets it


class TestShTest(absltest.TestCase):
    def setUp(self):
        super().setUp()
        self.root = self.create_tempdir().full_path
        os.makedirs(os.path.join(self.root, "scripts"))
        shutil.copy(os.path.join(_ROOT, "scripts", "test.sh"),
                    os.path.join(self.root, "scripts", "test.sh"))
        self._script("scripts/setup.sh", "#!/usr/bin/env bash\nexit 0\n")
        self._script(".venv/bin/python", scripts.STUB_PYTHON)
        for name in [*_GPU_FILES, "tests/core/spec_test.py"]:
            self._script(name, "")
        self.bin = os.path.join(self.root, "stub-bin")
        os.makedirs(self.bin)
        self.runs = os.path.join(self.root, "runs.txt")

    def _script(self, path, text):
        scripts.write_executable(os.path.join(self.root, path), text)

    def _run(self, *args, gpu, fail_with="", workers="2"):
        if gpu:
            self._script("stub-bin/nvidia-smi",
                         "#!/usr/bin/env bash\necho 'GPU 0: NVIDIA H100 (UUID: GPU-0)'\n")
        # No real nvidia-smi: the system directories' tools, then the stubs.
        path = os.pathsep.join([self.bin] + [d for d in os.environ["PATH"].split(os.pathsep)
                                             if not os.path.exists(os.path.join(d, "nvidia-smi"))])
        env = {k: v for k, v in os.environ.items()
               if k not in ("JAX_PLATFORMS", "JAXKV_EXPECT_GPU")}
        env.update(PATH=path, RUNS=self.runs, FAIL_WITH=fail_with, JAXKV_TEST_WORKERS=workers)
        done = subprocess.run(["bash", os.path.join(self.root, "scripts", "test.sh"), *args],
                              cwd=self.root, env=env, capture_output=True, text=True,
                              timeout=120)
        runs = scripts.read_runs(self.runs)
        os.remove(self.runs)
        return done.returncode, [(p, e, a.split()) for p, e, a in runs]

    def test_without_a_gpu_one_run_as_before(self):
        self.assertEqual(self._run("-q", gpu=False),
                         (0, [("unset", "unset", [*_PYTEST, "tests", *_PARALLEL, "-q"])]))
        self.assertEqual(self._run("tests/core/spec_test.py", "-x", gpu=False),
                         (0, [("unset", "unset", [*_PYTEST, "tests/core/spec_test.py", "-x"])]))

    def test_with_a_gpu_the_gpu_files_run_alone(self):
        ignores = [f"--ignore={f}" for f in _GPU_FILES]
        self.assertEqual(self._run("-m", "not slow", gpu=True), (0, [
            ("cuda,cpu", "1", [*_PYTEST, *_GPU_FILES, "-m", "not", "slow"]),
            ("cpu", "unset", [*_PYTEST, "tests", *_PARALLEL, *ignores, "-m", "not", "slow"]),
        ]))

    def test_with_a_gpu_named_files_go_where_they_belong(self):
        ignores = [f"--ignore={f}" for f in _GPU_FILES]
        status, runs = self._run("tests/ops/cuda_test.py::CudaOpsTest", "tests/core/spec_test.py",
                                 "-q", gpu=True)
        self.assertEqual((status, runs), (0, [
            ("cuda,cpu", "1", [*_PYTEST, "tests/ops/cuda_test.py::CudaOpsTest", "-q"]),
            ("cpu", "unset", [*_PYTEST, "tests/core/spec_test.py", *ignores, "-q"]),
        ]))
        _, runs = self._run("tests/core/spec_test.py", gpu=True)
        self.assertEqual([r[0] for r in runs], ["cpu"])

    def test_the_whole_suite_runs_in_one_process_where_asked(self):
        for args, workers in [((), "1"), (("-n", "3"), "2"), (("-p", "no:xdist"), "2"),
                              (("--pdb",), "2")]:
            self.assertEqual(self._run(*args, gpu=False, workers=workers),
                             (0, [("unset", "unset", [*_PYTEST, "tests", *args])]), args)

    def test_a_failing_gpu_run_fails_the_suite_after_the_cpu_run(self):
        status, runs = self._run(gpu=True, fail_with="cuda_test.py")
        self.assertEqual(status, 3)
        self.assertEqual([r[0] for r in runs], ["cuda,cpu", "cpu"])


if __name__ == "__main__":
    absltest.main()
