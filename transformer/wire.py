"""The names and formats the pod and the training client agree on, defined once for both sides.

Standard library only: the client imports it without the server's dependencies, and the server
without the client's. What lives here:

* ``ETL_ARG_FIELDS``: the fields of ``etl_args`` the service accepts (``transformer.options`` parses
  them, ``transformer.client.urls`` checks them before any request).
* AIS object names: ``GLOBAL_NAMESPACE`` of a uname, the ``%ob`` folder of an FQN, ``path_escape``
  (Go's ``url.PathEscape``, which AIS applies to both in its pod URLs).
* The end marker's member name, key and format, and the input checksum it records
  (``transformer.integrity`` writes and checks it; the client reads it from a shard's tail).
"""

from __future__ import annotations

from urllib.parse import quote

# The etl_args fields the service accepts; anything else is refused on both sides.
ETL_ARG_FIELDS = ("preset", "transforms", "dtype", "layout", "seed", "epoch", "on_error", "skip", "crop_decode",
                  "dct_scaling")

GLOBAL_NAMESPACE = "@#"  # AIS uname of a bucket in the global namespace: <provider>/@#/<bucket>/<object>
OBJECT_FOLDER = "%ob"  # an FQN's folder of objects: <mountpath>/@<provider>/[<ns>/]<bucket>/%ob/<object>

END_MARKER_NAME = "__etl__/end.json"
END_MARKER_KEY = "__etl__/end"  # its webdataset key (the name up to the basename's first dot)
END_MARKER_FORMAT = "ais-wds-etl-end/1"
# The input digest: XXH64 with seed 0, as hex of its big-endian value. AIS 5.0 computes the same for a
# bucket of checksum type "xxhash2" (github.com/cespare/xxhash/v2; its default for new buckets).
INPUT_CHECKSUM = "xxhash2"


def path_escape(text: str) -> str:
    """Go's ``url.PathEscape``, which AIS uses for the one-segment uname in its object URLs: one path
    segment, ``/ ; , ?`` escaped, ``$ & + : = @`` kept.

    Hand-written (one line) because no Python library exposes Go's exact segment rule.
    """
    return quote(text, safe="$&+:=@")
