r"""`python -m jaxkv.demo` / `jaxkv-demo`: a disaggregated prefill/decode run of a small JAX
transformer over jaxkv's paged caches and transfer layer, checked against a colocated run.

Example:
  jaxkv-demo --prefill_tp=2 --decode_tp=1 --prefill_layout=KHTD --decode_layout=THD \
      --json_out=report.json
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import sys

from absl import app, flags

from jaxkv._cliutil import (
    Progress,
    check_compiled_modules,
    quiet_startup_logging,
    show_module_flags_in_help,
)

FLAGS = flags.FLAGS

flags.DEFINE_integer("prefill_tp", 2, "Tensor-parallel size of the prefill engine.")
flags.DEFINE_integer("decode_tp", 1, "Tensor-parallel size of the decode engine.")
flags.DEFINE_integer(
    "prefill_processes", 1,
    "Processes of the prefill engine: one JAX program over them (jax.distributed, gloo on "
    "CPU), prefill_tp / prefill_processes devices each, its scheduler in process 0.",
)
flags.DEFINE_string("prefill_layout", "KHTD", "Cache layout of the prefill engine.")
flags.DEFINE_string("decode_layout", "THD", "Cache layout of the decode engine.")
flags.DEFINE_integer("prefill_block_size", 8, "Tokens per block, prefill engine.")
flags.DEFINE_integer(
    "decode_block_size", 16, "Tokens per block, decode engine (a multiple of the prefill's)."
)
flags.DEFINE_integer("num_requests", 8, "Requests (prompts) to serve.")
flags.DEFINE_integer("prompt_len", 96, "Tokens per prompt.")
flags.DEFINE_integer("max_new_tokens", 16, "Greedy tokens per request (the first from prefill).")
flags.DEFINE_integer(
    "shared_prefix_len", 64, "Tokens every prompt shares at its start (prefix-cache hits)."
)
flags.DEFINE_string("dtype", "bfloat16", "KV cache element type.")
flags.DEFINE_integer("decode_batch", 8, "Decode batch slots.")
flags.DEFINE_integer("num_layers", 4, "Transformer layers.")
flags.DEFINE_integer("d_model", 256, "Residual width.")
flags.DEFINE_integer("num_heads", 8, "Query heads.")
flags.DEFINE_integer("num_kv_heads", 4, "KV heads (TP sizes must divide it).")
flags.DEFINE_integer("head_dim", 32, "Elements per head.")
flags.DEFINE_integer("vocab_size", 512, "Vocabulary size.")
flags.DEFINE_integer("seed", 0, "Seed of the weights and prompts.")
flags.DEFINE_enum(
    "backend", "cpu", ["cpu", "auto"],
    "cpu: host devices (one per TP rank); auto: GPUs when JAX sees them.",
)
flags.DEFINE_float(
    "request_interval_s", 0.0, "Seconds between request arrivals (0: all arrive at once)."
)
flags.DEFINE_integer(
    "kill_prefill_after", 0,
    "Fault injection: kill the prefill process (SIGKILL; every one of them with "
    "--prefill_processes > 1) once this many transfers finished; 0 = off.",
)
flags.DEFINE_float("read_timeout_s", 20.0, "Deadline of one request's read and confirmation.")
flags.DEFINE_float(
    "poll_interval_ms", 2.0,
    "Sleep between two polls of a transfer engine while a process waits for a step, a "
    "message or a read (shorter answers sooner; each poll costs CPU the steps share).",
)
flags.DEFINE_bool(
    "warm_up_reads", True,
    "Before the timed requests, serve throwaway requests through both engines, one per "
    "transfer mode (whole, layer-wise), again with a prefix hit when prompts share one, so "
    "that compiling the formatting programs is not counted in the first requests' TTFT (the "
    "demo's own decode loop).",
)
flags.DEFINE_bool(
    "pin_cpus", False,
    "Run the prefill process on the first half of the CPUs and the decode process on the "
    "rest, as on two machines (one prefill process).",
)
flags.DEFINE_bool(
    "poll_during_steps", True,
    "Dispatch each model step asynchronously and poll the transfer engine until it is done "
    "(off: steps block and transfers progress only between them).",
)
flags.DEFINE_bool(
    "nixl_progress_thread", False,
    "Create the NIXL agents with a progress thread (off: the engines poll; faster on small "
    "CPU machines).",
)
flags.DEFINE_float("timeout_s", 300.0,
                   "Deadline of the serving phase, counted from the last request's arrival "
                   "(--request_interval_s spreads the arrivals); the requests still pending "
                   "then fail.")
flags.DEFINE_enum(
    "serve_with", "jaxkv", ["jaxkv", "vllm-scheduler", "vllm-cpu", "tpu-inference"],
    "jaxkv: the demo's own loop over jaxkv's block manager; vllm-scheduler: vLLM's Scheduler "
    "on both sides with jaxkv's vLLM KV connector (needs vLLM installed); vllm-cpu / "
    "tpu-inference: real engines of vLLM's CPU build / tpu-inference on JAX CPU serving a "
    "tiny Llama (prefill + decode with jaxkv's connector, against a single instance; the "
    "environments of scripts/setup_vllm_cpu.sh / scripts/setup_tpu_inference.sh).",
)
flags.DEFINE_enum(
    "transport", "nixl", ["nixl", "jax"],
    "What moves the KV: NIXL, or JAX's transfer server (jax.experimental.transfer); also "
    "the connector's transport with --serve_with=tpu-inference.",
)
flags.DEFINE_bool(
    "layerwise", False,
    "Layer-pipelined transfer: the prefill step announces each layer from inside as soon as "
    "it is written; the decode process reads it while the later layers compute "
    "(--serve_with=jaxkv, one prefill process).",
)
flags.DEFINE_bool(
    "layerwise_ab", False,
    "One request of each pair layer-pipelined and the other whole, in ABBA order (req-1, "
    "req-2, req-5, req-6, ... layer-pipelined), in one run: TTFT with and without layer "
    "pipelining under the same processes and load, "
    "reported per mode (--serve_with=jaxkv, one prefill process).",
)
flags.DEFINE_bool(
    "host_staging", False,
    "NIXL reads through host mirrors of both caches (host_staging=True: the NIXL path of "
    "caches NIXL cannot register, e.g. TPU HBM); --transport=nixl.",
)
flags.DEFINE_string("json_out", None, "Write the report as JSON to this path.")
flags.DEFINE_string(
    "auth_key_file", None,
    "File holding the deployment key both engines prove on their side channels and control "
    "connections (default: JAXKV_AUTH_KEY_FILE / JAXKV_AUTH_KEY, else none).",
)
flags.DEFINE_string(
    "plot_out", None,
    "Write a PNG of each request's TTFT split and of the transfer engine's read times (needs "
    "matplotlib: the demo extra).",
)
flags.DEFINE_bool(
    "progress", True,
    "Show progress on stderr: a bar on a terminal, a plain line per change when piped.",
)


def _set_devices(count: int, backend: str) -> None:
    """Host devices for this process; must run before JAX starts its backend."""
    xla = os.environ.get("XLA_FLAGS", "")
    xla = " ".join(f for f in xla.split() if "xla_force_host_platform_device_count" not in f)
    os.environ["XLA_FLAGS"] = f"{xla} --xla_force_host_platform_device_count={count}".strip()
    from jaxkv.demo._engines import ucx_transports

    os.environ.setdefault("UCX_TLS", ucx_transports(backend))
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    if backend == "cpu":
        os.environ["JAX_PLATFORMS"] = "cpu"  # for the prefill process
        import jax

        # This process imported JAX already (reading JAX_PLATFORMS then); no backend has
        # started yet, so the setting still applies and no other platform is probed.
        jax.config.update("jax_platforms", "cpu")


def _processes(count: int) -> str:
    return "process" if count == 1 else f"engine of {count} processes"


def _progress(total: int, enabled: bool):
    """The `run_disaggregated` progress callback: a bar on a terminal, plain lines when
    stderr is piped."""
    show = Progress(total, enabled=enabled)

    def update(results) -> None:
        done = sum(r.status == "done" for r in results)
        failed = sum(r.status == "failed" for r in results)
        first = sum(r.ttft_s > 0 for r in results)
        show(done + failed, f"{done + failed}/{total} requests ({first} first tokens, "
                            f"{failed} failed)")

    return update


def _serve_real_engines() -> int:
    """--serve_with=vllm-cpu / tpu-inference: real engines, P/D against a single instance."""
    backend = FLAGS.serve_with
    package = "vllm-cpu" if backend == "vllm-cpu" else "tpu-inference"
    try:
        importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        script = "setup_vllm_cpu.sh" if backend == "vllm-cpu" else "setup_tpu_inference.sh"
        print(f"jaxkv demo: --serve_with={backend} needs {package} installed (the environment "
              f"scripts/{script} builds has it)", file=sys.stderr)
        return 2
    from jaxkv.demo._real_engines import BLOCK_SIZE, format_real_report, run_real_engines

    blocks = ((BLOCK_SIZE, BLOCK_SIZE) if backend == "vllm-cpu"
              else (FLAGS.prefill_block_size, FLAGS.decode_block_size))
    print(f"jaxkv demo: {backend} engines (prefill, decode and a single instance, each a "
          "vllm.LLM process) serving a tiny Llama; building them takes ~1 min", flush=True)
    report = run_real_engines(
        backend, num_requests=FLAGS.num_requests, prompt_len=FLAGS.prompt_len,
        shared_prefix_len=FLAGS.shared_prefix_len, max_new_tokens=FLAGS.max_new_tokens,
        prefill_block_size=blocks[0], decode_block_size=blocks[1],
        transport=FLAGS.transport if backend == "tpu-inference" else None, seed=FLAGS.seed)
    print(format_real_report(report))
    if FLAGS.json_out:
        with open(FLAGS.json_out, "w") as f:
            json.dump(report, f, indent=2)
    return 0 if report["tokens_match"] and report["kv_exact"] else 1


def main(argv) -> int:
    del argv
    quiet_startup_logging(bool(FLAGS["verbosity"].present))
    if FLAGS.serve_with != "jaxkv" and (
            FLAGS.layerwise or FLAGS.layerwise_ab or FLAGS.host_staging
            or FLAGS.transport != "nixl" and FLAGS.serve_with != "tpu-inference"):
        raise app.UsageError("--layerwise(_ab), --host_staging and --transport=jax run with "
                             "--serve_with=jaxkv (--transport also with tpu-inference)")
    if FLAGS.serve_with in ("vllm-cpu", "tpu-inference"):
        return _serve_real_engines()
    check_compiled_modules()
    if FLAGS.prefill_tp < 1 or FLAGS.decode_tp < 1:
        raise app.UsageError("TP sizes must be >= 1")
    if FLAGS.serve_with == "vllm-scheduler" and FLAGS.prefill_processes != 1:
        raise app.UsageError("--serve_with=vllm-scheduler runs a one-process prefill engine: "
                             "leave --prefill_processes at 1")
    if FLAGS.serve_with == "vllm-scheduler" and importlib.util.find_spec("vllm") is None:
        print("jaxkv demo: --serve_with=vllm-scheduler needs vLLM installed (the environment "
              "scripts/setup_integrations.sh builds has it)", file=sys.stderr)
        return 2
    _set_devices(FLAGS.decode_tp, FLAGS.backend)
    from jaxkv.demo._engines import DemoSettings, run_disaggregated
    from jaxkv.demo._report import format_report, write_plot

    try:
        settings = DemoSettings(
            prefill_tp=FLAGS.prefill_tp, decode_tp=FLAGS.decode_tp,
            prefill_layout=FLAGS.prefill_layout, decode_layout=FLAGS.decode_layout,
            prefill_block_size=FLAGS.prefill_block_size,
            decode_block_size=FLAGS.decode_block_size, dtype=FLAGS.dtype,
            num_requests=FLAGS.num_requests, prompt_len=FLAGS.prompt_len,
            max_new_tokens=FLAGS.max_new_tokens, shared_prefix_len=FLAGS.shared_prefix_len,
            decode_batch=FLAGS.decode_batch, seed=FLAGS.seed, num_layers=FLAGS.num_layers,
            d_model=FLAGS.d_model, num_heads=FLAGS.num_heads, num_kv_heads=FLAGS.num_kv_heads,
            head_dim=FLAGS.head_dim, vocab_size=FLAGS.vocab_size, backend=FLAGS.backend,
            request_interval_s=FLAGS.request_interval_s,
            kill_prefill_after=FLAGS.kill_prefill_after, read_timeout_s=FLAGS.read_timeout_s,
            timeout_s=FLAGS.timeout_s, poll_during_steps=FLAGS.poll_during_steps,
            poll_interval_s=FLAGS.poll_interval_ms / 1e3, pin_cpus=FLAGS.pin_cpus,
            warm_up_reads=FLAGS.warm_up_reads,
            nixl_progress_thread=FLAGS.nixl_progress_thread,
            prefill_processes=FLAGS.prefill_processes, auth_key_file=FLAGS.auth_key_file,
            layerwise=FLAGS.layerwise, layerwise_ab=FLAGS.layerwise_ab,
            transport=FLAGS.transport,
            host_staging=FLAGS.host_staging,
        )
        settings.model().kv_spec(settings.prefill_block_size, settings.prefill_layout,
                                 settings.dtype)
        settings.model().kv_spec(settings.decode_block_size, settings.decode_layout,
                                 settings.dtype)
    except ValueError as error:
        raise app.UsageError(str(error)) from error

    import jax

    scheduled_by = "vLLM's schedulers" if FLAGS.serve_with == "vllm-scheduler" else "jaxkv"
    print(
        f"jaxkv demo ({scheduled_by}): prefill {_processes(settings.prefill_processes)} "
        f"(TP={settings.prefill_tp}) -> decode process (TP={settings.decode_tp}) on "
        f"{jax.devices()[0].platform}; {settings.num_requests} requests of "
        f"{settings.prompt_len} tokens ({settings.shared_prefix_len} shared), "
        f"{settings.max_new_tokens} new tokens each",
        flush=True,
    )
    if settings.kill_prefill_after:
        print(f"fault injection: the prefill process is killed after "
              f"{settings.kill_prefill_after} transfer(s)", flush=True)
    progress = _progress(settings.num_requests, FLAGS.progress)
    if FLAGS.serve_with == "vllm-scheduler":
        from jaxkv.demo._vllm_serve import run_with_vllm_scheduler

        report = run_with_vllm_scheduler(settings, progress=progress)
    else:
        report = run_disaggregated(settings, progress=progress)
    print(format_report(report))
    t = report["timings_ms"]
    print(
        f"wall time {t['total_ms'] / 1e3:.1f}s (colocated reference {t['colocated_ms'] / 1e3:.1f}s"
        f", prefill process ready after {t['prefill_ready_ms'] / 1e3:.1f}s, serving "
        f"{t.get('serve_ms', 0.0) / 1e3:.1f}s)"
    )
    if FLAGS.json_out:
        with open(FLAGS.json_out, "w") as f:
            json.dump(report, f, indent=2)
    if FLAGS.plot_out:
        if write_plot(report, FLAGS.plot_out):
            print(f"plot written to {FLAGS.plot_out}")
        else:
            print("--plot_out skipped: matplotlib is not installed", file=sys.stderr)
    return 0 if report["tokens_match"] and not report["failed_requests"] else 1


def run() -> None:
    """Console-script entry point (`jaxkv-demo`, `python -m jaxkv.demo`)."""
    show_module_flags_in_help(__name__, __doc__)
    app.run(main)
