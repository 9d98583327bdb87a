"""Process logging: a rotating file in the configured log dir, plus the console where asked."""
from __future__ import annotations

import logging
import sys
from logging.handlers import RotatingFileHandler

from config.schema import LoggingSection

FORMAT = "%(asctime)s %(levelname)s %(processName)s %(name)s: %(message)s"


def setup_logging(section: LoggingSection, filename: str, console: bool = False) -> logging.Logger:
    """Log to {dir}/{filename}; the previous run's file is rolled to .1 first, never truncated."""
    section.dir.mkdir(parents=True, exist_ok=True)
    path = section.dir / filename
    handler = RotatingFileHandler(path, maxBytes=section.max_bytes,
                                  backupCount=section.backup_count, encoding="utf-8")
    if path.stat().st_size > 0:
        handler.doRollover()
    handlers: list[logging.Handler] = [handler]
    if console:
        handlers.append(logging.StreamHandler(sys.stderr))
    formatter = logging.Formatter(FORMAT)
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    for h in handlers:
        h.setFormatter(formatter)
        root.addHandler(h)
    root.setLevel(section.level)
    return logging.getLogger(filename.rsplit(".", 1)[0])
