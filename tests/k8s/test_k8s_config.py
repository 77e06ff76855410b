"""What the pods run loads with `runbook` itself: the ConfigMap's configuration, the
Deployment's arguments parsed by the runbook CLI, and `runbook serve`'s start-up
(store, catalogs, app) on that configuration."""

from __future__ import annotations

from pathlib import Path, PurePosixPath

import pytest
from vllm_runbook.runbooks.operate.cli import build_parser, main
from vllm_runbook.runbooks.service.serve_cli import cmd_serve

from tests.k8s.manifests import OVERLAYS, container, one, pod_spec, render


def _configuration(objects: list[dict]) -> tuple[str, str]:
    """(path the pod reads the configuration from, its text)."""
    serve = container(objects)
    args = build_parser().parse_args(serve["args"])
    config_path = PurePosixPath(args.config)
    volumes = {v["name"]: v for v in pod_spec(objects)["volumes"]}
    mount = next(m for m in serve["volumeMounts"] if m["mountPath"] == str(config_path.parent))
    config_map = one(objects, "ConfigMap", volumes[mount["name"]]["configMap"]["name"])
    return str(config_path), config_map["data"][config_path.name]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_deployment_args_are_runbook_serve_on_the_service_port(overlay: str) -> None:
    objects = render(overlay)
    args = build_parser().parse_args(container(objects)["args"])
    assert args.func is cmd_serve
    assert args.host == "0.0.0.0"
    assert args.port == container(objects)["ports"][0]["containerPort"] == 8080
    assert args.db is None  # RUNBOOK_DB_URL, from the Secret
    assert args.no_rules is (overlay != "minimal")
    assert args.no_worker is False


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_configuration_passes_runbook_rules_check(
    overlay: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _, text = _configuration(render(overlay))
    path = tmp_path / "runbook.yaml"
    path.write_text(text, encoding="utf-8")
    assert main(["rules", "check", "--config", str(path)]) == 0
    assert capsys.readouterr().out == "ok: 25 rules (23 alerts) in 5 files\n"


def test_the_webhook_token_file_is_the_mounted_secret(tmp_path: Path) -> None:
    from vllm_runbook.runbooks.model.config import load_config

    objects = render("default")
    config_path, text = _configuration(objects)
    assert config_path == "/etc/vllm-runbook/runbook.yaml"
    serve = container(objects)
    secrets = next(m for m in serve["volumeMounts"] if m["name"] == "secrets")
    volume = {v["name"]: v for v in pod_spec(objects)["volumes"]}["secrets"]
    (item,) = volume["secret"]["items"]
    path = tmp_path / "runbook.yaml"
    path.write_text(text, encoding="utf-8")
    config = load_config(path)
    assert config.webhook.token_file == Path(secrets["mountPath"]) / item["path"]
    assert config.database is None  # the DSN is the Secret's, never the ConfigMap's
    assert config.engines == ()


@pytest.mark.parametrize("overlay", ["default", "minimal"])
def test_runbook_serve_starts_on_the_rendered_configuration(overlay: str, tmp_path: Path) -> None:
    """serve's own start-up (config, migrated store, rule and runbook catalogs,
    credentials, app) with the pod's arguments; only the Secret's paths are
    local. The probes' path answers, the webhook wants the Secret's token."""
    from fastapi.testclient import TestClient
    from vllm_runbook.runbooks.service.serve_cli import build

    objects = render(overlay)
    _, text = _configuration(objects)
    token = tmp_path / "webhook-token"
    token.write_text("a-token\n", encoding="utf-8")
    path = tmp_path / "runbook.yaml"
    path.write_text(
        text.replace("/var/run/secrets/vllm-runbook/webhook-token", str(token)), encoding="utf-8"
    )
    serve = container(objects)
    args = build_parser().parse_args(serve["args"])
    service = build(
        str(path), f"sqlite:///{tmp_path / 'runbook.db'}", args.host, worker=False,
        rules=not args.no_rules,
    )  # fmt: skip
    store = service.store
    try:
        assert service.worker is None
        assert (
            service.leader is None
        )  # an empty inventory: nothing for the embedded rules to scrape
        with TestClient(service.app, base_url="http://127.0.0.1") as client:
            health = client.get(serve["readinessProbe"]["httpGet"]["path"])
            assert (health.status_code, health.json()) == (200, {"status": "ok"})
            hook = "/webhooks/alertmanager"
            assert client.post(hook, json={}).status_code == 401
            authorized = {"Authorization": "Bearer a-token"}
            assert client.post(hook, json={}, headers=authorized).status_code == 422
    finally:
        store.close()
