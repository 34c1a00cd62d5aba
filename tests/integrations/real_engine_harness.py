"""Real serving engines in spawned processes (`jaxkv.demo._real_engines.EngineProcess`) for
the end-to-end tests of tests/integrations/vllmcpu and tests/integrations/tpui (not a test
module)."""

from __future__ import annotations

import tempfile

import numpy as np
from absl.testing import parameterized

from jaxkv.demo._real_engines import EngineProcess as Engine
from jaxkv.demo._real_engines import free_port, write_model

__all__ = ["Engine", "EnginesTestCase", "prompts_of"]


class EnginesTestCase(parameterized.TestCase):
    """Starts the engines of `make_engines` once per class (in parallel), with the model in a
    temporary directory of the class's own; closes them and removes it at the end."""

    engines: list[Engine] = []

    @classmethod
    def make_engines(cls, model_dir: str, port: int) -> list[Engine]:
        """The class's engines (side-channel ports from `port` on); sets attributes to them."""
        raise NotImplementedError

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls._model_tmp = tempfile.TemporaryDirectory(prefix="jaxkv-tiny-llama-")
        cls.model_dir = write_model(cls._model_tmp.name)
        cls.engines = cls.make_engines(cls.model_dir, free_port())
        for engine in cls.engines:  # they build in parallel
            engine.wait_ready()

    @classmethod
    def tearDownClass(cls):
        for engine in cls.engines:
            engine.close()
        cls._model_tmp.cleanup()
        super().tearDownClass()


def prompts_of(lengths, seed=0, vocab=2048):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, size=n).tolist() for n in lengths]
