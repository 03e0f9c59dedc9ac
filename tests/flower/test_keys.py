"""lightning-dp flower-keys (lightning_dp/flower/keys.py): the CA and the SuperLink's certificate verify as a chain
for the named hosts, the node keys are what Flower 1.42 loads, secrets are created private, nothing is overwritten,
bad input is refused with the fix. The app's tracking URI and the server's insecure warning (issue 52)."""

from __future__ import annotations

import ipaddress
import stat
import sys
from pathlib import Path

import pytest

pytest.importorskip("cryptography")

from cryptography import x509  # noqa: E402
from cryptography.hazmat.primitives import serialization  # noqa: E402
from cryptography.hazmat.primitives.asymmetric import ec  # noqa: E402

from lightning_dp.flower import keys  # noqa: E402

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_the_superlink_certificate_is_signed_by_the_ca_for_the_named_hosts(tmp_path):
    written = keys.write_server(tmp_path, ["link.example.org", "10.0.0.7"], days=30, name="consortium")
    assert sorted(p.name for p in written) == sorted([keys.CA_CERT, keys.CA_KEY, keys.SERVER_CERT, keys.SERVER_KEY])
    ca = x509.load_pem_x509_certificate((tmp_path / keys.CA_CERT).read_bytes())
    server = x509.load_pem_x509_certificate((tmp_path / keys.SERVER_CERT).read_bytes())
    server.verify_directly_issued_by(ca)  # raises if the signature or the issuer do not match
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    assert not server.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    san = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert set(san.get_values_for_type(x509.DNSName)) == {"link.example.org", "localhost"}
    assert set(san.get_values_for_type(x509.IPAddress)) == {ipaddress.ip_address(a) for a in
                                                            ("10.0.0.7", "127.0.0.1", "::1")}
    life = server.not_valid_after_utc - server.not_valid_before_utc
    assert 30 <= life.days <= 31
    # the server's key is the certificate's
    key = serialization.load_pem_private_key((tmp_path / keys.SERVER_KEY).read_bytes(), None)
    assert key.public_key().public_numbers() == server.public_key().public_numbers()


def test_a_sites_key_pair_is_an_openssh_nist_key_flower_loads(tmp_path):
    private, public = keys.write_site(tmp_path, "hospital-a")
    assert private == tmp_path / "hospital-a" / keys.NODE_KEY and public.name == keys.NODE_PUB
    # what flower-supernode --auth-supernode-private-key and flwr supernode register load
    key = serialization.load_ssh_private_key(private.read_bytes(), None)
    assert isinstance(key, ec.EllipticCurvePrivateKey) and key.curve.name == "secp384r1"
    pub = serialization.load_ssh_public_key(public.read_bytes())
    assert pub.public_numbers() == key.public_key().public_numbers()
    assert public.read_text().rstrip().endswith(" hospital-a")
    from flwr.supercore.primitives.asymmetric import uses_nist_ec_curve

    assert uses_nist_ec_curve(pub)
    other = serialization.load_ssh_private_key(keys.write_site(tmp_path, "hospital-b")[0].read_bytes(), None)
    assert other.private_numbers().private_value != key.private_numbers().private_value


def test_secrets_are_private_public_files_readable_and_nothing_is_overwritten(tmp_path):
    keys.write_server(tmp_path, ["127.0.0.1"])
    keys.write_site(tmp_path, "a")
    for path in tmp_path.rglob("*"):
        if path.is_file():
            mode = stat.S_IMODE(path.stat().st_mode)
            assert mode == (0o600 if path.suffix == ".key" else 0o644), (path, oct(mode))
    before = (tmp_path / keys.CA_KEY).read_bytes()
    with pytest.raises(ValueError, match="never overwrites"):
        keys.write_server(tmp_path, ["127.0.0.1"])
    with pytest.raises(ValueError, match="never overwrites"):
        keys.write_site(tmp_path, "a")
    assert (tmp_path / keys.CA_KEY).read_bytes() == before


@pytest.mark.parametrize("bad, match", [(["link.example.org:8000"], "not a host name"), ([], "no --server-host"),
                                        (["a b"], "not a host name")])
def test_bad_hosts_are_refused_before_anything_is_written(tmp_path, bad, match):
    with pytest.raises(ValueError, match=match):
        keys.write_server(tmp_path / "k", bad)
    assert not (tmp_path / "k").exists()


@pytest.mark.parametrize("bad", ["", "..", "a/b", "-x", "two words"])
def test_bad_site_names_are_refused(tmp_path, bad):
    with pytest.raises(ValueError, match="plain name"):
        keys.write_site(tmp_path, bad)


def test_the_command_writes_what_it_says_and_refuses_bad_input(tmp_path, capsys):
    from lightning_dp.cli import main

    assert main(["flower-keys", "--out", str(tmp_path), "--server-host", "127.0.0.1", "--site", "s1",
                 "--site", "s2"]) == 0
    out = capsys.readouterr().out
    assert out.count("wrote ") == 8 and out.count("(secret: stays on this machine)") == 4
    for argv, match in ((["--out", str(tmp_path / "x")], "nothing to make"),
                        (["--out", str(tmp_path / "y"), "--site", "a", "--site", "a"], "named twice"),
                        (["--out", str(tmp_path / "z"), "--server-host", "127.0.0.1", "--days", "0"], "days=0"),
                        (["--out", str(tmp_path), "--site", "s1"], "never overwrites")):
        with pytest.raises(SystemExit) as err:
            main(["flower-keys", *argv])
        assert err.value.code == 2 and match in capsys.readouterr().err


def test_the_apps_tracking_uri_is_carried_and_credentials_are_refused(tmp_path, monkeypatch):
    import tomllib

    from lightning_dp.flower.app import write_app

    monkeypatch.setattr(sys, "argv", ["lightning-dp"])
    path = write_app(EXAMPLES / "fl_deploy_fedavg.yaml", tmp_path / "app", tracking_uri="http://mlflow.internal:5000")
    assert tomllib.loads(path.read_text())["tool"]["flwr"]["app"]["config"]["tracking-uri"] == \
        "http://mlflow.internal:5000"
    with pytest.raises(ValueError, match="credentials") as err:
        write_app(EXAMPLES / "fl_deploy_fedavg.yaml", tmp_path / "app2", tracking_uri="https://u:hunter2@host/")
    assert "hunter2" not in str(err.value)  # the refusal does not echo the password
    assert not (tmp_path / "app2").exists()


def test_the_server_refuses_a_config_that_records_elsewhere_than_the_app_says(tmp_path, monkeypatch):
    from lightning_dp.flower.build import build_from_yaml
    from lightning_dp.flower.server import check_tracking

    monkeypatch.chdir(tmp_path)
    uri = f"sqlite:///{tmp_path}/a.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    cli = build_from_yaml((EXAMPLES / "fl_deploy_fedavg.yaml").read_text(), [])
    check_tracking(cli.trainer, uri)  # the logger follows the environment the server set
    with pytest.raises(ValueError, match="give the location once"):
        check_tracking(cli.trainer, f"sqlite:///{tmp_path}/b.db")


def test_the_server_reads_an_insecure_superlink_from_its_process_arguments(monkeypatch):
    from lightning_dp.flower import server

    monkeypatch.setattr(sys, "argv", ["flwr-serverapp", "--insecure", "--runtime-api-address", "127.0.0.1:8000"])
    assert server.insecure_superlink()
    monkeypatch.setattr(sys, "argv", ["flwr-serverapp", "--root-certificates", "ca.pem", "--runtime-api-address",
                                      "127.0.0.1:8000"])
    assert not server.insecure_superlink()
