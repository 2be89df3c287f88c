"""``wds-transform --help`` and each command's: plain text, no reStructuredText markup."""

from __future__ import annotations

import pytest

from transformer.cli import main

COMMANDS = ["serve", "apply", "make-shards", "preview", "inspect", "settings"]


@pytest.mark.parametrize("command", [None, *COMMANDS])
def test_help_is_plain_text(command: str | None, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main([*([command] if command else []), "--help"])
    assert done.value.code == 0
    text = capsys.readouterr().out
    assert text.startswith("usage: wds-transform"), text
    assert not any(markup in text for markup in ("``", ":class:", ":func:", "::")), text
    if command is None:
        assert "The AIS ETL transformer for WebDataset shards" in text, text
