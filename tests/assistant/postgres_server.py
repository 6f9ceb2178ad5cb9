"""A throwaway PostgreSQL server for tests, from Debian's ``postgresql`` package: ``initdb`` into a temporary
directory, ``pg_ctl start`` listening only on a Unix socket in that directory (no TCP port to collide with),
trust authentication, fsync off; ``stop`` removes it all.

PostgreSQL refuses to run as root, and CI runs as root: then the server runs as ``nobody`` (the directory is
handed to that user; the tests still connect as the database user ``postgres`` over the socket). No user is
created and nothing outside the temporary directory is touched."""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import subprocess
import tempfile
from pathlib import Path

PG_BIN_ENV = "G4SERVE_PG_BIN"  # a directory holding initdb and pg_ctl, to use another PostgreSQL
SKIP_REASON = (
    "PostgreSQL tests need Debian's postgresql package (initdb and pg_ctl, found in "
    f"/usr/lib/postgresql/*/bin or ${PG_BIN_ENV}): apt-get install postgresql"
)
_PORT = 5432  # only names the socket file, in a directory of our own


def find_pg_bin() -> Path | None:
    """The directory of ``initdb`` and ``pg_ctl``: $G4SERVE_PG_BIN, PATH, then Debian's newest version."""
    candidates = [os.environ.get(PG_BIN_ENV)]
    on_path = shutil.which("initdb")
    if on_path:
        candidates.append(str(Path(on_path).resolve().parent))
    candidates += sorted(
        glob.glob("/usr/lib/postgresql/*/bin"), key=lambda d: int(Path(d).parent.name), reverse=True
    )
    for directory in filter(None, candidates):
        if all(os.access(Path(directory) / tool, os.X_OK) for tool in ("initdb", "pg_ctl", "postgres")):
            return Path(directory)
    return None


class PostgresServer:
    def __init__(self, bin_dir: Path):
        self.bin_dir = bin_dir
        self.root = Path(tempfile.mkdtemp(prefix="g4serve-pg-"))
        self.data = self.root / "data"
        self.log = self.root / "server.log"
        self._as: dict = {}
        if os.geteuid() == 0:
            nobody = pwd.getpwnam("nobody")
            os.chown(self.root, nobody.pw_uid, nobody.pw_gid)
            self._as = {"user": nobody.pw_uid, "group": nobody.pw_gid, "extra_groups": []}
        # The socket lives in the temporary directory; libpq takes a directory as the host.
        self.url = f"postgresql://postgres@/postgres?host={self.root}&port={_PORT}"

    def _run(self, *args: str, timeout_s: float = 120.0) -> None:
        env = {"PATH": f"{self.bin_dir}:/usr/bin:/bin", "LC_ALL": "C", "TZ": "UTC"}
        subprocess.run(
            [str(self.bin_dir / args[0]), *args[1:]],
            check=True,
            capture_output=True,
            timeout=timeout_s,
            cwd=self.root,
            env=env,
            **self._as,
        )

    def start(self) -> PostgresServer:
        try:
            initdb = ["-D", str(self.data), "-U", "postgres", "-A", "trust", "-E", "UTF8", "--locale=C"]
            self._run("initdb", *initdb, "--no-sync", "--no-instructions")
            options = (
                f"-c listen_addresses='' -k {self.root} -p {_PORT} -c fsync=off -c synchronous_commit=off "
                "-c full_page_writes=off -c max_connections=300"
            )
            self._run(
                "pg_ctl", "-D", str(self.data), "-l", str(self.log), "-w", "-t", "60", "-o", options, "start"
            )
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
            detail = getattr(exc, "stderr", b"") or b""
            log = self.log.read_text(errors="replace") if self.log.exists() else ""
            self.stop()
            raise RuntimeError(
                f"PostgreSQL did not start: {exc}\n{detail.decode(errors='replace')}\n{log}"
            ) from exc
        return self

    def stop(self) -> None:
        if (self.data / "postmaster.pid").exists():
            try:
                self._run("pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "stop", timeout_s=60)
            except (subprocess.CalledProcessError, subprocess.TimeoutExpired):
                pass  # the directory goes anyway; a stray server dies with its data
        shutil.rmtree(self.root, ignore_errors=True)
