"""The AIS the documents promise is the AIS the tests run: the aisnode version testbed/cluster.py builds."""

from __future__ import annotations

import re
from pathlib import Path

from testbed.cluster import AISNODE_VERSION

REPO = Path(__file__).resolve().parents[1]
PROMISES = (REPO / "README.md", REPO / "docs" / "deploy.md")


def promised(text: str) -> list[str]:
    """Each 'AIS X on Kubernetes (`aisnode` vY...' promise in ``text``, as 'X vY'; and any 'or later'."""
    one = " ".join(text.split())
    found = [f"{m.group(1)} {m.group(2)}" for m in re.finditer(r"AIS (\d+\.\d+) on Kubernetes \(`aisnode` (v[\d.]+)",
                                                               one)]
    return found + [m.group(0) for m in re.finditer(r"AIS [\d.]+ or later", one)]


def test_the_documents_promise_the_ais_the_tests_run() -> None:
    for doc in PROMISES:
        assert promised(doc.read_text()) == [f"5.0 {AISNODE_VERSION}"], doc.name


def test_an_untested_promise_is_caught() -> None:
    assert promised("AIS 4.0 or later on Kubernetes, built with ETL support.") == ["AIS 4.0 or later"]
    assert promised("AIS 5.0 on Kubernetes (`aisnode` v1.4.2, ...)") == ["5.0 v1.4.2"]
