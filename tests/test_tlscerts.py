"""The throwaway TLS files of the tests: without ``openssl`` they are an error naming it, never a skip."""

from __future__ import annotations

from pathlib import Path

import pytest

from testbed.tlscerts import OpensslUnavailable, make_tls_files


def test_without_openssl_the_tls_files_are_an_error_naming_it(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(OpensslUnavailable, match="openssl command line .* not on PATH"):
        make_tls_files(tmp_path / "tls")
    assert not (tmp_path / "tls").exists()
