"""`python -m eagle_jax.serve`'s flags, without loading a model: the GIL switch interval."""

import sys

import pytest

pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")

from eagle_jax.serve import __main__ as serve_cli  # noqa: E402
from eagle_jax.serve import server  # noqa: E402


def test_the_switch_interval_defaults_to_half_a_millisecond_and_takes_seconds():
    assert serve_cli.parse_args([]).gil_switch_interval == 0.0005
    assert serve_cli.parse_args(["--gil-switch-interval", "0.002"]).gil_switch_interval == 0.002


@pytest.mark.parametrize("value", ["0", "-0.001", "2", "fast"])
def test_a_bad_switch_interval_is_refused(value, capsys):
    with pytest.raises(SystemExit) as exit_info:
        serve_cli.parse_args(["--gil-switch-interval", value])
    assert exit_info.value.code == 2
    assert "--gil-switch-interval" in capsys.readouterr().err


def test_the_server_sets_the_switch_interval_before_it_serves(monkeypatch, tmp_path):
    """And hands its app the profile directory, which adds the profile routes."""
    seen = {}
    monkeypatch.setattr(serve_cli, "build", lambda args: (object(), "tiny"))
    monkeypatch.setattr(server, "create_app",
                        lambda backend, name, profile_dir: seen.setdefault("profile_dir", profile_dir))
    monkeypatch.setattr(uvicorn, "run", lambda app, **kwargs: seen.setdefault("interval", sys.getswitchinterval()))
    before = sys.getswitchinterval()
    try:
        assert serve_cli.serve(["--gil-switch-interval", "0.00125", "--profile-dir", str(tmp_path),
                                "--engine-in-process"]) == 0
    finally:
        sys.setswitchinterval(before)
    assert seen["interval"] == pytest.approx(0.00125)
    assert seen["profile_dir"] == str(tmp_path)
