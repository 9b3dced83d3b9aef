"""Failures shown to users are one line: the exception's first line and where it arose."""

from opentinker.core.errors import one_line, reason_line


def _raise(message: str) -> None:
    raise RuntimeError(message)


def test_a_local_exception_reads_as_its_type_message_and_frame():
    try:
        _raise("\x1b[31mdisk full\x1b[0m\nmore detail")
    except RuntimeError as err:
        assert one_line(err) == "RuntimeError: disk full (at test_errors._raise:7)"


def test_a_prefect_failure_message_loses_its_prefixes_colour_and_extra_lines():
    message = "Flow run encountered an exception: JobError: job j: \x1b[36mValueError: bad\x1b[39m\n  File ...\n"
    assert reason_line(message) == "job j: ValueError: bad"
    assert reason_line(None) is None
