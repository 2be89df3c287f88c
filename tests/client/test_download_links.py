"""What ``download`` asks AIS to fetch, for each way of giving links (the real cluster runs them in
tests/ais/etl/test_download.py), and the links it refuses before any request."""

from __future__ import annotations

import pytest

from transformer.client.download import _links, _objects


def test_one_link_is_a_single_download_named_after_its_path() -> None:
    assert _links("https://host/a/train-0001.tar?sig=x") == {
        "type": "single", "link": "https://host/a/train-0001.tar?sig=x", "object_name": "train-0001.tar"}


def test_a_brace_template_is_a_range_download() -> None:
    assert _links("http://host/train-{0000..0099}.tar") == {
        "type": "range", "template": "http://host/train-{0000..0099}.tar", "subdir": ""}


def test_a_list_or_a_mapping_is_a_multi_download() -> None:
    assert _links(["http://h/a.tar", "http://h/b.tar"]) == {"type": "multi", "objects": ["http://h/a.tar",
                                                                                          "http://h/b.tar"]}
    assert _links({"x/a.tar": "http://h/1"}) == {"type": "multi", "objects": {"x/a.tar": "http://h/1"}}


@pytest.mark.parametrize(("links", "reason"), [
    ("ftp://host/a.tar", "'ftp://host/a.tar' is not an http"),
    ("/local/a.tar", "is not an http"),
    (["http://h/a.tar", "s3://b/c.tar"], "'s3://b/c.tar' is not an http"),
    ({"a.tar": "file:///a.tar"}, "is not an http"),
    ("http://host/shards/", "names no object"),
    (["http://host/"], "names no object"),
    ([], "no links"),
    ({}, "no links"),
])
def test_links_refused_before_any_request(links, reason: str) -> None:
    with pytest.raises(ValueError, match=reason):
        _links(links)


def test_the_objects_a_download_asks_for_are_named_as_aiss_downloader_names_them() -> None:
    """ext/dload: ``path.Base`` of each link, then its query dropped and its escapes undone
    (``NormalizeObjName``); a mapping's names and a single link's ``object_name`` the same way."""
    assert _objects(_links("https://host/a/train-0001.tar?sig=x")) == {
        "train-0001.tar": "https://host/a/train-0001.tar?sig=x"}
    assert list(_objects(_links("http://host/train-{0000..0002}.tar?sig=y"))) == [
        "train-0000.tar", "train-0001.tar", "train-0002.tar"]
    assert list(_objects(_links(["http://h/a%20b.tar", "http://h/x/c.tar?v=1"]))) == ["a b.tar", "c.tar"]
    assert _objects(_links({"copy/x.tar": "http://h/1"})) == {"copy/x.tar": "http://h/1"}
