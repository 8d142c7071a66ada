"""The run config (TETHER_CONFIG): every service takes its own section, below the environment and above
the defaults; unknown sections, unknown keys and bad values are refused naming `section.key`, by the
settings classes, by a real service process at start and by `tether config check`; every recipe passes
the check; the launcher's defaults yield to the config and the user's flags do not; compose mounts it.
(The chart's side: tests/deploy/test_chart_run_config.py.)"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from compose_helpers import compose_args, compose_env, mounts, run_compose
from pydantic import ValidationError
from test_settings import MINIMAL_ENV, _subclasses

from tether import cli
from tether.common.settings import CONFIG_ENV, SECTIONS, CommonSettings, RunConfigError
from tether.launcher import Stack
from tether.runconfig import check, settings_classes

ROOT = Path(__file__).resolve().parents[1]
RECIPES = sorted((ROOT / "recipes").glob("*.yaml"))

# One setting per section, set to a value other than its default.
SAMPLE = {
    "gateway": ("default_max_tokens", 123),
    "merger": ("realign_max", 3),
    "trainer": ("lr", 1.0e-6),
    "scheduler": ("steps", 7),
    "kube": ("agent_job_qps", 2.5),
    "inference": ("dtype", "bfloat16"),
    "agent": ("agent_concurrency", 3),
}
CLASSES = settings_classes()


def minimal(env, cls) -> None:
    for k, v in MINIMAL_ENV.get(cls, {}).items():
        env.setenv(k, v)


def write(tmp_path: Path, data) -> Path:
    p = tmp_path / "run.yaml"
    p.write_text(yaml.safe_dump(data) if not isinstance(data, str) else data)
    return p


def test_every_section_has_its_settings_class():
    assert set(CLASSES) == SECTIONS == set(SAMPLE)
    read = {c.config_section for c in _subclasses(CommonSettings) if c.config_section}
    assert read == SECTIONS  # no settings class outside the run config, none counted twice
    assert all(CLASSES[s].config_section == s for s in SECTIONS)


@pytest.mark.parametrize("section", sorted(SECTIONS))
def test_each_service_takes_its_section_below_the_environment(section, clean_env, tmp_path, caplog):
    cls = CLASSES[section]
    key, value = SAMPLE[section]
    assert cls.model_fields[key].default != value
    minimal(clean_env, cls)
    clean_env.setenv(CONFIG_ENV, str(write(tmp_path, {section: {key: value}})))
    assert getattr(cls(), key) == value
    var = f"TETHER_{key.upper()}"
    clean_env.setenv(var, "")  # compose's `${VAR:-}`: empty = unset, the config's value holds
    assert getattr(cls(), key) == value
    other = {"default_max_tokens": "9", "realign_max": "5", "lr": "0.5", "steps": "9"}.get(key, "4")
    if key == "dtype":
        other = "float16"
    clean_env.setenv(var, other)
    with caplog.at_level(logging.WARNING, logger="tether.settings"):
        got = getattr(cls(), key)
    assert str(got) == other or got == type(value)(other)  # the environment wins ...
    assert f"{var}={other} from the environment overrides {section}.{key}" in caplog.text  # ... loudly


def test_other_sections_and_run_keys_do_not_reach_a_service(clean_env, tmp_path):
    cls = CLASSES["merger"]
    minimal(clean_env, cls)
    clean_env.setenv(
        CONFIG_ENV, str(write(tmp_path, {"model": "m", "example": "coding", "trainer": {"lr": 0.5}}))
    )
    assert cls().realign_max == cls.model_fields["realign_max"].default


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        ({"trainer": {"lrr": 1e-6}}, "trainer.lrr: unknown setting"),
        ({"trainer": {"lr": "fast"}}, "trainer.lr: Input should be a valid number"),
        ({"trainer": {"loss_mode": "bogus"}}, "trainer.loss_mode: Input should be 'token-mean'"),
        ({"merger": {"realign_max": -1}}, "merger.realign_max: Input should be greater than or equal to 0"),
        ({"trainr": {"lr": 1e-6}}, "trainr: unknown section"),
        ({"trainer": [1, 2]}, "trainer: a section is a mapping of settings"),
        ("- just\n- a list\n", "a run config is a mapping of sections"),
        ("trainer: {lr: [\n", "not valid YAML"),
    ],
    ids=[
        "unknown-key",
        "bad-number",
        "bad-name",
        "bad-bound",
        "unknown-section",
        "not-a-mapping",
        "list",
        "yaml",
    ],
)
def test_a_bad_config_is_refused_naming_the_key(data, expected, clean_env, tmp_path):
    path = write(tmp_path, data)
    section = next(iter(data)) if isinstance(data, dict) else "trainer"
    cls = CLASSES.get(section, CLASSES["trainer"])
    minimal(clean_env, cls)
    clean_env.setenv(CONFIG_ENV, str(path))
    with pytest.raises(RunConfigError) as exc:
        cls()
    assert expected in str(exc.value) and str(path) in str(exc.value)
    assert any(expected in p for p in check(path))  # the checker says the same, starting nothing


def test_a_missing_file_is_refused(clean_env, tmp_path):
    minimal(clean_env, CLASSES["merger"])
    clean_env.setenv(CONFIG_ENV, str(tmp_path / "nope.yaml"))
    with pytest.raises(RunConfigError, match="cannot read the run config"):
        CLASSES["merger"]()


def test_validators_across_fields_run_in_the_check(tmp_path):
    assert check(write(tmp_path, {"trainer": {"mask_low": 3}})) == [
        "trainer.(section): Value error, need 0 < mask_low <= 1 <= mask_high"
    ]
    # Without the check's placeholders the required wiring would be the complaint; the class agrees:
    with pytest.raises(ValidationError):
        CLASSES["trainer"](trainer_grpc_port=0, model_dir="m", checkpoint_dir="c", mask_low=3)


@pytest.mark.parametrize(("value", "read"), [(True, "on"), (False, "off"), ("yes", "on"), ("auto", "auto")])
def test_the_check_takes_what_the_service_takes(value, read, clean_env, tmp_path):
    """A value the service coerces (true for on) passes the check too: the check reads each key by the
    field's type, so the coercion lives in the type."""
    path = write(tmp_path, {"trainer": {"gradient_checkpointing": value}})
    assert check(path) == []
    minimal(clean_env, CLASSES["trainer"])
    clean_env.setenv(CONFIG_ENV, str(path))
    assert CLASSES["trainer"]().gradient_checkpointing == read


def test_the_check_refuses_what_the_service_refuses(tmp_path):
    assert check(write(tmp_path, {"trainer": {"gradient_checkpointing": "sometimes"}})) == [
        "trainer.gradient_checkpointing: Input should be 'auto', 'on' or 'off' (got 'sometimes')"
    ]


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_every_recipe_passes_the_check(recipe):
    assert check(recipe) == []


def test_config_check_command(tmp_path, capsys):
    bad = write(tmp_path, {"trainer": {"lrr": 1}, "merger": {"advantage_estimator": "bogus"}})
    with pytest.raises(SystemExit) as exc:
        cli.main(["config", "check", str(RECIPES[0]), str(bad)])
    assert exc.value.code == 1
    out = capsys.readouterr().out
    assert f"{RECIPES[0]}: ok" in out
    assert f"{bad}: trainer.lrr: unknown setting" in out
    assert f"{bad}: merger.advantage_estimator: Input should be" in out
    with pytest.raises(SystemExit) as exc:
        cli.main(["config", "values", str(RECIPES[0])])
    assert exc.value.code == 0
    assert yaml.safe_load(capsys.readouterr().out) == {"runConfig": yaml.safe_load(RECIPES[0].read_text())}


def test_the_merger_process_refuses_a_bad_config_at_start(tmp_path):
    path = write(tmp_path, {"merger": {"realign_maxx": 2, "advantage_estimator": "bogus"}})
    env = {k: v for k, v in os.environ.items() if not k.startswith("TETHER_")}
    env.update(MINIMAL_ENV[CLASSES["merger"]], TETHER_CONFIG=str(path))
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "services"), env.get("PYTHONPATH", "")])
    p = subprocess.run(
        [sys.executable, "-m", "tether.merger"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 2, p.stderr[-2000:]  # settings refused: a supervisor need not restart it
    assert "tether.merger: refusing to start, bad settings" in p.stderr
    assert "merger.realign_maxx: unknown setting" in p.stderr
    assert "merger.advantage_estimator: Input should be" in p.stderr and "'bogus'" in p.stderr


def test_the_launchers_defaults_yield_to_the_config_and_flags_do_not(tmp_path):
    stack = Stack(run_dir=tmp_path, config={"trainer": {"lr": 1e-6, "model_dir": "x"}})
    env = {"TETHER_LR": "0.0005", "TETHER_SEED": "0", "TETHER_MODEL_DIR": "/m"}
    # lr: the config's; seed: not in the config; model_dir: wiring, always the launcher's (and logged).
    assert stack.launcher_env("trainer", env) == {"TETHER_SEED": "0", "TETHER_MODEL_DIR": "/m"}
    assert stack.launcher_env("scheduler", env) == env  # another section's keys do not count
    stack.explicit = frozenset({"TETHER_LR"})  # `tether up --lr 0.0005`
    assert stack.launcher_env("trainer", env) == env


def run_cli(argv: list[str]) -> int:
    args = cli.build_parser().parse_args(argv)
    return args.fn(args)


def test_up_refuses_a_bad_config_before_starting_anything(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(CONFIG_ENV, "")  # restored after the test: `up --config` sets it for its processes
    bad = write(tmp_path, {"scheduler": {"mode": "sideways"}})
    assert run_cli(["up", "--config", str(bad), "--run-dir", str(tmp_path / "run")]) == 2
    assert "scheduler.mode: Input should be" in capsys.readouterr().err
    assert not (tmp_path / "run").exists() and os.environ[CONFIG_ENV] == ""
    hub = write(tmp_path, {"model": "Qwen/Qwen3-4B-Instruct-2507"})
    assert run_cli(["up", "--config", str(hub), "--run-dir", str(tmp_path / "run")]) == 2
    assert "not a local model directory" in capsys.readouterr().err


def test_compose_mounts_the_run_config_into_every_tether_service():
    recipe = ROOT / "recipes" / "search-r1-llama3.2-3b.yaml"
    res = run_compose(
        [*compose_args(("gpu", "runs")), "config", "--format", "json"],
        compose_env(TETHER_RUN_CONFIG=str(recipe)),
    )
    assert res.returncode == 0, res.stderr
    services = json.loads(res.stdout)["services"]
    tether = {n: s for n, s in services.items() if "TETHER_SERVICE_TOKEN" in (s.get("environment") or {})}
    assert {"inference", "trainer-gpu", "merger", "gateway", "scheduler", "agent", "runhost"} <= set(tether)
    for name, s in tether.items():
        if name == "model-init":
            continue
        assert s["environment"]["TETHER_CONFIG"] == "/config/run.yaml", name
        assert mounts(s)["/config/run.yaml"]["source"] == str(recipe), name
        assert mounts(s)["/config/run.yaml"]["read_only"], name
    # What the config sets, compose leaves empty unless .env sets it (an empty variable is unset).
    assert services["trainer-gpu"]["environment"]["TETHER_LR"] == ""
    assert services["scheduler"]["environment"]["TETHER_STEPS"] == ""
    # Each recipe's override mounts its own run config instead.
    for override in sorted((ROOT / "recipes" / "compose").glob("*.yml")):
        args = compose_args(("gpu", "runs"))  # [binary, -f, docker-compose.yml, --profile, gpu, ...]
        res = run_compose(
            [*args[:3], "-f", str(override), *args[3:], "config", "--format", "json"], compose_env()
        )
        assert res.returncode == 0, (override.name, res.stderr)
        services = json.loads(res.stdout)["services"]
        want = str(ROOT / "recipes" / f"{override.stem}.yaml")
        for name in ("inference", "trainer-gpu", "merger", "gateway", "scheduler", "agent", "runhost"):
            assert mounts(services[name])["/config/run.yaml"]["source"] == want, (override.name, name)
        # The ui decodes token texts with the recipe's model's tokenizer, as the merger reads it, and the
        # run host hands it to its runs' mergers.
        model_dir = services["merger"]["environment"]["TETHER_MODEL_DIR"]
        assert services["ui"]["environment"]["TETHER_MODEL_DIR"] == model_dir != "/models/calculator/model"
        assert services["runhost"]["environment"]["TETHER_MODEL_DIR"] == model_dir
