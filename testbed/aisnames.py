"""How AIS's Go code spells names on the wire: Go's ``url.PathEscape`` and the ETL object path's prefix.

Written apart from ``transformer.wire`` so that tests check the one against the other.
"""

from __future__ import annotations

from urllib.parse import quote

ETL_OBJECT_PREFIX = "/v1/etl/_object"


def go_path_escape(text: str) -> str:
    """Go's ``url.PathEscape``: like ``quote`` but ``$&+:=@`` stay, and ``/`` ``;`` ``,`` ``?`` are escaped.

    Hand-written because no library exposes Go's exact path-segment rule, and AIS builds every
    escaped uname and FQN with it (``ext/etl/communicator.go``).
    """
    return quote(text, safe="$&+:=@")
