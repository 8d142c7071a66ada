"""The example agents (tether.examples.<name>) the demo, `tether up` and `tether eval` run: their
warm-started models (cached) and task files; `tether prepare-demo`.
"""

from __future__ import annotations

import argparse
import hashlib
import inspect
import json
import os
from pathlib import Path
from typing import Any

from tether.cli.args import Subparsers

# The demos' harnesses are modules of the installed package (so `tether demo` runs from a wheel as well):
# tether.examples.<name>.agent, each with the same shape (services/tether/examples/README.md).
EXAMPLES_PACKAGE = "tether.examples"


DEFAULT_EXAMPLE = "calculator"


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
    return prepare_model([name], seed, out_root)


def prepare_runs_model(names: list[str], seed: int, out_root: Path | None = None) -> Path:
    """One base model for several examples' runs side by side (`tether demo --runs`): one vLLM and one
    trainer serve one base model, so its tokenizer holds every example's VOCAB, its shape is the
    largest each asks for, and its warm start trains on all their demonstrations together, as many
    steps as theirs add up to (at the first one's learning rate), each example's demonstrations as
    often as its own warm start sees them (joint_demonstrations). One name: that example's own model."""
    return prepare_model(sorted(dict.fromkeys(names)), seed, out_root)


def joint_shape(shapes: list[dict]) -> dict:
    """The tiny model's shape that fits every example: each setting's largest value."""
    out: dict = {}
    for shape in shapes:
        for k, v in shape.items():
            out[k] = max(out.get(k, v), v)
    return out


def joint_demonstrations(per_example: list[tuple[list, int]], batch_size: int) -> list:
    """The joint warm start's conversations: each example's (demonstrations, warm-start steps) repeated
    to the samples its own warm start draws (steps x batch_size), so that the joint run, one epoch of
    the whole list in the steps' sum, trains each example as much as its own model is trained. Mixed in
    proportion to the demonstrations' counts instead, the calculator (300 steps of its own) got 2.4x its
    own training beside instruction (1,500) and learned at a third of its own model's rate
    (docs/runs.md)."""
    out: list = []
    for demos, steps in per_example:
        if not demos:
            raise ValueError("an example without demonstrations")
        n = int(steps) * batch_size
        out.extend(demos[i % len(demos)] for i in range(n))
    return out


def prepare_model(names: list[str], seed: int, out_root: Path | None = None) -> Path:
    """The warm-started model of `names` (one example, or several: prepare_runs_model); cached."""
    examples = [load_example(n) for n in names]
    first = examples[0]
    if len(examples) == 1:  # the single example's parameters exactly as they always were (its cache key)
        warm, n_demos, shape = first["WARM_START"], first["DEMONSTRATIONS"], first.get("MODEL", {})
        params = json.dumps([seed, n_demos, warm, shape], sort_keys=True)
    else:
        warm = {"steps": sum(e["WARM_START"]["steps"] for e in examples), "lr": first["WARM_START"]["lr"]}
        n_demos = [e["DEMONSTRATIONS"] for e in examples]
        shape = joint_shape([e.get("MODEL", {}) for e in examples])
        params = json.dumps([seed, names, n_demos, warm, shape, "per-example-samples"], sort_keys=True)
    code = [_module_file(f"tether.demo.{m}") for m in ("tiny", "warmstart")]
    agents = [p for e in examples for p in sorted(Path(e["__file__"]).parent.glob("*.py"))]
    sources = [*(Path(str(c)) for c in code), *agents]
    key = hashlib.sha256(b"".join(p.read_bytes() for p in sources) + params.encode()).hexdigest()[:16]
    root = out_root or Path(os.environ.get("TETHER_CACHE", Path.home() / ".cache" / "tether")) / "models"
    label = "+".join(names)
    out = root / f"{label}-{key}"
    if (out / "config.json").exists():
        return out
    from tether.demo import tiny, warmstart

    max_len = shape.get("max_len", tiny.MAX_LEN)
    vocab = list(dict.fromkeys(w for e in examples for w in e["VOCAB"]))
    tokenizer = tiny.build_tokenizer(vocab, max_len=max_len)
    model = tiny.build_model(tokenizer, seed=seed, **shape)
    demos = [e["demonstrations"](e["DEMONSTRATIONS"], seed) for e in examples]
    if len(examples) == 1:
        conversations = demos[0]
    else:
        steps = [e["WARM_START"]["steps"] for e in examples]
        batch = inspect.signature(warmstart.warm_start).parameters["batch_size"].default
        conversations = joint_demonstrations(list(zip(demos, steps, strict=True)), batch)
    print(f"warm start ({label}): {len(conversations)} demonstrations, {warm['steps']} steps", flush=True)
    warmstart.warm_start(model, tokenizer, conversations, steps=warm["steps"], lr=warm["lr"], seed=seed)
    for name, example in zip(names, examples, strict=True):
        train_until(name, example, model, tokenizer, conversations, seed)
    tmp = root / f".tmp-{key}-{os.getpid()}"
    tiny.save(model, tokenizer, tmp)
    if out.exists():
        return out  # another process finished first
    os.replace(tmp, out)
    return out


def _module_file(name: str) -> str:
    """Where an installed module's source lies."""
    import importlib.util

    spec = importlib.util.find_spec(name)
    if spec is None or spec.origin is None:
        raise RuntimeError(f"{name} has no source file")
    return spec.origin


def train_until(name: str, example: dict, model: Any, tokenizer: Any, conversations: list, seed: int) -> None:
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


def cmd_prepare_demo(args: argparse.Namespace) -> int:
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


def add_prepare_demo(sub: Subparsers) -> None:
    prepare = sub.add_parser(
        "prepare-demo", help="write the demo's warm-started model and tasks file into a folder"
    )
    prepare.add_argument("--out", required=True, help="folder: OUT/model and OUT/tasks.jsonl")
    prepare.add_argument("--seed", type=int, default=0)
    prepare.add_argument("--example", default=DEFAULT_EXAMPLE, help="which example's model and tasks")
    prepare.set_defaults(fn=cmd_prepare_demo)
