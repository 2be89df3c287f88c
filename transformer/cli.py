"""Command line: ``wds-transform serve | apply | make-shards | preview | inspect | settings | sync``.

``serve`` is the pod's entry point (the Dockerfile and the AIS runtime spec run it); ``sync`` brings
an ETL'd copy of a bucket up to date through AIS (``transform_bucket(..., incremental=True)``); the
other commands use the same engine on local files. Each command's work lives in the module it calls.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from .errors import TransformerError

DESCRIPTION = ("The AIS ETL transformer for WebDataset shards: 'serve' runs the service (the pod's entry "
               "point); the other commands use its engine on local files.")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="wds-transform", description=DESCRIPTION)
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="run the AIS ETL transformer service (the pod's entry point)")
    serve.add_argument("--host", help="listen address (default 0.0.0.0, as AIS requires)")
    serve.add_argument("--port", type=int, help="listen port (default 8000, as AIS requires)")

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

    sync = commands.add_parser(
        "sync", help="transform through AIS only the objects of SRC whose copy in DST is missing or stale (an "
                     "incremental offline transform)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Compare every object of SRC under --prefix with its copy in DST and transform again, through "
                    "the ETL, only the new, changed, restyled and cut ones.",
        epilog="An orphan is an object of DST this transformer made (it ends with the transformer's end marker)\n"
               "whose name maps back through --ext to a source name under --prefix that SRC no longer holds.\n"
               "Only orphans are ever deleted, and only with --delete-orphans: by one AIS multi-object delete,\n"
               "after the job, refused when a listing was taken during a rebalance. Any other object under\n"
               "the prefix (no end marker, or a name no source under the prefix maps to) is reported, never\n"
               "deleted. Objects under __etl__/ are the tool's own (its ledger, probes).\n\n"
               "Cost: a listing of each bucket and one small object (the copy ledger) for a run with nothing\n"
               "to do; a 2 KiB read of each copy the ledger does not know; after a job, a listing of each\n"
               "bucket and a 2 KiB read of each copy the job wrote. No object is read whole.")
    sync.add_argument("source", help="source bucket (ais://SRC or SRC)")
    sync.add_argument("destination", help="destination bucket (ais://DST or DST)")
    sync.add_argument("--etl", required=True, help="the registered ETL; the copy is made with its settings")
    sync.add_argument("--endpoint", default=os.environ.get("AIS_ENDPOINT", ""),
                      help="AIS proxy URL (default: AIS_ENDPOINT)")
    sync.add_argument("--prefix", default="", help="only the source objects under this prefix")
    sync.add_argument("--ext", action="append", default=[], metavar="FROM=TO",
                      help="rename extensions in the destination, as AIS does (repeatable), e.g. tar=npy.tar")
    sync.add_argument("--delete-orphans", action="store_true",
                      help="delete the orphans: this transformer's copies of sources that are gone, by their end "
                           "marker and name (default: report them only; see below)")
    sync.add_argument("--dry-run", action="store_true",
                      help="print what would be transformed and deleted, by class, and change nothing")
    sync.add_argument("--timeout", type=int, default=3600, help="seconds to wait for the job (default 3600)")

    args = parser.parse_args(argv)
    try:
        return _COMMANDS[args.command](args)
    except TransformerError as exc:
        from .redact import redact

        print(f"error: {redact(exc.message)}", file=sys.stderr)
        return 2


def _serve(args: argparse.Namespace) -> int:
    from .serve import serve

    return serve(host=args.host, port=args.port)


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
    from .client.sync import sync

    return sync(args.endpoint, args.etl, args.source, args.destination, prefix=args.prefix, ext=args.ext,
                delete_orphans=args.delete_orphans, dry_run=args.dry_run, timeout=args.timeout)


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
