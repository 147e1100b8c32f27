"""Fixtures for the gateway: a private PostgreSQL schema per use, and the CLI."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import sqlalchemy as sa

POSTGRES = "postgresql://postgres@127.0.0.1:5432/test"
REDIS = "redis://127.0.0.1:6379/0"


@contextmanager
def postgres_schema() -> Iterator[str]:
    """A database URL whose tables live in a fresh schema, dropped afterwards."""
    schema = f"ic_test_{uuid.uuid4().hex[:12]}"
    admin = sa.create_engine(POSTGRES.replace("postgresql://", "postgresql+psycopg://"))
    with admin.begin() as conn:
        conn.execute(sa.text(f"CREATE SCHEMA {schema}"))
    try:
        yield f"{POSTGRES}?options=-csearch_path%3D{schema}"
    finally:
        with admin.begin() as conn:
            conn.execute(sa.text(f"DROP SCHEMA {schema} CASCADE"))
        admin.dispose()


def cli(*args: str) -> Any:
    """Run `infercloud ARGS` and parse its JSON output."""
    out = subprocess.run(
        [sys.executable, "-m", "infercloud", *args], capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout)
