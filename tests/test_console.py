"""The trial's console: third-party messages kept off it, in trainer.log and counted (sftprof.console)."""
import logging
import os
import warnings

from sftprof import console


def test_native_profiler_lines_are_held_back_and_others_pass(capfd, caplog):
    before = console.kept_off()
    with caplog.at_level(logging.INFO, logger=console.THIRD_PARTY.name):
        with console.native_stderr_filtered():
            os.write(2, b"USDT:2026-12-01 14:37:11 19072:19072 SyncActivityProfilerHandler.cpp:52] profiler_start\n"
                        b"a native error line\n")
    assert capfd.readouterr().err == "a native error line\n"
    assert console.kept_off() == before + 1
    assert [r.getMessage() for r in caplog.records] == [
        "USDT:2026-12-01 14:37:11 19072:19072 SyncActivityProfilerHandler.cpp:52] profiler_start"]


def test_other_packages_warnings_go_to_the_log_only(caplog, monkeypatch):
    monkeypatch.setattr(warnings, "showwarning", warnings.showwarning)   # restored after the test
    console.capture_warnings()
    before = console.kept_off()
    handler = logging.StreamHandler()
    handler.addFilter(console.ConsoleFilter())
    with caplog.at_level(logging.INFO):
        warnings.warn_explicit("deprecated", FutureWarning, "/site-packages/transformers/x.py", 3)
        warnings.warn_explicit("ours", UserWarning, os.path.join(console.PACKAGE_DIR, "trainer.py"), 5)
    third, ours = caplog.records
    assert (third.name, console.kept_off()) == ("sftprof.third_party", before + 1)
    assert "FutureWarning: deprecated" in third.getMessage() and not handler.filter(third)
    assert (ours.name, ours.levelname) == ("sftprof", "WARNING") and handler.filter(ours)
    assert console.summary_line().startswith(f"{console.kept_off()} third-party message(s)")
