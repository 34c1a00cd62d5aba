"""The randomized lifecycle campaign's long mode (issue 35, part 1): real producer processes
(TP 2, a block manager) and a consumer engine (TP 1, a block manager) through a seeded random
schedule of lifecycles (reads, double reads, aborts on either side before/during/after the
read, lease expiry, pool pressure, producer SIGKILL and restart), checking every read bit for
bit and every pool and pin at quiescence. See `tests/support/campaign.py` for the events and
invariants; `tests/transfer/transfer_campaign_test.py` runs a short seed budget.

  python benchmarks/campaign.py --lifecycles=10000 --seed=7 --json_out=/tmp/campaign.json

Prints one JSON object per transport run and a summary (lifecycles run, reads finished and
failed by cause, invariant violations, RSS/thread/fd slopes per 1,000 lifecycles after
warm-up, wall time, machine, versions, date) and writes the summary with ``--json_out``.
Exits 1 when any invariant was violated (the violations are listed).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import faulthandler
import json
import os
import platform
import signal
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))
os.environ.setdefault("UCX_TLS", "tcp,sm,self")


def _machine() -> dict:
    model = ""
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        model = next((line.split(":", 1)[1].strip() for line in f
                      if line.startswith("model name")), "")
    return dict(cpu=model, cores=os.cpu_count(), platform=platform.platform())


def _versions() -> dict:
    from importlib import metadata

    out = {"python": platform.python_version()}
    for name in ("jax", "jaxlib", "numpy", "nixl", "nixl-cu13", "msgspec"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out["jaxkv_commit"] = subprocess.run(
            ["git", "-C", HERE, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
            timeout=10, check=False).stdout.strip()
    return out


def main(argv=None) -> int:
    faulthandler.register(signal.SIGUSR1)  # kill -USR1 <pid>: every thread's stack
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lifecycles", type=int, default=10000, help="per transport")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--transports", default="nixl,jax")
    parser.add_argument("--max_kills", type=int, default=3, help="producer SIGKILLs per run")
    parser.add_argument("--max_stops", type=int, default=3,
                        help="producer SIGSTOPs past a read's deadline per run")
    parser.add_argument("--max_wall_s", type=float, default=None,
                        help="per transport: stop drawing lifecycles after that long")
    parser.add_argument("--progress_every", type=int, default=500)
    parser.add_argument("--read_timeout_s", type=float, default=5.0)
    parser.add_argument("--sample_every", type=int, default=20)
    parser.add_argument("--digests", default="off", choices=("off", "full", "sampled:4"),
                        help="integrity digests on both engines; with 'full' the campaign "
                             "also corrupts published blocks and checks every one is caught")
    parser.add_argument("--json_out", default="")
    args = parser.parse_args(argv)

    from support import platforms

    platforms.force_cpu_devices()
    from support import campaign as ct

    from jaxkv.transfer import nixl_available
    from jaxkv.transfer._jax_transport import jax_transfer_available

    available = {"nixl": nixl_available(), "jax": jax_transfer_available()}
    runs, skipped = [], []
    start = time.monotonic()
    for transport in [t for t in args.transports.split(",") if t]:
        if not available.get(transport):
            skipped.append(transport)
            continue
        timeout = args.read_timeout_s if transport == "nixl" else max(args.read_timeout_s, 10.0)
        campaign = ct.Campaign(transport, read_timeout_s=timeout, max_kills=args.max_kills,
                               max_stops=args.max_stops, sample_every=args.sample_every,
                               digests=args.digests)
        try:
            campaign.run(args.seed, args.lifecycles, progress_every=args.progress_every,
                         max_wall_s=args.max_wall_s)
        finally:
            campaign.close()
        report = campaign.report()
        print(json.dumps(report), flush=True)
        runs.append(report)
    summary = dict(
        benchmark="campaign", seed=args.seed, lifecycles_per_transport=args.lifecycles,
        max_wall_s_per_transport=args.max_wall_s,
        lifecycles_run=sum(r["lifecycles"] for r in runs),
        invariant_violations=sum(r["invariant_violations"] for r in runs),
        runs=runs, skipped_transports=skipped, wall_s=round(time.monotonic() - start, 1),
        machine=_machine(), versions=_versions(),
        date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    )
    print(json.dumps(summary, indent=1))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(summary, f, indent=1)
    return 1 if summary["invariant_violations"] else 0


if __name__ == "__main__":
    sys.exit(main())
