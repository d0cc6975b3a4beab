"""Authentication, ACL users and TLS against a real redis-server.

Each wrong setting (a wrong password, a user whose ACL forbids the cache's
keys, a server certificate from another CA) gives one clear error line, a
local-only cache and no crash; no password or secret appears in any log line
or stats field. The right settings share blocks as usual.
"""

from __future__ import annotations

import datetime
import ipaddress
import json
import logging

import pytest
from conftest import prompt
from redis_server import RedisServer
from test_remote_trust import BLOCK, run

from prefixcache import CacheConfig, PrefixCache

PASSWORD = "hunter2-but-longer"
SECRET = "a shared secret of the hosts"
# the ACL docs/remote.md recommends: the prefix's keys, the commands the cache sends
CACHE_ACL = (
    "resetkeys",
    "~prefixcache:*",
    "resetchannels",
    "-@all",
    "+get",
    "+set",
    "+zadd",
    "+zrem",
    "+zrange",
    "+zrangebylex",
    "+zrevrangebylex",
    "+zremrangebylex",
    "+unlink",
    "+hincrby",
    "+hgetall",
    "+scan",
    "+dbsize",
    "+info",
    "+ping",
    "+cluster|slots",
)


def cache(tmp_path, name: str, url: str, model, **changes) -> PrefixCache:
    config = CacheConfig(
        block_size=BLOCK,
        ssd_dir=str(tmp_path / name),
        ssd_min_free_bytes=0,
        remote_url=url,
        remote_secret=SECRET,
        prefill_tokens_per_s=1,
        **changes,
    )
    return PrefixCache(model, config, model_id="tiny")


def shared(tmp_path, model, url: str, **changes) -> tuple[int, dict]:
    """Host a stores a prompt, host b fetches it: (tokens b restored, b's stats)."""
    tokens = prompt(7, 3 * BLOCK + 1)
    with cache(tmp_path, "a", url, model, **changes) as a:
        run(a, model, tokens)
    with cache(tmp_path, "b", url, model, **changes) as b:
        cached, _ = run(b, model, tokens)
        assert b.fetch(tokens)[1] == 3 * BLOCK  # local tiers serve whatever happens remotely
        return cached, b.stats()


def errors_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]


def assert_nothing_leaks(caplog, stats: dict) -> None:
    text = "\n".join(r.getMessage() for r in caplog.records) + json.dumps(stats)
    assert PASSWORD not in text and SECRET not in text


@pytest.fixture
def password_server(tmp_path):
    server = RedisServer(
        str(tmp_path), args=("--requirepass", PASSWORD), admin={"password": PASSWORD}
    )
    admin = server.client()
    admin.execute_command("ACL", "SETUSER", "cache", "on", f">{PASSWORD}", *CACHE_ACL)
    admin.execute_command("ACL", "SETUSER", "other", "on", f">{PASSWORD}", "~other:*", "+@all")
    yield server
    server.stop()


def test_the_right_password_and_a_restricted_acl_user_share_blocks(
    tmp_path, llama, password_server
):
    port = password_server.port
    for url in (
        f"redis://:{PASSWORD}@127.0.0.1:{port}",
        f"redis://cache:{PASSWORD}@127.0.0.1:{port}",
    ):
        password_server.client().flushall()
        cached, stats = shared(tmp_path / url.split(":")[1][2:], llama, url)
        assert cached == 3 * BLOCK and stats["remote"]["off"] == 0


@pytest.mark.parametrize(
    ("user", "password", "message"),
    [
        ("", "wrong-password", "refused the login"),
        ("nobody", PASSWORD, "refused the login"),
        ("", "", "needs a password and remote_url gives none"),
        ("other", PASSWORD, "may not use the cache's keys"),
    ],
    ids=["wrong-password", "unknown-user", "no-password", "user-without-rights"],
)
def test_a_refused_client_logs_one_clear_line_and_stays_local(
    tmp_path, llama, password_server, caplog, user, password, message
):
    caplog.set_level(logging.DEBUG)
    auth = f"{user}:{password}@" if user or password else ""
    url = f"redis://{auth}127.0.0.1:{password_server.port}"
    cached, stats = shared(tmp_path, llama, url)
    assert cached == 0 and stats["remote"]["off"] == 1
    lines = errors_of(caplog)  # one line per cache: host a's, then host b's
    assert len(lines) == 2
    for line in lines:
        assert message in line and "remote tier off" in line and "local-only" in line
        assert "***" in line or not password
    assert_nothing_leaks(caplog, stats)
    assert password_server.client().dbsize() == 0


def make_ca(name: str):
    from cryptography import x509
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    cert = _builder(subject, subject, key.public_key()).add_extension(
        x509.BasicConstraints(ca=True, path_length=None), critical=True
    )
    return key, cert.sign(key, _sha256())


def make_leaf(ca, name: str):
    from cryptography import x509
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    ca_key, ca_cert = ca
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    alt = x509.SubjectAlternativeName(
        [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]
    )
    cert = _builder(subject, ca_cert.subject, key.public_key()).add_extension(alt, False)
    return key, cert.sign(ca_key, _sha256())


def _builder(subject, issuer, public_key):
    from cryptography import x509

    now = datetime.datetime.now(datetime.timezone.utc)
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
    )


def _sha256():
    from cryptography.hazmat.primitives import hashes

    return hashes.SHA256()


def write_pem(path, pair) -> tuple[str, str]:
    from cryptography.hazmat.primitives import serialization

    key, cert = pair
    key_file, cert_file = path.with_suffix(".key"), path.with_suffix(".crt")
    key_file.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return str(cert_file), str(key_file)


@pytest.fixture
def tls_server(tmp_path):
    ca = make_ca("prefixcache test CA")
    files = {"ca": write_pem(tmp_path / "ca", ca)[0]}
    files["cert"], files["key"] = write_pem(tmp_path / "server", make_leaf(ca, "server"))
    files["client_cert"], files["client_key"] = write_pem(tmp_path / "client", make_leaf(ca, "c"))
    files["other_ca"] = write_pem(tmp_path / "other", make_ca("another CA"))[0]
    server = RedisServer(str(tmp_path), tls=files)
    server.files = files
    yield server
    server.stop()


def test_tls_with_the_right_ca_and_a_client_certificate(tmp_path, llama, tls_server):
    files = tls_server.files
    assert tls_server.url.startswith("rediss://")
    cached, stats = shared(tmp_path / "ca", llama, tls_server.url, remote_tls_ca=files["ca"])
    assert cached == 3 * BLOCK and stats["remote"]["off"] == 0
    tls_server.client().flushall()
    cached, _ = shared(
        tmp_path / "cert",
        llama,
        tls_server.url,
        remote_tls_ca=files["ca"],
        remote_tls_cert=files["client_cert"],
        remote_tls_key=files["client_key"],
    )
    assert cached == 3 * BLOCK


def test_a_server_certificate_of_another_ca_logs_one_clear_line(
    tmp_path, llama, tls_server, caplog
):
    caplog.set_level(logging.DEBUG)
    cached, stats = shared(
        tmp_path, llama, tls_server.url, remote_tls_ca=tls_server.files["other_ca"]
    )
    assert cached == 0 and stats["remote"]["off"] == 1
    line, other = errors_of(caplog)  # one line per cache
    assert line == other and "TLS certificate does not verify" in line and "local-only" in line
    assert_nothing_leaks(caplog, stats)


def test_tls_settings_are_checked(tmp_path):
    ca = tmp_path / "ca.crt"
    ca.write_text("x")
    with pytest.raises(ValueError, match="does not use TLS"):
        CacheConfig(remote_url="redis://h:1", remote_tls_ca=str(ca))
    with pytest.raises(ValueError, match="remote_tls_ca must name an existing file"):
        CacheConfig(remote_url="rediss://h:1", remote_tls_ca=str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="remote_tls_key is set without remote_tls_cert"):
        CacheConfig(remote_url="rediss://h:1", remote_tls_key=str(ca))
    config = CacheConfig.from_env({"PREFIXCACHE_REMOTE_TLS_CA": str(ca)}, remote_url="rediss://h:1")
    assert config.remote_tls_ca == str(ca)
