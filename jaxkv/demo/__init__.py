"""A disaggregated prefill/decode demo: a small JAX transformer whose paged KV cache is a
`PagedKVCache`, served by a prefill process and a decode process with different TP sizes,
layouts and block sizes, connected by `jaxkv.transfer`, and checked token for token against a
colocated run. Run it with ``python -m jaxkv.demo`` (or ``jaxkv-demo``).
"""

from jaxkv.demo._attention import attend, check_spec, read_pages, write_tokens
from jaxkv.demo._engines import (
    DemoSettings,
    RequestResult,
    make_prompts,
    run_colocated,
    run_disaggregated,
)
from jaxkv.demo._model import ModelConfig, ModelRunner, init_params, make_mesh
from jaxkv.demo._report import (
    build_report,
    format_report,
    plot_figure,
    ttft_segments,
    write_plot,
)

__all__ = [
    "DemoSettings",
    "ModelConfig",
    "ModelRunner",
    "RequestResult",
    "attend",
    "build_report",
    "check_spec",
    "format_report",
    "init_params",
    "make_mesh",
    "make_prompts",
    "plot_figure",
    "read_pages",
    "run_colocated",
    "run_disaggregated",
    "ttft_segments",
    "write_plot",
    "write_tokens",
]
