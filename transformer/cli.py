"""Command line: ``wds-transform serve | apply | make-shards | preview | inspect | settings | sync``.

``serve`` is the pod's entry point (the Dockerfile and the AIS runtime spec run it); ``sync`` brings
an ETL'd copy of a bucket up to date through AIS (``transform_bucket(..., incremental=True)``); the
other commands use the same engine on local files. Each command's work lives in the module it calls.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping
from pathlib import Path

from .errors import TransformerError

DESCRIPTION = ("The AIS ETL transformer for WebDataset shards: 'serve' runs the service (the pod's entry "
               "point); the other commands use its engine on local files.")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="wds-transform", description=DESCRIPTION)
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="run the AIS ETL transformer service (the pod's entry point)")
    serve.add_argument("--host", help="listen address (default: ETL_HOST or 0.0.0.0)")
    serve.add_argument("--port", type=int, help="listen port (default: ETL_PORT or 8000)")

    apply = commands.add_parser("apply", help="transform local shards with the service's engine")
    apply.add_argument("inputs", nargs="+", type=Path, help="input shard(s); with several, OUT is a folder")
    apply.add_argument("output", type=Path, help="output shard, or folder for several inputs")
    apply.add_argument("--etl-args", default="", help="JSON object, exactly as etl_args over AIS")

    make = commands.add_parser("make-shards", help="write the embedded demo dataset as WebDataset shards")
    make.add_argument("output", type=Path, help="folder for the shards")
    make.add_argument("--shards", type=int, default=2, help="number of shards (default 2)")
    make.add_argument("--samples", type=int, default=100, help="samples per shard (default 100)")
    make.add_argument("--seed", type=int, default=0, help="seed of the image variations (default 0)")
    make.add_argument("--masks", action="store_true",
                      help="Oxford-Pet-like samples: image.jpg + trimap.png + cls (masks follow the image's crop)")

    preview = commands.add_parser("preview", help="draw a grid of transformed samples of a shard")
    preview.add_argument("shard", type=Path, help="a transformed (.npy) or raw shard")
    preview.add_argument("-o", "--output", type=Path, default=Path("preview.png"), help="PNG to write")
    preview.add_argument("--count", type=int, default=16, help="samples to draw (default 16)")
    preview.add_argument("--etl-args", default="", help="transform a raw shard with these etl_args first")

    inspect = commands.add_parser("inspect", help="summarize a shard (members, arrays, labels, errors) and "
                                                  "check that it is whole")
    inspect.add_argument("shard", help="a shard: a file, or an http(s) URL (through AIS or the pod)")
    inspect.add_argument("--raw", action="store_true",
                         help="a shard not written by this ETL: do not require its end marker")

    settings = commands.add_parser("settings", help="print the effective settings, or docs/settings.md's table")
    settings.add_argument("--markdown", action="store_true", help="print the settings table as markdown")

    sync = commands.add_parser("sync", help="transform through AIS only the objects of SRC whose copy in DST is "
                                            "missing or stale (an incremental offline transform)")
    sync.add_argument("source", help="source bucket (ais://SRC or SRC)")
    sync.add_argument("destination", help="destination bucket (ais://DST or DST)")
    sync.add_argument("--etl", required=True, help="the registered ETL; the copy is made with its settings")
    sync.add_argument("--endpoint", default=os.environ.get("AIS_ENDPOINT", ""),
                      help="AIS proxy URL (default: AIS_ENDPOINT)")
    sync.add_argument("--prefix", default="", help="only the source objects under this prefix")
    sync.add_argument("--ext", action="append", default=[], metavar="FROM=TO",
                      help="rename extensions in the destination, as AIS does (repeatable), e.g. tar=npy.tar")
    sync.add_argument("--delete-orphans", action="store_true",
                      help="delete the copies whose source is gone (default: report them only)")
    sync.add_argument("--timeout", type=int, default=3600, help="seconds to wait for the job (default 3600)")

    args = parser.parse_args(argv)
    try:
        return _COMMANDS[args.command](args)
    except TransformerError as exc:
        from .redact import redact

        print(f"error: {redact(exc.message)}", file=sys.stderr)
        return 2


def _serve(args: argparse.Namespace) -> int:
    from .config import Settings, write_termination_log
    from .redact import configure, install_logging, redact

    configure(os.environ.get("AIS_TARGET_URL", ""))  # before anything is written: the ETL secret stays out
    if _worker_processes_likely(os.environ):
        from .forkserver import start_fork_server

        start_fork_server()  # it imports torch in a process of its own while this one does the same
    try:
        settings = Settings.from_env()  # fail fast, before binding the port, on a bad setting
    except TransformerError as exc:
        # Kubernetes shows the termination log in the container status; AIS prints it when init fails.
        write_termination_log(redact(f"wds-transform serve: {exc.message}"))
        raise
    install_logging(settings.ais_target_url)

    import uvicorn

    from .server.logs import serve_log_config
    from .server.protocols import DirectSendProtocol, FragmentingWebSocketProtocol

    uvicorn.run(
        "transformer.server:create_app",
        factory=True,
        host=args.host or settings.host,
        port=args.port or settings.port,
        # Above the AIS target's 6 s idle timeout, so the target never reuses a connection we closed
        # (AIS does not retry a PUT that failed with EOF; ext/etl/communicator.go).
        timeout_keep_alive=settings.keepalive,
        # uvicorn's httptools protocol, which also hands the connection's transport to shard responses
        # so the shard's driver thread can write the output itself (server/direct.py).
        http=DirectSendProtocol,
        # uvicorn's websockets (sans-I/O) protocol, which can also send a reply frame by frame
        # (server/wsreply.py). AIS sends up to 16 GiB per message and a shard sent as content is one
        # message, held in memory whole: the shard limit caps it (the 1 MiB floor keeps room for
        # control messages).
        ws=FragmentingWebSocketProtocol,
        ws_max_size=min(16 * 2**30, max(settings.max_shard_bytes, 2**20)),
        ws_ping_interval=None,  # the target never answers pings' purpose; AIS itself sends none
        ws_ping_timeout=None,
        # No permessage-deflate: AIS's gorilla dialer never asks for it, float arrays barely compress,
        # and deflating 600 MB per shard would cost more CPU than transforming it. (Direct send writes
        # uncompressed frames, so it also stays off with a compressing client.)
        ws_per_message_deflate=False,
        log_level=settings.log_level,
        # uvicorn's own, with the ETL secret masked in each handler, and the root logger in the pod's format
        log_config=serve_log_config(settings.log_level),
        access_log=settings.log_level == "debug",
        timeout_graceful_shutdown=int(settings.obj_timeout),
    )
    return 0


def _worker_processes_likely(env: Mapping[str, str]) -> bool:
    """Whether the settings will ask for transform worker processes, read without torch (a bad value: no)."""
    from .config import available_cpus, processes_for

    try:
        workers = int(env.get("ETL_WORKERS", "").strip() or available_cpus())
        raw = env.get("ETL_PROCESSES", "").strip()
        return (int(raw) if raw else processes_for(workers)) > 0
    except ValueError:
        return False


def _apply(args: argparse.Namespace) -> int:
    from .apply import apply_shards

    return apply_shards(args.inputs, args.output, args.etl_args)


def _make_shards(args: argparse.Namespace) -> int:
    from .demo import make_shards

    for path in make_shards(args.output, shards=args.shards, samples=args.samples, seed=args.seed,
                            masks=args.masks):
        print(path)
    return 0


def _preview(args: argparse.Namespace) -> int:
    from .preview import render_preview

    render_preview(args.shard, args.output, count=args.count, etl_args=args.etl_args)
    print(args.output)
    return 0


def _inspect(args: argparse.Namespace) -> int:
    from .inspection import inspect_shard

    return inspect_shard(str(args.shard), raw=args.raw)


def _settings(args: argparse.Namespace) -> int:
    from .config import Settings, settings_table

    if args.markdown:
        print(settings_table())
        return 0
    for name, value in vars(Settings.from_env()).items():
        if name != "env":
            print(f"{name} = {value!r}")
    return 0


def _sync(args: argparse.Namespace) -> int:
    """``transform_bucket(..., incremental=True)`` with the ETL's own settings; the classes and the job printed."""
    from .client.errors import IncompleteCopy
    from .client.offline import registered_options, transform_bucket

    if not args.endpoint:
        print("error: give the AIS proxy URL (--endpoint or AIS_ENDPOINT)", file=sys.stderr)
        return 2
    ext = {}
    for item in args.ext:
        old, sep, new = item.partition("=")
        if not sep or not old or not new:
            print(f"error: --ext {item!r}: give FROM=TO, e.g. tar=npy.tar", file=sys.stderr)
            return 2
        ext[old.lstrip(".")] = new
    from aistore.sdk import Client

    client = Client(args.endpoint)
    source, destination = (name.removeprefix("ais://").strip("/") for name in (args.source, args.destination))
    try:
        job = transform_bucket(client, args.etl, source, destination, options=registered_options(client, args.etl),
                               prefix=args.prefix, ext=ext or None, timeout=args.timeout, incremental=True,
                               delete_orphans=args.delete_orphans)
    except IncompleteCopy as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return 1
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    changes = job.changes
    print(f"ais://{source} -> ais://{destination}: "
          + ", ".join(f"{n} {key.replace('_', ' ')}" for key, n in changes.counts.items())
          + f" ({changes.tail_reads} tail reads in {changes.seconds:.1f} s)")
    if job.job_id:
        print(f"job {job.job_id}: {len(changes.stale)} transformed, {job.verified} proven whole, "
              f"{len(job.object_errors)} failed")
        for name, message in job.object_errors:
            print(f"  {name}: {message}")
    else:
        print("nothing to transform")
    if changes.deleted:
        print(f"deleted {len(changes.deleted)} orphan{'s' if len(changes.deleted) > 1 else ''}: "
              + ", ".join(changes.deleted))
    elif changes.orphans:
        print(f"{len(changes.orphans)} orphan(s) kept (--delete-orphans removes them): "
              + ", ".join(changes.orphans[:10]) + (" ..." if len(changes.orphans) > 10 else ""))
    return 0


_COMMANDS = {
    "serve": _serve,
    "apply": _apply,
    "make-shards": _make_shards,
    "preview": _preview,
    "inspect": _inspect,
    "settings": _settings,
    "sync": _sync,
}

if __name__ == "__main__":
    sys.exit(main())
