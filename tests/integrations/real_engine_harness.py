"""Real serving engines in spawned processes (`jaxkv.demo._real_engines.serve_engine`), for the
end-to-end tests of tests/integrations/vllmcpu and tests/integrations/tpui (not a test
module)."""

from __future__ import annotations

import multiprocessing

import numpy as np

from jaxkv.demo import _real_engines

WAIT_S = 300.0


class Engine:
    """A `vllm.LLM` of `backend` in a spawned process, answering `serve_engine`'s commands."""

    def __init__(self, backend: str, model_dir: str, seed: int, role: str | None,
                 engine_id: str = "", port: int = 0, block_size: int = 32, **settings):
        if role:
            settings = {"engine_id": engine_id, "side_channel": [["127.0.0.1", port]],
                        "read_timeout_s": 20.0, **settings}
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(
            target=_real_engines.serve_engine,
            args=(child, backend, model_dir, seed, role, settings, block_size), daemon=True)
        self.process.start()
        self.build_s = None

    def wait_ready(self) -> float:
        assert self.conn.poll(WAIT_S), "the engine did not start"
        ready = self.conn.recv()
        assert ready[0] == "ready", ready
        self.build_s = ready[1]
        return ready[1]

    def call(self, *command):
        self.conn.send(command)
        assert self.conn.poll(WAIT_S), f"no answer to {command[0]}"
        answer = self.conn.recv()
        if isinstance(answer, tuple) and answer and answer[0] == "error":
            raise RuntimeError(f"engine: {answer[1]}: {answer[2]}")
        return answer

    def close(self) -> None:
        if self.process.is_alive():
            self.conn.send(("exit",))
            self.process.join(30)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)


def start(engines: list[Engine]) -> None:
    """Waits for every engine (they build in parallel)."""
    for engine in engines:
        engine.wait_ready()


def prompts_of(lengths, seed=0, vocab=2048):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, size=n).tolist() for n in lengths]


def free_port_base() -> int:
    """A base port for a test class's side channels (4 consecutive ports)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return min(port, 60000)


def bits(x: np.ndarray) -> np.ndarray:
    x = np.ascontiguousarray(x)
    return x.view(np.uint32) if x.dtype.itemsize == 4 else x.view(np.uint16)
