import pytest

from batchcraft.errors import BatchcraftError, WorkspaceError
from batchcraft.microbatching.budget import format_bytes, parse_budget


@pytest.mark.parametrize("text, expected", [
    ("64MiB", 64 * 2 ** 20), ("1.5GiB", 3 * 2 ** 29), ("512KB", 512_000), ("8 mib", 8 * 2 ** 20),
    ("0", 0), (1024, 1024), (2.0 ** 20, 2 ** 20), ("100B", 100), ("1e3", 1000),
])
def test_good_budgets(text, expected):
    assert parse_budget(text) == expected


@pytest.mark.parametrize("bad", ["64XB", "-1", -1, "MiB", "", "1.5.2GiB", None, True, float("nan"), float("inf"), [64]])
def test_bad_budgets_raise_workspace_error(bad):
    with pytest.raises(WorkspaceError) as exc:
        parse_budget(bad)
    assert isinstance(exc.value, BatchcraftError) and isinstance(exc.value, ValueError)
    assert "workspace_limit" in str(exc.value)


def test_unknown_unit_message_lists_units():
    with pytest.raises(WorkspaceError, match="MiB"):
        parse_budget("64XB")


def test_format_bytes():
    assert format_bytes(64 * 2 ** 20) == "64.0 MiB"
    assert format_bytes(10) == "10 B"
