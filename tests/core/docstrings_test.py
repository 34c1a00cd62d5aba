"""The examples in the docstrings of jaxkv's core modules run and print what they claim."""

from support import platforms

platforms.force_cpu_devices()

import doctest
import importlib

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized

import jaxkv

MODULES = [
    "jaxkv._spec",
    "jaxkv._parallel",
    "jaxkv._sharding",
    "jaxkv._placement",
    "jaxkv._cache",
    "jaxkv.ops._block_ops",
    "jaxkv.ops._ids",
    "jaxkv.ops.reference",
    "jaxkv.ops._reshape_ops",
    "jaxkv.ops._peer_ops",
    "jaxkv.ops._layouts",
]


class DocstringExamplesTest(parameterized.TestCase):
    @parameterized.parameters(*MODULES)
    def test_examples(self, module_name):
        module = importlib.import_module(module_name)
        globs = {"jax": jax, "jnp": jnp, "np": np, "jaxkv": jaxkv,
                 "KVCacheSpec": jaxkv.KVCacheSpec, "PagedKVCache": jaxkv.PagedKVCache,
                 "EngineConfig": jaxkv.EngineConfig}
        result = doctest.testmod(module, extraglobs=globs, optionflags=doctest.ELLIPSIS,
                                 verbose=False)
        self.assertGreater(result.attempted, 0, f"{module_name} has no examples")
        self.assertEqual(result.failed, 0, f"{result.failed} failing examples in {module_name}")


if __name__ == "__main__":
    absltest.main()
