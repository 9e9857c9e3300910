"""Bad configurations and command lines through the real launcher (./run_train.sh).

Each case must end with exactly one stderr line `titanlite: error: ...` that names the key
or file, a non-zero exit within 30 s, and no process left behind. Cases run in a thread
pool (each is a separate launcher in its own session) to keep the suite short; the eight
cases in test_train.py are not repeated here. Out-of-range values and unknown choices, which
the config loader refuses as it does the launched typos and wrong types, are checked in
process (IN_PROCESS), and so are the cases the launcher's second check refuses (the trainer's
preflight in `python -m titanlite.dryrun --check-memory`: PREFLIGHT), through that module's
main with the arguments run_train.sh gives it; test_train.py launches that path for real.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pytest
from harness import REPO, _env

LIMIT_S = 30


@dataclass
class Outcome:
    returncode: int | None
    stderr: str
    elapsed: float
    leftover: bool


def _files(tmp) -> dict[str, str]:
    """Broken inputs on disk; values are paths."""
    texts = {
        "typo_key.toml": "[training]\nstepss = 3\n",
        "typo_section.toml": "[trainin]\nsteps = 3\n",
        "wrong_type.toml": '[training]\nsteps = "ten"\n',
        "syntax.toml": "[training\nsteps = 3\n",
        "not_table.toml": "steps = 3\n",
        "float_for_int.toml": "[training]\nseq_len = 64.0\n",
        "a_file.txt": "just text\n",
        "empty.txt": "",
        "blank.jsonl": '{"text": ""}\n{"text": ""}\n',
        "eps_inf.toml": "[optimizer]\neps = inf\n",
        "chat_no_messages.jsonl": '{"text": "hi"}\n',
        "chat_unknown_role.jsonl": '{"messages": [{"role": "user", "content": "hi"}, {"role": "narrator", "content": "x"}]}\n',
        "chat_empty_assistant.jsonl": '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": ""}]}\n',
        "chat_no_target.jsonl": '{"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}]}\n',
        "eval_bad_row.jsonl": '{"context": "a", "choices": [" b", " c"], "gold": 0}\n{"context": "a", "choices": " b"}\n',
        "eval_gold.jsonl": '{"context": "a", "choices": [" b", " c"], "gold": 2}\n',
    }
    paths = {}
    for name, text in texts.items():
        (tmp / name).write_text(text)
        paths[name] = str(tmp / name)
    (tmp / "bad_tok").mkdir()
    (tmp / "bad_tok" / "tokenizer.json").write_text("{not json")
    paths["bad_tok"] = str(tmp / "bad_tok")
    (tmp / "tok_no_template").mkdir()  # a fast tokenizer folder whose config has no chat_template
    (tmp / "tok_no_template" / "tokenizer.json").write_text(
        '{"version": "1.0", "truncation": null, "padding": null, "added_tokens": [{"id": 0, "content": "</s>", '
        '"single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true}], '
        '"normalizer": null, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null, "decoder": null, '
        '"model": {"type": "WordLevel", "vocab": {"</s>": 0, "hi": 1}, "unk_token": "</s>"}}')
    (tmp / "tok_no_template" / "tokenizer_config.json").write_text(
        '{"eos_token": "</s>", "tokenizer_class": "PreTrainedTokenizerFast"}')
    paths["tok_no_template"] = str(tmp / "tok_no_template")
    (tmp / "lm_eval_tasks").mkdir()  # an lm-eval task whose data set is on the hub only
    (tmp / "lm_eval_tasks" / "hub_mc.yaml").write_text(
        "task: hub_mc\ndataset_path: someone/not_here\ntest_split: test\noutput_type: multiple_choice\n"
        'doc_to_text: "{{q}}"\ndoc_to_choice: "{{choices}}"\ndoc_to_target: 0\n')
    paths["lm_eval_tasks"] = str(tmp / "lm_eval_tasks")
    (tmp / "empty_dir").mkdir()
    paths["empty_dir"] = str(tmp / "empty_dir")
    return paths


CHAT = ["--data.format", "chat", "--data.document_mask", "true", "--data.tokenizer", "byte_chat"]


def _cases(f: dict[str, str]) -> dict[str, tuple[list[str], dict[str, str], str]]:
    """id -> (arguments, extra environment, text the error line must contain)."""
    return {
        # typos and unknown names, in TOML and on the command line
        "toml_typo_key": (["--config", f["typo_key.toml"]], {}, "unknown config key 'training.stepss'; did you mean 'steps'?"),
        "toml_typo_section": (["--config", f["typo_section.toml"]], {}, "unknown config section 'trainin'; did you mean 'training'?"),
        "cli_typo_section": (["--trainig.steps", "3"], {}, "unknown config section 'trainig'; did you mean 'training'?"),
        "cli_no_section": (["--steps", "3"], {}, "option '--steps' must look like --section.key"),
        "cli_positional": (["training.steps=3"], {}, "unexpected argument 'training.steps=3'"),
        "model_name_path": (["--model.name", "../titanlite"], {}, "model.name: unknown model '../titanlite'"),
        # wrong types
        "toml_wrong_type": (["--config", f["wrong_type.toml"]], {}, "training.steps: expected int, got str"),
        "toml_float_for_int": (["--config", f["float_for_int.toml"]], {}, "training.seq_len: expected int, got float"),
        "toml_syntax": (["--config", f["syntax.toml"]], {}, f"{f['syntax.toml']}: invalid TOML"),
        "toml_not_table": (["--config", f["not_table.toml"]], {}, "'steps' must be a [section] table"),
        "cli_bool": (["--metrics.enable_tensorboard", "yes"], {}, "metrics.enable_tensorboard: expected bool, got 'yes'"),
        "cli_float": (["--optimizer.lr", "fast"], {}, "optimizer.lr: expected float, got 'fast'"),
        "cli_missing_value": (["--training.steps"], {}, "training.steps: expected int, got 'true'"),
        # zero, negative, out of range
        "steps_zero": (["--training.steps", "0"], {}, "training.steps must be >= 1, got 0"),
        "steps_negative": (["--training.steps", "-5"], {}, "training.steps must be >= 1, got -5"),
        "seq_len_zero": (["--training.seq_len", "0"], {}, "training.seq_len must be >= 1"),
        "batch_zero": (["--training.local_batch_size", "0"], {}, "training.local_batch_size must be >= 1"),
        "global_batch_zero": (["--training.global_batch_size", "0"], {}, "training.global_batch_size must be >= 1 or -1"),
        "lr_zero": (["--optimizer.lr", "0"], {}, "optimizer.lr must be > 0"),
        "lr_negative": (["--optimizer.lr", "-1e-3"], {}, "optimizer.lr must be > 0"),
        "log_freq_zero": (["--metrics.log_freq", "0"], {}, "metrics.log_freq must be >= 1"),
        "holdout_one": (["--data.holdout_fraction", "1.0"], {}, "data.holdout_fraction must be in [0, 1)"),
        "workers_negative": (["--data.num_workers", "-1"], {}, "data.num_workers must be >= 0"),
        "workers_above_cpus": (["--data.num_workers", "99999999999"], {}, "data.num_workers 99999999999 is more than"),
        # checked with pipelining off too
        "pp_layers_negative": (["--parallelism.pipeline_parallel_layers_per_stage", "-2"], {},
                               "parallelism.pipeline_parallel_layers_per_stage must be >= 0, got -2"),
        "pp_less_layers_negative": (["--parallelism.pipeline_parallel_last_stage_less_layers", "-1"], {},
                                    "parallelism.pipeline_parallel_last_stage_less_layers must be >= 0, got -1"),
        "train_timeout_zero": (["--comm.train_timeout_s", "0"], {}, "comm.train_timeout_s must be >= 1"),
        "shutdown_timeout_zero": (["--job.shutdown_timeout_s", "0"], {}, "job.shutdown_timeout_s must be >= 1"),
        "max_skipped_negative": (["--training.max_skipped_steps", "-1"], {}, "training.max_skipped_steps must be >= 0"),
        "lr_nan": (["--optimizer.lr", "nan"], {}, "optimizer.lr: must be a finite number, got nan"),
        "eps_inf_toml": (["--config", f["eps_inf.toml"]], {}, "optimizer.eps: must be a finite number, got inf"),
        # schedules longer than training
        "decay_ratio": (["--lr_scheduler.decay_ratio", "1.5"], {}, "lr_scheduler: need"),
        "profile_past_end": (["--training.steps", "20", "--profiling.enable", "true", "--profiling.start_step", "20"],
                             {}, "profiling: the window of steps 20..21 ends after training.steps (20)"),
        # choices
        "decay_type": (["--lr_scheduler.decay_type", "exp"], {}, "lr_scheduler.decay_type: 'exp' is not one of"),
        "precision": (["--training.mixed_precision_param", "float16"], {}, "training.mixed_precision_param: 'float16'"),
        "ac_mode": (["--activation_checkpoint.mode", "sometimes"], {}, "activation_checkpoint.mode: 'sometimes'"),
        "reshard": (["--parallelism.fsdp_reshard_after_forward", "maybe"], {}, "parallelism.fsdp_reshard_after_forward"),
        "adamw_impl": (["--optimizer.implementation", "apex"], {}, "optimizer.implementation: 'apex' is not one of"),
        "muon_group": (["--optimizer.name", "Muon", "--optimizer.muon_groups", "attention,embeddings"], {},
                       "optimizer.muon_groups: 'embeddings' is not one of attention, feed_forward, experts"),
        "muon_momentum": (["--optimizer.name", "Muon", "--optimizer.muon_momentum", "1.0"], {},
                          "optimizer.muon_momentum must be in [0, 1), got 1.0"),
        "muon_ns_steps": (["--optimizer.name", "Muon", "--optimizer.muon_ns_steps", "0"], {},
                          "optimizer.muon_ns_steps must be >= 1 (5 is usual), got 0"),
        "on_nonfinite": (["--training.on_nonfinite", "ignore"], {}, "training.on_nonfinite: 'ignore' is not one of"),
        "no_cuda": (["--training.device", "cuda"], {}, "training.device: cuda requested but no CUDA device"),
        "on_spike": (["--training.on_spike", "clip"], {}, "training.on_spike: 'clip' is not one of"),
        "rollback_no_checkpoint": (["--training.on_spike", "rollback"], {},
                                   "training.on_spike = rollback goes back to the newest checkpoint; set checkpoint.enable"),
        "skip_samples_bad": (["--data.skip_samples", "80-40"], {}, "data.skip_samples: bad range '80-40'"),
        "straggler_ratio_one": (["--metrics.straggler_ratio", "0.5"], {}, "metrics.straggler_ratio must be 0 (off) or > 1"),
        "rerun_no_restarts": (["--fault_tolerance.rerun_on_nonfinite", "true"], {},
                              "fault_tolerance.rerun_on_nonfinite reruns a non-finite step in a restarted attempt; set "
                              "fault_tolerance.max_restarts >= 1"),
        "rerun_with_skip": (["--fault_tolerance.rerun_on_nonfinite", "true", "--fault_tolerance.max_restarts", "1",
                             "--checkpoint.enable", "true", "--training.on_nonfinite", "skip"], {},
                            "training.on_nonfinite = skip never stops: set it to stop"),
        # impossible layouts and shapes
        "tp_zero": (["--parallelism.tensor_parallel_degree", "0"], {}, "parallelism.tensor_parallel_degree must be >= 1"),
        "dp_shard_zero": (["--parallelism.data_parallel_shard_degree", "0"], {},
                          "parallelism.data_parallel_shard_degree must be >= 1 or -1"),
        "tp_above_world": (["--parallelism.tensor_parallel_degree", "4"], {"NGPU": "2"},
                           "world size 2 is not divisible by dp_replicate 1 x cp 1 x tp 4"),
        "tp_heads": (["--parallelism.tensor_parallel_degree", "3"], {"NGPU": "3"},
                     "n_heads 8 is not divisible by parallelism.tensor_parallel_degree 3"),
        "replicate_above_world": (["--parallelism.data_parallel_replicate_degree", "2"], {},
                                  "world size 1 is not divisible by dp_replicate 2"),
        "global_batch_indivisible": (["--training.global_batch_size", "12"], {"NGPU": "2"},
                                     "training.global_batch_size 12 is not divisible"),
        "seq_len_past_rope": (["--training.seq_len", "200000"], {},
                              "training.seq_len 200000 exceeds llama3 debugmodel's max_seq_len"),
        "vocab_below_tokenizer": (["--model.vocab_size", "100"], {}, "set model.vocab_size >= 259"),
        # its parameters alone cannot fit: refused before the dry run traces it (ran for minutes)
        "vocab_too_large": (["--model.vocab_size", "99999999999"], {}, "model.vocab_size 99999999999 (llama3 "),
        "ngpu_zero": ([], {"NGPU": "0"}, "NGPU must be a positive integer, got '0'"),
        "ngpu_text": ([], {"NGPU": "two"}, "NGPU must be a positive integer, got 'two'"),
        # missing or broken files and folders
        "config_is_folder": (["--config", str(REPO)], {}, f"config file '{REPO}' not found"),
        "tokenizer_is_file": (["--data.tokenizer", f["a_file.txt"]], {}, "is not 'byte', 'byte_chat' or a folder"),
        "tokenizer_corrupt": (["--data.tokenizer", f["bad_tok"]], {}, f"data.tokenizer: cannot load '{f['bad_tok']}'"),
        "dump_folder_is_file": (["--job.dump_folder", f["a_file.txt"]], {}, "job.dump_folder: cannot write to"),
        "checkpoint_initial_missing": (["--checkpoint.initial_load_path", f["a_file.txt"] + ".gone"], {},
                                       "checkpoint.initial_load_path: '"),
        "checkpoint_folder_absolute": (["--checkpoint.folder", "/tmp"], {},
                                       "checkpoint.folder: '/tmp' must be a relative path inside job.dump_folder"),
        "checkpoint_folder_escapes": (["--checkpoint.folder", "../elsewhere"], {}, "checkpoint.folder: '../elsewhere'"),
        "checkpoint_on_save_error": (["--checkpoint.on_save_error", "retry"], {}, "checkpoint.on_save_error: 'retry'"),
        # pipeline layouts (debugmodel: 4 blocks, local batch 8)
        "pp_above_blocks": (["--parallelism.pipeline_parallel_degree", "8"], {"NGPU": "8"},
                            "parallelism.pipeline_parallel_degree 8 exceeds the model's 4 blocks"),
        "pp_schedule_unknown": (["--parallelism.pipeline_parallel_schedule", "Zigzag"], {},
                                "parallelism.pipeline_parallel_schedule: 'Zigzag' is not one of GPipe"),
        "pp_microbatch_indivisible": (["--parallelism.pipeline_parallel_degree", "2", "--training.local_batch_size", "8",
                                       "--parallelism.pipeline_parallel_microbatch_size", "3"], {"NGPU": "2"},
                                      "parallelism.pipeline_parallel_microbatch_size 3 does not divide"),
        "pp_too_few_microbatches": (["--parallelism.pipeline_parallel_degree", "2", "--training.local_batch_size", "4",
                                     "--parallelism.pipeline_parallel_microbatch_size", "4"], {"NGPU": "2"},
                                    "1F1B needs at least as many micro-batches as stages (2), got 1"),
        "pp_stages_unplaceable": (["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule",
                                   "ZBVZeroBubble", "--parallelism.pipeline_parallel_layers_per_stage", "2"],
                                  {"NGPU": "2"}, "makes 3 stages; ZBVZeroBubble on 2 pipeline ranks needs exactly 4"),
        "dump_folder_under_file": (["--job.dump_folder", f["a_file.txt"] + "/out"], {}, "job.dump_folder: cannot write to"),
        # found by reading files before launch, not by the ranks
        "load_step_missing": (["--checkpoint.enable", "true", "--checkpoint.load_step", "99999"], {},
                              "checkpoint.load_step 99999: no complete checkpoint"),
        "initial_load_not_checkpoint": (["--checkpoint.initial_load_path", f["empty_dir"]], {},
                                        "missing or unreadable titanlite.json"),
        "data_empty_file": (["--data.path", f["empty.txt"]], {}, "data.path: no documents with text in"),
        "data_blank_jsonl": (["--data.path", f["blank.jsonl"]], {}, "data.path: no documents with text in"),
        "train_split_below_batch": (["--data.path", f["a_file.txt"], "--training.seq_len", "64"], {},
                                    "samples of seq_len 64 in the train split"),
        "val_split_below_batch": (["--validation.freq", "5", "--data.holdout_fraction", "0.00001"], {},
                                  "in the val split"),
        "val_steps_above_split": (["--validation.freq", "5", "--validation.steps", "1000"], {},
                                  "validation.steps 1000 x global batch 8 is more than"),
        # chats (data.format chat): the config, then each bad row found before launch
        "chat_train_on": ([*CHAT, "--data.train_on", "everything"], {}, "data.train_on: 'everything' is not one of"),
        "chat_without_document_mask": ([*CHAT, "--data.document_mask", "false"], {},
                                       "data.format chat packs several chats per sample; set data.document_mask = true"),
        "chat_byte_tokenizer": ([*CHAT, "--data.tokenizer", "byte"], {}, "and data.tokenizer 'byte' has none"),
        "chat_no_template": ([*CHAT, "--data.tokenizer", f["tok_no_template"]], {},
                             f"data.tokenizer '{f['tok_no_template']}' has no chat template"),
        "chat_no_messages": ([*CHAT, "--data.path", f["chat_no_messages.jsonl"]], {},
                             f"data.path: {f['chat_no_messages.jsonl']} line 1: no 'messages', not a list of messages"),
        "chat_unknown_role": ([*CHAT, "--data.path", f["chat_unknown_role.jsonl"]], {},
                              "line 1: message 2 has role 'narrator'; each message needs a role among"),
        "chat_empty_assistant": ([*CHAT, "--data.path", f["chat_empty_assistant.jsonl"]], {},
                                 "line 1: message 2 is an empty assistant turn"),
        "chat_no_target": ([*CHAT, "--data.path", f["chat_no_target.jsonl"]], {},
                           "line 1: no token to train on with data.train_on = assistant"),
        # [eval] tasks: the section, then each task file's rows, before launch
        "eval_interval_zero": (["--eval.interval", "0"], {}, "eval.interval must be >= 1, got 0"),
        "eval_task_no_data": (["--eval.tasks", "hub_mc", "--eval.include_path", f["lm_eval_tasks"]], {},
                              "eval.tasks: the data of lm-eval task 'hub_mc' is not on this machine"),
        "eval_bad_row": (["--eval.tasks", f["eval_bad_row.jsonl"]], {},
                         f"eval.tasks: {f['eval_bad_row.jsonl']} row 2: a choice task's row needs the keys context, "
                         "choices, gold"),
        "eval_gold_range": (["--eval.tasks", f["eval_gold.jsonl"]], {},
                            f"eval.tasks: {f['eval_gold.jsonl']} row 1: gold 2 is not an index of its 2 choices"),
        "eval_generate_moe_under_pp_tp": (["--model.name", "qwen3_moe", "--eval.tasks", "stdlib_which,stdlib_signature",
                                           "--parallelism.pipeline_parallel_degree", "2",
                                           "--parallelism.tensor_parallel_degree", "2",
                                           "--parallelism.expert_parallel_degree", "2"], {"NGPU": "4"},
                                          "eval.tasks: exact-match task stdlib_signature is not scored under pipeline "
                                          "parallel with MoE blocks under tensor parallel (not tried)"),
    }


def _run(args: list[str], env: dict[str, str], dump: str) -> Outcome:
    # the dump folder comes first so a case's own --job.dump_folder overrides it
    proc = subprocess.Popen([str(REPO / "run_train.sh"), "--job.dump_folder", dump, *args], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=_env({"NGPU": "1", **env}), start_new_session=True)
    start = time.monotonic()
    try:
        _, err = proc.communicate(timeout=LIMIT_S)
        code = proc.returncode
    except subprocess.TimeoutExpired:
        code, err = None, ""
    elapsed = time.monotonic() - start
    # the launcher led its own session: any process still in its group was left behind
    try:
        os.killpg(proc.pid, 0)
        leftover = True
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        leftover = False
    if code is None:
        proc.communicate()
    return Outcome(code, err, elapsed, leftover)


# Out-of-range values and unknown choices of one key: refused while the config loads, the same
# path as the typos and wrong types launched above. Checked in process: a launch costs a Python
# start and a torch import (about 3 CPU seconds each) and shows nothing these do not.
IN_PROCESS = ("steps_negative", "seq_len_zero", "batch_zero", "global_batch_zero", "lr_zero", "lr_negative",
              "log_freq_zero", "holdout_one", "workers_negative", "workers_above_cpus", "pp_layers_negative",
              "pp_less_layers_negative", "train_timeout_zero", "shutdown_timeout_zero",
              "max_skipped_negative", "lr_nan", "precision", "ac_mode", "reshard", "adamw_impl", "muon_group",
              "muon_momentum", "muon_ns_steps", "on_nonfinite", "on_spike", "rollback_no_checkpoint",
              "skip_samples_bad", "straggler_ratio_one", "rerun_no_restarts", "rerun_with_skip", "tp_zero",
              "dp_shard_zero", "cli_float",
              "cli_missing_value", "checkpoint_on_save_error", "checkpoint_folder_absolute",
              "checkpoint_folder_escapes", "pp_schedule_unknown", "chat_train_on", "chat_without_document_mask",
              "chat_byte_tokenizer", "eval_interval_zero")

# Refused by the trainer's preflight, the launcher's second process (each a torch import,
# about 6 CPU seconds): run through that process's main in this one.
PREFLIGHT = ("model_name_path", "tp_above_world", "tp_heads", "replicate_above_world", "global_batch_indivisible",
             "seq_len_past_rope", "vocab_below_tokenizer", "vocab_too_large", "no_cuda", "tokenizer_corrupt",
             "dump_folder_is_file", "dump_folder_under_file", "pp_above_blocks", "pp_microbatch_indivisible",
             "pp_too_few_microbatches", "pp_stages_unplaceable", "load_step_missing", "initial_load_not_checkpoint",
             "data_empty_file", "data_blank_jsonl", "train_split_below_batch", "val_split_below_batch",
             "val_steps_above_split", "chat_no_template", "chat_no_messages", "chat_unknown_role", "chat_empty_assistant",
             "chat_no_target", "eval_task_no_data", "eval_bad_row", "eval_gold_range",
             "eval_generate_moe_under_pp_tp")


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bad_input")
    cases = {k: v for k, v in _cases(_files(tmp)).items() if k in CASE_IDS}
    with ThreadPoolExecutor(max_workers=4) as pool:
        futures = {name: pool.submit(_run, args, env, str(tmp / f"dump-{name}"))
                   for name, (args, env, _) in cases.items()}
        return {name: (cases[name][2], fut.result()) for name, fut in futures.items()}


# the cases with each file's name standing in for its path
NAMED = _cases({k: k for k in ["typo_key.toml", "typo_section.toml", "wrong_type.toml", "syntax.toml",
                               "not_table.toml", "float_for_int.toml", "a_file.txt", "bad_tok", "empty.txt",
                               "blank.jsonl", "eps_inf.toml", "empty_dir", "chat_no_messages.jsonl",
                               "chat_unknown_role.jsonl", "chat_empty_assistant.jsonl", "chat_no_target.jsonl",
                               "eval_bad_row.jsonl", "eval_gold.jsonl", "lm_eval_tasks",
                               "tok_no_template"]})
ALL_IDS = list(NAMED)
CASE_IDS = [k for k in ALL_IDS if k not in IN_PROCESS + PREFLIGHT]

# docs/reliability.md's table of the cases (generated from here: reliability_section)
GROUPS = {
    "typos, unknown names": ("toml_typo_key", "toml_typo_section", "cli_typo_section", "cli_no_section",
                             "cli_positional", "model_name_path"),
    "wrong types, broken TOML": ("toml_wrong_type", "toml_float_for_int", "toml_syntax", "toml_not_table", "cli_bool",
                                 "cli_float", "cli_missing_value"),
    "zero, negative, out of range": ("steps_zero", "steps_negative", "seq_len_zero", "batch_zero", "global_batch_zero",
                                     "lr_zero", "lr_negative", "log_freq_zero", "holdout_one", "workers_negative",
                                     "workers_above_cpus", "pp_layers_negative", "pp_less_layers_negative",
                                     "train_timeout_zero", "shutdown_timeout_zero", "max_skipped_negative",
                                     "skip_samples_bad", "straggler_ratio_one", "muon_momentum", "muon_ns_steps"),
    "non-finite numbers": ("lr_nan", "eps_inf_toml"),
    "schedules longer than training": ("decay_ratio", "profile_past_end"),
    "bad choices": ("decay_type", "precision", "ac_mode", "reshard", "adamw_impl", "muon_group", "on_nonfinite",
                    "on_spike", "rollback_no_checkpoint", "no_cuda", "rerun_no_restarts", "rerun_with_skip"),
    "impossible layouts, shapes": ("tp_zero", "dp_shard_zero", "tp_above_world", "tp_heads", "replicate_above_world",
                                   "global_batch_indivisible", "seq_len_past_rope", "vocab_below_tokenizer",
                                   "vocab_too_large", "ngpu_zero", "ngpu_text", "pp_above_blocks",
                                   "pp_schedule_unknown", "pp_microbatch_indivisible", "pp_too_few_microbatches",
                                   "pp_stages_unplaceable"),
    "missing or broken files, folders": ("config_is_folder", "tokenizer_is_file", "tokenizer_corrupt",
                                         "dump_folder_is_file", "dump_folder_under_file"),
    "bad checkpoint settings": ("checkpoint_initial_missing", "checkpoint_folder_absolute", "checkpoint_folder_escapes",
                                "checkpoint_on_save_error"),
    "chats (data.format chat)": ("chat_train_on", "chat_without_document_mask", "chat_byte_tokenizer",
                                 "chat_no_template", "chat_no_messages", "chat_unknown_role", "chat_empty_assistant",
                                 "chat_no_target"),
    "[eval] tasks": ("eval_interval_zero", "eval_task_no_data", "eval_bad_row", "eval_gold_range",
                     "eval_generate_moe_under_pp_tp"),
    "found by reading files before launch": ("load_step_missing", "initial_load_not_checkpoint", "data_empty_file",
                                             "data_blank_jsonl", "train_split_below_batch", "val_split_below_batch",
                                             "val_steps_above_split"),
}
BEGIN, END = "<!-- generated by python tests/test_bad_input.py: do not edit -->", "<!-- end of generated text -->"
RELIABILITY = REPO / "docs" / "reliability.md"


def reliability_section() -> str:
    """docs/reliability.md's account of these cases, its figures counted here."""
    import test_train

    launched = test_train.test_bad_input_one_line_fast_nonzero.pytestmark[0].args[1]
    text = (f"`tests/test_bad_input.py` holds {len(ALL_IDS)} cases. Each must give exactly one stderr line "
            "`titanlite: error: ...` containing the expected text (the key or file) and a non-zero exit within "
            f"{LIMIT_S} s. The launcher checks the config in a torch-free process first (`python -m "
            "titanlite.config.load`); layout, model, tokenizer, folder and data checks follow in one more process, "
            "which then also estimates the job's memory with a dry run of one step (`python -m titanlite.dryrun "
            f"--check-memory`). {len(CASE_IDS)} cases that the first process refuses run through `./run_train.sh` "
            "(4 at a time, each in its own session, which must be left empty); "
            f"{len(IN_PROCESS)} more of that kind (out-of-range values, bad choices) are checked as the config "
            f"loads, in the test process. The {len(PREFLIGHT)} cases the second process refuses run through its "
            "`main`, with the arguments run_train.sh gives it, in the test process: a launch each would cost a torch "
            f"import (about 6 CPU seconds) and shows nothing more, since the {len(launched)} cases of "
            "`tests/test_train.py::test_bad_input_one_line_fast_nonzero` "
            f"({', '.join(launched)}) take that path through the real launcher.")
    table = ["| group | cases |", "|---|---|"] + [f"| {group} ({len(ids)}) | {', '.join(f'`{i}`' for i in ids)} |"
                                                 for group, ids in GROUPS.items()]
    return "\n".join([BEGIN, text, "", *table, END])


def test_at_least_thirty_cases():
    assert len(ALL_IDS) >= 60 and set(IN_PROCESS) | set(PREFLIGHT) < set(ALL_IDS)
    assert len(CASE_IDS) >= 15 and not set(IN_PROCESS) & set(PREFLIGHT)


def test_the_reliability_doc_counts_these_cases():
    """Its figures and table are this file's (python tests/test_bad_input.py writes them)."""
    grouped = [i for ids in GROUPS.values() for i in ids]
    assert sorted(grouped) == sorted(ALL_IDS), set(grouped) ^ set(ALL_IDS)
    doc = RELIABILITY.read_text()
    assert reliability_section() in doc, "docs/reliability.md's bad-input section is stale: python tests/test_bad_input.py"


@pytest.mark.parametrize("case", IN_PROCESS)
def test_bad_value_is_refused_in_one_line_as_the_config_loads(case):
    from titanlite.config.load import load
    from titanlite.errors import ConfigError

    args, env, expect = NAMED[case]
    assert not env
    with pytest.raises(ConfigError) as err:
        load(args)
    assert expect in str(err.value) and "\n" not in str(err.value), str(err.value)


@pytest.mark.parametrize("case", CASE_IDS)
def test_bad_input_gives_one_line_and_fails_fast(outcomes, case):
    expect, out = outcomes[case]
    assert out.returncode is not None, f"still running after {LIMIT_S} s"
    assert out.returncode != 0
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("titanlite: error: "), out.stderr
    assert expect in lines[0], f"expected {expect!r} in {lines[0]!r}"
    assert out.elapsed < LIMIT_S
    assert not out.leftover, "processes were left running"


@pytest.mark.parametrize("case", PREFLIGHT)
def test_bad_input_is_refused_in_one_line_by_the_preflight(case, tmp_path, capsys):
    from titanlite.config.load import load
    from titanlite.dryrun.run import main

    args, env, expect = _cases(_files(tmp_path))[case]
    ngpu = env.get("NGPU", "1")
    assert set(env) <= {"NGPU"}
    load(args)  # the launcher's first check passes it on
    start = time.monotonic()
    with pytest.raises(SystemExit) as code:
        main(["--check-memory", ngpu, "--ngpu", ngpu, "--job.dump_folder", str(tmp_path / "dump"), *args])
    assert code.value.code == 2 and time.monotonic() - start < LIMIT_S
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("titanlite: error: ") and expect in lines[0], lines


if __name__ == "__main__":
    doc = RELIABILITY.read_text()
    RELIABILITY.write_text(doc[:doc.index(BEGIN)] + reliability_section() + doc[doc.index(END) + len(END):])
    print(f"{RELIABILITY}: {len(ALL_IDS)} cases")
