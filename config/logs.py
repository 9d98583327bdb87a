"""Process logging: a rotating file in the configured log dir, plus the console where asked."""

from __future__ import annotations

import logging
import re
import sys
from collections.abc import Sequence
from logging.handlers import RotatingFileHandler
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator

from config.base import Section, resolve_path

FORMAT = "%(asctime)s %(levelname)s %(processName)s %(name)s: %(message)s"
# Credentials a log line could carry: the dashboard's ?api_key= in an access-log line, a bearer token.
CREDENTIAL_PATTERNS = re.compile(r"(api_key=)[^&\s\"']+|(Bearer\s+)\S+", re.IGNORECASE)
REDACTED = "***"


class LoggingSection(Section):
    """Each process's log file: its folder, level and rotation."""

    dir: Path = Path("output")
    level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    max_bytes: int = Field(10 * 1024 * 1024, ge=1024)
    backup_count: int = Field(5, ge=1)

    @field_validator("dir")
    @classmethod
    def _absolute(cls, path: Path) -> Path:
        return resolve_path(path)


class RedactSecrets(logging.Filter):
    """Masks credentials in every record before any handler writes it."""

    def __init__(self, secrets: list[str]):
        super().__init__()
        self.secrets = [s for s in secrets if s]

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        masked = CREDENTIAL_PATTERNS.sub(lambda m: (m.group(1) or m.group(2)) + REDACTED, message)
        for secret in self.secrets:
            masked = masked.replace(secret, REDACTED)
        if masked != message:
            record.msg, record.args = masked, None
        return True


def agent_log_filename(rank: int) -> str:
    return f"agent_{rank}.log"


def setup_logging(
    section: LoggingSection, filename: str, console: bool = False, secrets: Sequence[str] = ()
) -> logging.Logger:
    """Log to {dir}/{filename}; the previous run's file is rolled to .1 first, never truncated.
    `secrets` (API keys) never reach a log line."""
    section.dir.mkdir(parents=True, exist_ok=True)
    path = section.dir / filename
    handler = RotatingFileHandler(
        path, maxBytes=section.max_bytes, backupCount=section.backup_count, encoding="utf-8"
    )
    if path.stat().st_size > 0:
        handler.doRollover()
    handlers: list[logging.Handler] = [handler]
    if console:
        handlers.append(logging.StreamHandler(sys.stderr))
    formatter = logging.Formatter(FORMAT)
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    redact = RedactSecrets(list(secrets))
    for h in handlers:
        h.setFormatter(formatter)
        h.addFilter(redact)
        root.addHandler(h)
    root.setLevel(section.level)
    return logging.getLogger(filename.rsplit(".", 1)[0])
