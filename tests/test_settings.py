"""The settings: one module reads every RLCOMM_* variable, every field is documented,
bad values name their variable, run-time changes reach workers launched afterwards."""

from __future__ import annotations

import dataclasses
import io
import os
import re
import tokenize

import pytest

import rlcomm
from rlcomm.comm.options import default_timeout, set_default_timeout
from rlcomm.settings import Settings, SettingsError, env_name, get_settings, update_settings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "rlcomm")


def _doc_rows() -> dict[str, str]:
    with open(os.path.join(ROOT, "docs", "settings.md")) as f:
        rows = [line for line in f if line.startswith("| `RLCOMM_")]
    return {re.match(r"\| `(RLCOMM_\w+)`", row).group(1): row for row in rows}


def test_every_setting_is_documented_with_its_default():
    rows = _doc_rows()
    for f in dataclasses.fields(Settings):
        name = env_name(f.name)
        assert name in rows, f"{name} has no row in docs/settings.md"
        assert f"`{f.default}`" in rows[name], f"docs/settings.md: {name}'s default is not {f.default}"
        live = "| yes |" if f.metadata["live"] else "| no |"
        assert live in rows[name], f"docs/settings.md: {name} should say live {live}"
    extra = set(rows) - {env_name(f.name) for f in dataclasses.fields(Settings)}
    assert not extra, f"docs/settings.md documents settings that do not exist: {extra}"


def _string_literals(path: str) -> list[tuple[int, str]]:
    with open(path, "rb") as f:
        tokens = tokenize.tokenize(io.BytesIO(f.read()).readline)
        return [(t.start[0], t.string) for t in tokens if t.type == tokenize.STRING]


def test_no_module_but_settings_reads_rlcomm_variables():
    offenders = []
    for folder, _, files in os.walk(PACKAGE):
        for name in files:
            path = os.path.join(folder, name)
            if not name.endswith(".py") or path == os.path.join(PACKAGE, "settings.py"):
                continue
            for line, text in _string_literals(path):
                # A string that is (or starts) a variable name, as opposed to prose in a
                # docstring that mentions one.
                if re.match(r"""^[rbfu]*['"]RLCOMM_""", text):
                    offenders.append(f"{os.path.relpath(path, ROOT)}:{line}: {text}")
            with open(path) as f:
                for n, code in enumerate(f, 1):
                    if re.search(r"(environ|getenv)\b.*RLCOMM_", code):
                        offenders.append(f"{os.path.relpath(path, ROOT)}:{n}: {code.strip()}")
    assert not offenders, "read RLCOMM_ settings through rlcomm.settings:\n" + "\n".join(offenders)


def test_from_env_parses_and_names_bad_values():
    s = Settings.from_env({"RLCOMM_COMM_TIMEOUT": "12.5", "RLCOMM_CATCH_FAILURE": "off",
                           "RLCOMM_SHM_RING_BYTES": "1048576", "RLCOMM_LOG_LEVEL": "info",
                           "RLCOMM_CALL_TIMEOUT": " "})
    assert (s.comm_timeout, s.catch_failure, s.shm_ring_bytes, s.log_level) == (
        12.5, False, 1 << 20, "INFO")
    assert s.call_timeout == 24 * 3600.0  # blank: the default
    assert s.changed() == {"comm_timeout": 12.5, "catch_failure": False,
                           "shm_ring_bytes": 1 << 20, "log_level": "INFO"}
    with pytest.raises(SettingsError, match=r"RLCOMM_COMM_TIMEOUT='soon': expected a number"):
        Settings.from_env({"RLCOMM_COMM_TIMEOUT": "soon"})
    with pytest.raises(SettingsError, match=r"RLCOMM_CATCH_FAILURE='maybe'"):
        Settings.from_env({"RLCOMM_CATCH_FAILURE": "maybe"})
    with pytest.raises(SettingsError, match=r"comm_timeout: must be >= "):
        Settings.from_env({"RLCOMM_COMM_TIMEOUT": "-1"})
    with pytest.raises(SettingsError, match=r"log_level: expected one of"):
        Settings.from_env({"RLCOMM_LOG_LEVEL": "LOUD"})
    assert isinstance(SettingsError("x"), ValueError) and isinstance(SettingsError("x"), rlcomm.RlcommError)


def test_update_settings_at_run_time():
    before = get_settings()
    try:
        assert rlcomm.update_settings(comm_timeout=7) is get_settings()
        assert get_settings().comm_timeout == 7.0 and default_timeout() == 7.0
        set_default_timeout(9)
        assert get_settings().comm_timeout == 9.0
        with pytest.raises(SettingsError, match="no setting named 'comm_timout'"):
            update_settings(comm_timout=1)
        with pytest.raises(SettingsError, match="RLCOMM_SHM_RING_BYTES in the environment"):
            update_settings(shm_ring_bytes=1 << 20)
        with pytest.raises(SettingsError, match="call_timeout: must be >= "):
            update_settings(call_timeout=0)
        with pytest.raises(SettingsError, match="expected float"):
            update_settings(launch_timeout="long")
    finally:
        update_settings(**{k: getattr(before, k) for k in before.changed()},
                        comm_timeout=before.comm_timeout)
    assert get_settings() == before


class SettingsReader(rlcomm.Worker):
    def read(self) -> dict:
        import logging

        rlcomm_logger = logging.getLogger("rlcomm")
        return {
            "call_timeout": rlcomm.get_settings().call_timeout,
            "log_level": rlcomm.get_settings().log_level,
            "rlcomm_level": logging.getLevelName(rlcomm_logger.getEffectiveLevel()),
            "root_handlers": len(logging.getLogger().handlers),
        }


@pytest.mark.timeout(180)
def test_changed_settings_reach_workers_launched_after(cluster):
    before = get_settings()
    update_settings(call_timeout=4321.0)
    try:
        with SettingsReader.create_group().launch(cluster, name="settings_readers") as group:
            got = group.read().wait(timeout=60)[0]
    finally:
        update_settings(call_timeout=before.call_timeout)
    assert got["call_timeout"] == 4321.0
    # Workers pass on rlcomm's WARNING records by default and leave the root logger alone.
    assert got["log_level"] == "WARNING" and got["rlcomm_level"] == "WARNING"
    assert got["root_handlers"] == 0, "a worker configured the root logger"
