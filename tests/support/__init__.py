"""Helpers of the jaxkv test suites, one module per concern (none is a test module):

* `platforms`: the devices (several CPU devices, the GPUs JAX sees, CUDA id-check records);
* `bits`: random bit patterns and the one bit-for-bit comparison;
* `numpy_ops`: numpy references of the block ops;
* `meshes`: the one way the tests build meshes;
* `processes`: spawned child processes (their environment, pipes, clean-up);
* `transfer`, `packed`, `reshape`, `offload`, `multicontroller`, `campaign`: the fixtures of
  those suites;
* `scripts`: the stub interpreter of the shell scripts' tests.

`tests/` is on sys.path (pytest: pyproject's `pythonpath`; Bazel: the `test_support` library's
`imports`), so tests import them as `from support import meshes`; spawned children inherit
sys.path and import them the same way.
"""
