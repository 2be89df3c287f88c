"""``wds-transform --help`` and each command's: plain text, no reStructuredText markup."""

from __future__ import annotations

import pytest

from transformer.cli import main

COMMANDS = ["serve", "apply", "make-shards", "preview", "inspect", "settings", "sync"]


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


def test_sync_help_says_what_an_orphan_is_and_what_a_run_costs(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["sync", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--dry-run" in text and "change nothing" in text
    assert ("An orphan is an object of DST this transformer made (it ends with the transformer's end marker) whose "
            "name maps back through --ext to a source name under --prefix that SRC no longer holds") in text
    assert "Only orphans are ever deleted, and only with --delete-orphans" in text
    assert "refused when a listing was taken during a rebalance" in text
    assert "is reported, never deleted" in text
    assert "one small object (the copy ledger) for a run with nothing to do" in text
