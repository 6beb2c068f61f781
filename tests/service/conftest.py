"""``shardflow serve --flight-port`` as users run it: a real process serving a real embedded
cluster, with users made by the real ``shardflow user add``; the tests are its clients."""

from __future__ import annotations

import queue
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pytest

SHARDFLOW = str(Path(sys.executable).parent / "shardflow")
PASSWORDS = {"alice": "alice-pw", "bob": "bob-pw", "olga": "olga-pw"}
ROLES = {"alice": "reader", "bob": "writer", "olga": "operator"}
START_TIMEOUT_S = 180


def shardflow_cli(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [SHARDFLOW, *args], input=stdin, capture_output=True, text=True, timeout=300
    )


@dataclass
class Served:
    process: subprocess.Popen[str]
    uri: str
    data_dir: Path
    output: list[str] = field(default_factory=list)

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.process.kill()
            raise
        finally:
            if self.process.stdout is not None:
                self.process.stdout.close()


def add_users(data_dir: Path) -> None:
    for name, role in ROLES.items():
        made = shardflow_cli(
            "user", "add", name, "--role", role, "--password-stdin", "--data-dir", str(data_dir),
            stdin=PASSWORDS[name] + "\n",
        )  # fmt: skip
        assert made.returncode == 0, made.stdout + made.stderr


def start_service(data_dir: Path, *extra: str, workers: int | None = 2) -> Served:
    """Start ``shardflow serve`` and wait for the line that gives its Flight address."""
    sized = ["--workers", str(workers)] if workers else []
    process = subprocess.Popen(
        [SHARDFLOW, "serve", "--data-dir", str(data_dir), "--flight-port", "0", *sized, *extra],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    lines: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    served = Served(process, "", data_dir)
    while True:
        try:
            line = lines.get(timeout=START_TIMEOUT_S)
        except queue.Empty:
            served.stop()
            output = "".join(served.output)
            raise AssertionError(f"shardflow serve did not start:\n{output}") from None
        if line is None:
            raise AssertionError("shardflow serve exited:\n" + "".join(served.output))
        served.output.append(line)
        if "Flight SQL on " in line:
            served.uri = line.split("Flight SQL on ", 1)[1].split()[0]
            return served


def sample_table(rows: int = 2000) -> pa.Table:
    import datetime

    return pa.table(
        {
            "id": pa.array(range(rows), pa.int64()),
            "g": pa.array([i % 7 for i in range(rows)], pa.int64()),
            "s": [f"item-{i % 50}" for i in range(rows)],
            "x": [i * 0.5 for i in range(rows)],
            "d": [
                datetime.date(2024, 1, 1) + datetime.timedelta(days=i % 365) for i in range(rows)
            ],
        }
    )


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """One service with users alice (reader), bob (writer), olga (operator) and a table
    ``t`` (distributed by ``id``) made through the service by olga, who grants every
    privilege on it to every reader (and so to writers: roles still cap what they do)."""
    import shardflow

    data_dir = tmp_path_factory.mktemp("served")
    add_users(data_dir)
    service = start_service(data_dir)
    try:
        with shardflow.connect(service.uri, user="olga", password=PASSWORDS["olga"]) as db:
            db.create_table("t", sample_table(), distributed_by="id")
            db.sql("GRANT ALL ON t TO reader")
        yield service
    finally:
        code = service.stop()
    assert code == 0, "".join(service.output[-50:])


def self_signed(directory: Path) -> tuple[Path, Path]:
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.UTC)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert, private = directory / "cert.pem", directory / "key.pem"
    cert.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    private.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert, private
