"""A disaggregated prefill/decode demo: a small JAX transformer whose paged KV cache is a
`PagedKVCache`, served by a prefill process and a decode process with different TP sizes,
layouts and block sizes, connected by `jaxkv.transfer`, and checked token for token against a
colocated run (`run_disaggregated`, `run_colocated`, both configured by `DemoSettings`). Run it
with ``python -m jaxkv.demo`` (or ``jaxkv-demo``).
"""

from jaxkv._deprecation import deprecated_getattr as _deprecated_getattr
from jaxkv.demo._engines import DemoSettings, run_colocated, run_disaggregated

__all__ = [
    "DemoSettings",
    "run_colocated",
    "run_disaggregated",
]

# Names that left the public API, kept one release (docs/guide.md, "Deprecated names"):
# each use warns with a DeprecationWarning naming what to use instead.
_DEPRECATED = {
    "ModelConfig": "jaxkv.demo._model",
    "ModelRunner": "jaxkv.demo._model",
    "RequestResult": "jaxkv.demo._engines",
    "attend": "jaxkv.demo._attention",
    "build_report": "jaxkv.demo._report",
    "check_spec": "jaxkv.demo._attention",
    "format_report": "jaxkv.demo._report",
    "init_params": "jaxkv.demo._model",
    "make_mesh": "jaxkv.demo._model",
    "make_prompts": "jaxkv.demo._engines",
    "plot_figure": "jaxkv.demo._report",
    "read_pages": "jaxkv.demo._attention",
    "ttft_segments": "jaxkv.demo._report",
    "write_plot": "jaxkv.demo._report",
    "write_tokens": "jaxkv.demo._attention",
}
__getattr__ = _deprecated_getattr('jaxkv.demo', _DEPRECATED)
