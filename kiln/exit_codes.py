"""The ``kiln`` command's exit status for every error code: the table lives in
``schemas.exit_codes``, shared with the entry points ``kiln`` starts as processes."""

from schemas.exit_codes import (
    EXIT_CODES,
    JOB_UNSUCCESSFUL,
    OK,
    TABLE_BEGIN,
    TABLE_END,
    USAGE,
    exit_code,
    markdown_table,
)

__all__ = ["EXIT_CODES", "JOB_UNSUCCESSFUL", "OK", "TABLE_BEGIN", "TABLE_END", "USAGE",
           "exit_code", "markdown_table"]
