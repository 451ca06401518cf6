"""One tracking store for every machine: MLflow's server on PostgreSQL, started and stopped by one command.

    python -m qerl_pipeline.tracking_server start --folder /srv/qerl-store [--host 0.0.0.0] [--port 5000]
    export MLFLOW_TRACKING_URI=http://<this host>:5000       # the line ``start`` prints last, on stdout
    python -m qerl_pipeline.tracking_server stop --folder /srv/qerl-store

The embedded ``sqlite:///mlflow.db`` serves one process tree on one machine; trainings on several
machines need a store they all write, which is MLflow's tracking server on a database. The folder
is the whole store: ``postgres/`` (a PostgreSQL data folder, made by ``initdb`` on the first start),
``artifacts/`` (the server's ``--artifacts-destination``: clients upload and read artifacts through
the server, so no node needs the folder mounted), ``logs/`` and ``store.json`` (ports, PIDs, URIs).
A second start over the same folder reuses it (same data, same ports unless given): the runs logged
before are there. A start while both processes still run only prints the URI again.

PostgreSQL listens on 127.0.0.1 only, with trust authentication: its one client is the MLflow
server beside it. ``--database-uri`` takes an existing database instead (a managed PostgreSQL;
then only the MLflow server is started here). PostgreSQL refuses to run as root, so as root its
binaries run as the ``postgres`` user, who must be able to reach the folder; when it cannot, the
error names the closed folder above it. Every start waits with a timeout (``pg_ctl -w``; the
server's ``/health``); ``stop`` ends both by the PIDs recorded (SIGINT, PostgreSQL's fast
shutdown; SIGTERM to the MLflow server's process group), each waited for, SIGKILL past the timeout.
"""

from __future__ import annotations

import argparse
import json
import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from qerl_pipeline.atomic import write_atomic

DATABASE = "mlflow"
PG_USER = "qerl"  # the database role initdb makes (``-U``); trust authentication on 127.0.0.1
STATE = "store.json"


class StoreServerError(RuntimeError):
    """The store cannot be started or stopped: one line saying why and what to do."""


def _say(msg: str) -> None:
    print(f"[tracking-server] {msg}", file=sys.stderr, flush=True)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now (the OS's pick)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


# ----------------------------------------------------------------------------- processes
def _alive(pid: int | None, marker: str) -> bool:
    """Whether ``pid`` runs (not a zombie) and its command line holds ``marker`` (a PID reused by another
    program is not ours)."""
    if not pid:
        return False
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return False
    return stat.rsplit(")", 1)[-1].split()[0] != "Z" and marker in cmdline


def _end(pid: int, marker: str, sig: int, timeout_s: float, group: bool = False) -> None:
    """Send ``sig`` to ``pid`` (its process group with ``group``), wait ``timeout_s`` for it to exit, then SIGKILL."""
    kill = os.killpg if group else os.kill
    for s, wait in ((sig, timeout_s), (signal.SIGKILL, 10.0)):
        if not _alive(pid, marker):
            return
        try:
            kill(pid, s)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and _alive(pid, marker):
            time.sleep(0.1)
    if _alive(pid, marker):
        raise StoreServerError(f"process {pid} ({marker}) did not exit after SIGKILL")


# ----------------------------------------------------------------------------- PostgreSQL
def postmaster_pid(data: Path) -> int | None:
    """The PID of the PostgreSQL server of data folder ``data`` (its pid file's first line) while it runs."""
    try:
        pid = int((data / "postmaster.pid").read_text().split("\n", 1)[0])
    except (OSError, ValueError):
        return None
    return pid if _alive(pid, "postgres") else None


class Postgres:
    """The PostgreSQL server of one data folder, run as the ``postgres`` user when this process is root."""

    def __init__(self, data: Path, port: int, bin_dir: str | None = None):
        self.data, self.port = data, port
        self._bin = bin_dir
        self._as = None
        if os.geteuid() == 0:
            try:
                self._as = pwd.getpwnam("postgres")
            except KeyError:
                raise StoreServerError(
                    "PostgreSQL refuses to run as root and this machine has no postgres user: run this command as"
                    " another user, or add one (useradd --system postgres)"
                ) from None

    def _tool(self, name: str) -> str:
        found = shutil.which(name, path=self._bin) if self._bin else shutil.which(name)
        if not found:
            where = f"in {self._bin}" if self._bin else "on PATH"
            raise StoreServerError(
                f"PostgreSQL's {name} is not {where}: install PostgreSQL's server (Debian: apt-get install postgresql)"
                " and put its bin folder on PATH, or pass --pg-bin DIR"
            )
        return found

    def _run(self, args: list[str], timeout_s: float) -> None:
        cmd = [self._tool(args[0]), *args[1:]]
        if self._as is not None:
            cmd = (
                ["runuser", "-u", "postgres", "--", *cmd]
                if shutil.which("runuser")
                else ["su", "postgres", "-c", " ".join(cmd)]
            )
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            raise StoreServerError(f"{args[0]} did not finish within {timeout_s:.0f} s") from None
        if out.returncode != 0:
            tail = (out.stderr or out.stdout).strip().splitlines()[-1:] or ["no output"]
            raise StoreServerError(f"{' '.join(args[:2])} failed (exit {out.returncode}): {tail[0]}")

    def _give_to_postgres(self) -> None:
        """As root: the data folder belongs to the postgres user, and every folder above it lets that user pass."""
        self.data.mkdir(parents=True, exist_ok=True)
        os.chown(self.data, self._as.pw_uid, self._as.pw_gid)
        self.data.chmod(0o700)
        for parent in self.data.absolute().parents:
            st = parent.stat()
            if st.st_uid != self._as.pw_uid and not st.st_mode & 0o001:
                raise StoreServerError(
                    "PostgreSQL refuses to run as root, so it runs as the postgres user, who cannot reach"
                    f" {self.data}: {parent} is closed to it (mode {st.st_mode & 0o777:o}); choose a folder it can"
                    f" reach, or chmod o+x {parent}"
                )

    def init(self, timeout_s: float) -> bool:
        """``initdb`` when the data folder is not one yet; True when it made it."""
        if (self.data / "PG_VERSION").is_file():
            return False
        if self._as is not None:
            self._give_to_postgres()
        elif self.data.exists() and any(self.data.iterdir()):
            raise StoreServerError(f"{self.data} is neither empty nor a PostgreSQL data folder")
        self._run(["initdb", "-D", str(self.data), "-A", "trust", "-U", PG_USER, "-E", "UTF8"], timeout_s)
        return True

    def pid(self) -> int | None:
        return postmaster_pid(self.data)

    def start(self, log: Path, timeout_s: float) -> int:
        if self._as is not None:
            log.touch()
            os.chown(log, self._as.pw_uid, self._as.pw_gid)
        # 127.0.0.1 only, no Unix socket (a long data path overflows its 107-character limit)
        opts = f"-p {self.port} -c listen_addresses=127.0.0.1 -c unix_socket_directories=''"
        self._run(
            ["pg_ctl", "-D", str(self.data), "-l", str(log), "-o", opts, "-w", "-t", str(int(timeout_s)), "start"],
            timeout_s + 10,
        )
        pid = self.pid()
        if pid is None:
            raise StoreServerError(f"PostgreSQL did not start on port {self.port} (its log: {log})")
        return pid

    def ensure_database(self, timeout_s: float) -> None:
        import psycopg

        deadline = time.monotonic() + timeout_s
        while True:
            try:
                conn = psycopg.connect(
                    host="127.0.0.1",
                    port=self.port,
                    user=PG_USER,
                    dbname="postgres",
                    autocommit=True,
                    connect_timeout=5,
                )
                break
            except psycopg.OperationalError as err:
                if time.monotonic() > deadline:
                    raise StoreServerError(f"PostgreSQL on 127.0.0.1:{self.port} does not answer: {err}") from None
                time.sleep(0.2)
        with conn:
            if conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (DATABASE,)).fetchone() is None:
                conn.execute(f'CREATE DATABASE "{DATABASE}"')

    def uri(self) -> str:
        return f"postgresql+psycopg://{PG_USER}@127.0.0.1:{self.port}/{DATABASE}"


# ----------------------------------------------------------------------------- the MLflow server
def _healthy(url: str, timeout_s: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=timeout_s) as resp:
            return resp.status == 200
    except OSError:
        return False


def _client_url(host: str, port: int) -> str:
    """The URL clients use: the bound host, or this machine's name when it binds every interface."""
    if host in ("0.0.0.0", "::", ""):
        host = socket.getfqdn()
    return f"http://{host}:{port}"


def _start_mlflow(db_uri: str, artifacts: Path, host: str, port: int, log: Path, timeout_s: float) -> int:
    cmd = [
        sys.executable, "-m", "mlflow", "server", "--backend-store-uri", db_uri,
        "--artifacts-destination", str(artifacts), "--host", host, "--port", str(port), "--workers", "2",
    ]  # fmt: skip
    with open(log, "ab") as fh:
        proc = subprocess.Popen(
            cmd, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
        )
    local = f"http://127.0.0.1:{port}" if host in ("0.0.0.0", "::", "") else f"http://{host}:{port}"
    deadline = time.monotonic() + timeout_s
    while not _healthy(local):
        if proc.poll() is not None:
            tail = log.read_text(errors="replace").strip().splitlines()[-1:] or ["no output"]
            raise StoreServerError(f"mlflow server exited ({proc.returncode}) before answering on {local}: {tail[0]}")
        if time.monotonic() > deadline:
            _end(proc.pid, "mlflow", signal.SIGTERM, 10, group=True)
            raise StoreServerError(
                f"mlflow server did not answer on {local} within {timeout_s:.0f} s (its log: {log})"
            )
        time.sleep(0.5)
    return proc.pid


# ----------------------------------------------------------------------------- start / stop
def _read_state(folder: Path) -> dict:
    try:
        return json.loads((folder / STATE).read_text())
    except (OSError, ValueError):
        return {}


def start(
    folder: Path,
    *,
    host: str = "127.0.0.1",
    port: int | None = None,
    pg_port: int | None = None,
    database_uri: str | None = None,
    pg_bin: str | None = None,
    timeout_s: float = 120.0,
) -> dict:
    """Start (or reuse) the store in ``folder``; returns its state (``tracking_uri`` among it)."""
    folder = folder.absolute()
    folder.mkdir(parents=True, exist_ok=True)
    before = _read_state(folder)
    state = {
        "host": host,
        "port": port or before.get("port") or 5000,
        "pg_port": pg_port or before.get("pg_port") or free_port(),
        "database_uri": database_uri or before.get("external_database_uri"),
    }
    (folder / "logs").mkdir(exist_ok=True)
    (folder / "artifacts").mkdir(exist_ok=True)
    if state["database_uri"]:
        db_uri, pg_pid = state["database_uri"], None
    else:
        pg = Postgres(folder / "postgres", state["pg_port"], pg_bin)
        pg_pid = pg.pid()
        if pg_pid is not None and pg_port is None:
            state["pg_port"] = before.get("pg_port", state["pg_port"])
        else:
            if pg.init(timeout_s):
                _say(f"made a PostgreSQL data folder in {pg.data}")
            pg_pid = pg.start(folder / "logs" / "postgres.log", timeout_s)
            _say(f"PostgreSQL started on 127.0.0.1:{pg.port} (PID {pg_pid})")
        pg.ensure_database(timeout_s)
        db_uri = pg.uri()
    mlflow_pid = before.get("mlflow_pid")
    if _alive(mlflow_pid, "mlflow") and before.get("port") == state["port"] and before.get("host") == host:
        _say(f"mlflow server already running (PID {mlflow_pid})")
    else:
        mlflow_pid = _start_mlflow(
            db_uri, folder / "artifacts", host, state["port"], folder / "logs" / "mlflow.log", timeout_s
        )
        _say(f"mlflow server started on {host}:{state['port']} (PID {mlflow_pid}), its store {db_uri}")
    state.update(
        pg_pid=pg_pid,
        mlflow_pid=mlflow_pid,
        backend_store_uri=db_uri,
        external_database_uri=database_uri or before.get("external_database_uri"),
        artifacts=str(folder / "artifacts"),
        tracking_uri=_client_url(host, state["port"]),
    )
    state.pop("database_uri")
    write_atomic(folder / STATE, state, as_json=True)
    return state


def stop(folder: Path, timeout_s: float = 60.0) -> list[str]:
    """End the MLflow server and PostgreSQL of ``folder`` by their PIDs; what was stopped."""
    folder = folder.absolute()
    state = _read_state(folder)
    if not state:
        raise StoreServerError(f"no tracking store in {folder} ({STATE} missing): nothing to stop")
    stopped = []
    pid = state.get("mlflow_pid")
    if _alive(pid, "mlflow"):
        _end(pid, "mlflow", signal.SIGTERM, timeout_s, group=True)
        stopped.append(f"mlflow server (PID {pid})")
    if not state.get("external_database_uri"):
        pg_pid = postmaster_pid(folder / "postgres")
        if pg_pid is not None:
            _end(pg_pid, "postgres", signal.SIGINT, timeout_s)
            stopped.append(f"PostgreSQL (PID {pg_pid})")
    return stopped


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m qerl_pipeline.tracking_server", description=__doc__.split("\n")[0]
    )
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("start", help="start (or reuse) the store in FOLDER; prints the MLFLOW_TRACKING_URI to export")
    down = sub.add_parser("stop", help="stop the store's MLflow server and PostgreSQL by their PIDs")
    for p in (up, down):
        p.add_argument("--folder", type=Path, required=True, help="the store: PostgreSQL data, artifacts, logs")
    up.add_argument("--host", default="127.0.0.1", help="the MLflow server's interface (0.0.0.0: every one)")
    up.add_argument("--port", type=int, help="the MLflow server's port (default: the folder's last, else 5000)")
    up.add_argument(
        "--pg-port", type=int, help="PostgreSQL's port on 127.0.0.1 (default: the folder's last, else free)"
    )
    up.add_argument("--database-uri", help="an existing database (postgresql+psycopg://...) instead of one in FOLDER")
    up.add_argument("--pg-bin", help="the folder of PostgreSQL's initdb and pg_ctl (default: PATH)")
    for p in (up, down):
        p.add_argument("--timeout", type=float, default=120.0, help="seconds each start or stop may take")
    args = parser.parse_args(argv)
    try:
        if args.command == "start":
            state = start(
                args.folder,
                host=args.host,
                port=args.port,
                pg_port=args.pg_port,
                database_uri=args.database_uri,
                pg_bin=args.pg_bin,
                timeout_s=args.timeout,
            )
            print(f"export MLFLOW_TRACKING_URI={state['tracking_uri']}", flush=True)
        else:
            stopped = stop(args.folder, args.timeout)
            _say(f"stopped {', '.join(stopped)}" if stopped else f"nothing was running in {args.folder.absolute()}")
    except StoreServerError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
