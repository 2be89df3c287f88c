"""ETL'd shard URLs: through AIS with the SDK, or straight at a transformer pod as an hpull redirect does.

``etl_args`` always travel as a compact JSON *string*: SDK 2.0.0 ``Object.get_url`` copies a dict
argument with ``str()`` (Python repr, not JSON), so a dict would reach the pod as ``{'dtype': ...}``
(AIS passes ``etl_args`` through to the pod). The per-epoch seed lives in ``etl_args``
(``seed`` + ``epoch``): the service derives each sample's draw from (seed, epoch, object, key).
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from ..wire import DTYPES, ERROR_POLICIES, ETL_ARG_FIELDS, GLOBAL_NAMESPACE, LAYOUTS, OBJECT_FOLDER, path_escape

if TYPE_CHECKING:
    from aistore.sdk import Client

SHARD_SUFFIXES = (".tar", ".tar.gz", ".tgz")


def etl_args(
    *,
    preset: str | None = None,
    transforms: list[Any] | str | None = None,
    dtype: str | None = None,
    layout: str | None = None,
    seed: int | None = None,
    epoch: int | None = None,
    on_error: str | None = None,
    skip: int | None = None,
    crop_decode: bool | None = None,
    dct_scaling: bool | None = None,
) -> dict[str, Any]:
    """The ``etl_args`` object for the service, checked here so a typo fails before any request.

    ``skip`` passes over each shard's first samples (the loader sets it when it resumes mid-shard).
    """
    if preset is not None and transforms is not None:
        raise ValueError("etl_args: give either preset or transforms, not both")
    for name, value, allowed in (("dtype", dtype, DTYPES), ("layout", layout, LAYOUTS),
                                 ("on_error", on_error, ERROR_POLICIES)):
        if value is not None and value not in allowed:
            raise ValueError(f"etl_args: {name} {value!r} is not one of {', '.join(allowed)}")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
        raise ValueError("etl_args: seed must be an integer")
    if epoch is not None and (not isinstance(epoch, int) or isinstance(epoch, bool) or epoch < 0):
        raise ValueError("etl_args: epoch must be a non-negative integer")
    if skip is not None and (not isinstance(skip, int) or isinstance(skip, bool) or skip < 0):
        raise ValueError("etl_args: skip must be a non-negative integer")
    for name, flag in (("crop_decode", crop_decode), ("dct_scaling", dct_scaling)):
        if flag is not None and not isinstance(flag, bool):
            raise ValueError(f"etl_args: {name} must be True or False")
    values = {"preset": preset, "transforms": transforms, "dtype": dtype, "layout": layout, "seed": seed,
              "epoch": epoch, "on_error": on_error, "skip": skip, "crop_decode": crop_decode,
              "dct_scaling": dct_scaling}
    return {name: value for name, value in values.items() if value is not None}


def encode_etl_args(args: Mapping[str, Any] | str | None) -> str | None:
    """``etl_args`` as the query string value: compact JSON (as the SDK's ``ETLConfig`` encodes dicts)."""
    if args is None or isinstance(args, str):
        return args or None
    unknown = sorted(set(args) - set(ETL_ARG_FIELDS))
    if unknown:
        raise ValueError(f"etl_args: unknown field {unknown[0]!r}; known fields are {', '.join(ETL_ARG_FIELDS)}")
    return json.dumps(dict(args), separators=(",", ":"), sort_keys=True) if args else None


def shard_urls(
    client: Client,
    bucket: str,
    etl_name: str | None,
    *,
    prefix: str | None = None,
    template: str | None = None,
    names: Iterable[str] | None = None,
    etl_args: Mapping[str, Any] | str | None = None,
    provider: str = "ais",
    suffixes: Sequence[str] = SHARD_SUFFIXES,
    pipeline: Sequence[str] = (),
) -> list[str]:
    """Object URLs of a bucket's shards with ``etl_name`` and JSON ``etl_args``, built by the SDK.

    Give exactly one of ``prefix`` (lists the bucket; only names ending in ``suffixes`` are kept),
    ``template`` (a brace range such as ``train-{000000..000999}.tar``, not listed) or ``names``.
    ``etl_name=None`` gives the raw (untransformed) shards. ``pipeline`` names the ETLs that transform
    the output of ``etl_name`` in turn (``etl_pipeline``, as the SDK's ``Etl >> Etl`` sends it; its
    ``get_url`` drops a pipeline, so it is added here); every stage gets the same ``etl_args``.
    """
    from aistore.sdk.etl import ETLConfig

    from .etlspec import validate_name

    given = [option for option in (prefix, template, names) if option is not None]
    if len(given) != 1:
        raise ValueError("shard_urls: give exactly one of prefix, template or names")
    if pipeline and not etl_name:
        raise ValueError("shard_urls: a pipeline needs the first ETL (etl_name)")
    stages = [validate_name(name) for name in pipeline]
    config = ETLConfig(etl_name, args=encode_etl_args(etl_args)) if etl_name else None
    handle = client.bucket(bucket, provider=provider)
    if prefix is not None:
        urls = [url for url in handle.list_urls(prefix=prefix, etl=config)
                if urlsplit(url).path.endswith(tuple(suffixes))]
    else:
        objects = expand_template(template) if template is not None else list(names)  # type: ignore[arg-type]
        if not objects:
            raise ValueError("shard_urls: no object names given")
        urls = [handle.object(name).get_url(etl=config) for name in objects]
    if stages:
        urls = [f"{url}&{urlencode({'etl_pipeline': ','.join(stages)})}" for url in urls]
    return urls


def expand_template(template: str) -> list[str]:
    """Brace expansion as AIS and webdataset write shard ranges: ``a-{000..002}.tar`` -> 3 names."""
    from braceexpand import braceexpand  # a webdataset dependency

    return list(braceexpand(template))


def set_etl_args(url: str, args: Mapping[str, Any] | str | None) -> str:
    """``url`` with its ``etl_args`` query parameter replaced (removed when ``args`` is empty)."""
    parts = urlsplit(url)
    query = [(k, v) for k, v in parse_qsl(parts.query, keep_blank_values=True) if k != "etl_args"]
    encoded = encode_etl_args(args)
    if encoded:
        query.append(("etl_args", encoded))
    return urlunsplit(parts._replace(query=urlencode(query)))


def get_etl_args(url: str) -> dict[str, Any]:
    """The decoded ``etl_args`` of a URL ({} when it has none)."""
    for key, value in parse_qsl(urlsplit(url).query, keep_blank_values=True):
        if key == "etl_args" and value:
            return json.loads(value)
    return {}


def is_etl_url(url: str) -> bool:
    """Whether ``url`` reads through an ETL: AIS's ``etl_name``, or a pod's ``etl_fqn``/``etl_args``."""
    if not url.startswith(("http://", "https://")):
        return False
    return any(key in ("etl_name", "etl_fqn", "etl_args") for key, _ in parse_qsl(urlsplit(url).query))


def with_skip(url: str, samples: int) -> str:
    """``url`` asking the ETL to pass over the shard's first ``samples`` samples (added to any ``skip``
    the URL already carries)."""
    args = get_etl_args(url)
    return set_etl_args(url, {**args, "skip": args.get("skip", 0) + samples})


@dataclass(frozen=True)
class EpochUrls:
    """Shard URLs whose ``etl_args`` carry the epoch, so each epoch gets new augmentation draws.

    Calling it with an epoch returns the URLs for that epoch. ``seed`` (kept in every epoch) makes
    the draws reproducible across runs; without one a seed is drawn once here, in this process, and
    its DataLoader workers inherit it. Picklable, so the workers can call it.
    """

    urls: tuple[str, ...]
    args: Mapping[str, Any] = field(default_factory=dict)
    seed: int | None = None

    def __post_init__(self) -> None:
        if not self.urls:
            raise ValueError("EpochUrls: no shard URLs")
        encode_etl_args(self.args)  # validate the field names once, here
        if self.seed is None:
            object.__setattr__(self, "seed", random.SystemRandom().randrange(2**62))

    def __call__(self, epoch: int) -> list[str]:
        args = {**self.args, "seed": self.seed, "epoch": epoch}
        return [set_etl_args(url, args) for url in self.urls]

    def __len__(self) -> int:
        return len(self.urls)


def uname(bucket: str, object_name: str, provider: str = "ais") -> str:
    """The AIS uname of an object in the global namespace, e.g. ``ais/@#/bck/dir/a.tar``."""
    return f"{provider}/{GLOBAL_NAMESPACE}/{bucket}/{object_name}"


def ais_fqn(mountpath: str, bucket: str, object_name: str, provider: str = "ais") -> str:
    """Where a target keeps an object on disk: ``<mountpath>/@<provider>/<bucket>/%ob/<object>``."""
    return f"{mountpath.rstrip('/')}/@{provider}/{bucket}/{OBJECT_FOLDER}/{object_name}"


def pod_urls(
    pod_url: str,
    bucket: str,
    objects: Iterable[str],
    *,
    etl_args: Mapping[str, Any] | str | None = None,
    mountpath: str | None = None,
    provider: str = "ais",
) -> list[str]:
    """URLs straight at a transformer pod, exactly as an AIS hpull redirect builds them.

    ``GET <pod>/<PathEscape(uname)>?etl_fqn=<PathEscape(fqn)>&etl_args=<json>`` (AIS's
    ext/etl/communicator.go). With ``mountpath`` the pod reads ``<mountpath>/@ais/<bucket>/%ob/<object>``
    from its own disk (a relative ``mountpath`` is made absolute here, as AIS only sends absolute
    paths and the pod refuses others); without it, the pod fetches the object from ``AIS_TARGET_URL``.
    For local runs and tests without an AIS cluster.
    """
    base = pod_url.rstrip("/")
    if mountpath is not None:
        mountpath = os.path.abspath(mountpath)
    encoded = encode_etl_args(etl_args)
    urls = []
    for name in objects:
        query = []
        if mountpath is not None:
            query.append(("etl_fqn", path_escape(ais_fqn(mountpath, bucket, name, provider))))
        if encoded:
            query.append(("etl_args", encoded))
        suffix = f"?{urlencode(query)}" if query else ""
        urls.append(f"{base}/{path_escape(uname(bucket, name, provider))}{suffix}")
    return urls
