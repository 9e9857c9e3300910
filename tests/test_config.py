"""Config loading: precedence, overrides, help, and every validation error."""

import dataclasses

import pytest

from titanlite.config import load as config_load
from titanlite.errors import ConfigError
from titanlite.config.load import load
from titanlite.optim import lr_factor, warmup_note
from titanlite.parallel.mesh import ParallelDims
from titanlite.preflight import preflight


def write(tmp_path, text):
    path = tmp_path / "job.toml"
    path.write_text(text)
    return str(path)


def test_defaults_are_the_debug_job():
    cfg, flags = load([])
    assert (cfg.model.name, cfg.model.flavor, cfg.training.steps) == ("llama3", "debugmodel", 100)
    assert flags == set()


def test_precedence_cli_over_toml_over_defaults(tmp_path):
    path = write(tmp_path, "[training]\nsteps = 70\nseq_len = 32\n[optimizer]\nlr = 1\n")
    cfg, _ = load(["--config", path, "--training.steps", "90", "--metrics.enable_tensorboard=false"])
    assert cfg.training.steps == 90  # CLI wins
    assert cfg.training.seq_len == 32  # TOML wins over default
    assert cfg.optimizer.lr == 1.0 and isinstance(cfg.optimizer.lr, float)  # int accepted for float
    assert cfg.training.local_batch_size == 8  # default
    assert cfg.metrics.enable_tensorboard is False


def test_bare_config_name_resolves_in_train_configs():
    cfg, _ = load(["--config", "llama_8b.toml"])
    assert cfg.model.flavor == "8B"


def test_bool_flag_without_value():
    cfg, _ = load(["--compile.enable", "--training.steps", "50"])
    assert cfg.compile.enable is True and cfg.training.steps == 50


@pytest.mark.parametrize("argv,message", [
    (["--traning.steps", "3"], "unknown config section 'traning'; did you mean 'training'?"),
    (["--training.step", "3"], "unknown config key 'training.step'; did you mean 'steps'?"),
    (["--training.steps", "ten"], "training.steps: expected int, got 'ten'"),
    (["--training.steps", "1.5"], "training.steps: expected int, got '1.5'"),
    (["--compile.enable", "yes"], "compile.enable: expected bool, got 'yes'"),
    (["--training.steps", "0"], "training.steps must be >= 1, got 0"),
    (["--training.steps", "-3"], "training.steps must be >= 1, got -3"),
    (["--optimizer.lr", "0"], "optimizer.lr must be > 0"),
    (["--optimizer.beta2", "1.0"], "optimizer.beta2 must be in [0, 1), got 1.0"),
    (["--optimizer.beta1", "-0.1"], "optimizer.beta1 must be in [0, 1), got -0.1"),
    (["--optimizer.eps", "-1e-8"], "optimizer.eps must be >= 0"),
    (["--optimizer.weight_decay", "-0.1"], "optimizer.weight_decay must be >= 0"),
    (["--model.vocab_size", "-5"], "model.vocab_size must be >= 0, got -5"),
    (["--training.device", "tpu"], "training.device: 'tpu' is not one of auto, cpu, cuda"),
    (["--optimizer.lr", "nan"], "optimizer.lr: must be a finite number, got nan"),
    (["--optimizer.beta2", "inf"], "optimizer.beta2: must be a finite number, got inf"),
    (["--training.max_norm", "-inf"], "training.max_norm: must be a finite number, got -inf"),
    (["--checkpoint.load_step", "3"], "checkpoint.load_step 3 is set but checkpoint.enable is false"),
    (["--fault_tolerance.max_restarts", "-1"], "fault_tolerance.max_restarts must be >= 0, got -1"),
    (["--fault_tolerance.max_restarts", "2"], "fault_tolerance.max_restarts 2 needs checkpoint.enable = true"),
    (["--fault_tolerance.max_restarts", "2", "--checkpoint.enable", "--checkpoint.load_step", "6"],
     "fault_tolerance.max_restarts 2 with checkpoint.load_step 6: a restart resumes from the newest checkpoint"),
    (["--data.path", "/no/such/corpus"], "data.path: '/no/such/corpus' does not exist"),
    (["--data.tokenizer", "/no/such/tok"], "data.tokenizer: '/no/such/tok' is not 'byte', 'byte_chat' or a folder"),
    (["--config", "nope.toml"], "config file 'nope.toml' not found"),
    (["steps"], "unexpected argument 'steps'"),
    (["--steps", "3"], "option '--steps' must look like --section.key"),
    (["--parallelism.data_parallel_shard_degree", "0"], "must be >= 1 or -1"),
    (["--comm.train_timeout_s", "400"], "comm.train_timeout_s 400 is longer than comm.init_timeout_s 300 (set-up and "
                                        "the first step); raise comm.init_timeout_s too"),
])
def test_cli_errors_name_the_key(argv, message):
    with pytest.raises(ConfigError) as e:
        load(argv)
    assert message in str(e.value)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("toml,message", [
    ("[trainng]\nsteps = 3\n", "did you mean 'training'?"),
    ("[training]\nsteeps = 3\n", "unknown config key 'training.steeps'; did you mean 'steps'?"),
    ("[training]\nsteps = \"3\"\n", "training.steps: expected int, got str '3'"),
    ("[training]\nsteps = 3.0\n", "training.steps: expected int, got float 3.0"),
    ("[compile]\nenable = 1\n", "compile.enable: expected bool, got int 1"),
    ("training = 3\n", "'training' must be a [section] table"),
    ("[training\n", "invalid TOML"),
])
def test_toml_errors_name_the_key(tmp_path, toml, message):
    with pytest.raises(ConfigError) as e:
        load(["--config", write(tmp_path, toml)])
    assert message in str(e.value)


@pytest.mark.parametrize("degrees,world,message", [
    ((1, -1, 1, 2), 3, "world size 3 is not divisible by dp_replicate 1 x cp 1 x tp 2 = 2"),
    ((1, 2, 1, 2), 8, "dp_replicate 1 x dp_shard 2 x cp 1 x tp 2 = 4 differ from the world size 8"),
    ((2, 2, 1, 1), 2, "= 4 differ from the world size 2"),
])
def test_impossible_degrees_name_the_numbers(degrees, world, message):
    r, s, c, t = degrees
    cfg, _ = load(["--parallelism.data_parallel_replicate_degree", str(r),
                   "--parallelism.data_parallel_shard_degree", str(s),
                   "--parallelism.context_parallel_degree", str(c), "--parallelism.tensor_parallel_degree", str(t)])
    with pytest.raises(ConfigError) as e:
        ParallelDims.from_config(cfg.parallelism, world)
    assert message in str(e.value)


def test_global_batch_not_divisible_names_the_numbers():
    cfg, _ = load(["--training.global_batch_size", "12", "--training.local_batch_size", "4"])
    with pytest.raises(ConfigError) as e:
        preflight(cfg, world_size=2)
    assert "global_batch_size 12 is not divisible by local_batch_size 4 x dp degree 2 = 8" in str(e.value)


@pytest.mark.parametrize("argv,message", [
    (["--model.name", "llama4"], "model.name: unknown model 'llama4'; available: "),
    (["--model.flavor", "7B"], "model.flavor: unknown flavor '7B' for 'llama3'; available: debugmodel, 1B"),
    (["--model.vocab_size", "100"], "data.tokenizer has 259 ids but the model embeds only 100"),
    (["--training.seq_len", "999999"], "training.seq_len 999999 exceeds llama3 debugmodel's max_seq_len"),
])
def test_model_errors(argv, message):
    cfg, _ = load(argv)
    with pytest.raises(ConfigError) as e:
        preflight(cfg, world_size=1)
    assert message in str(e.value)


def test_help_lists_every_option_with_its_doc():
    text = config_load.help_text()
    for name, section in config_load._sections().items():
        docs = config_load.field_docs(section)
        for f in dataclasses.fields(section):
            assert f"--{name}.{f.name} " in text
            assert docs.get(f.name), f"{name}.{f.name} has no docstring"


def test_print_config_round_trips(tmp_path):
    cfg, _ = load(["--training.steps", "42", "--job.description", 'say "hi"'])
    again, _ = load(["--config", write(tmp_path, config_load.to_toml(cfg))])
    assert again == cfg


def test_list_values_parse_from_toml_and_cli():
    assert config_load._coerce("k", "a,b", list[str], from_cli=True) == ["a", "b"]
    assert config_load._coerce("k", [1, 2.5], list[float], from_cli=False) == [1.0, 2.5]
    with pytest.raises(ConfigError, match="k: expected a list"):
        config_load._coerce("k", "a", list[str], from_cli=False)


def test_warmup_longer_than_the_run_is_shortened_to_fit():
    cfg, _ = load(["--training.steps", "3"])  # the default warm-up is 10 steps
    s = cfg.lr_scheduler
    assert [lr_factor(k, s, 3) for k in range(3)] == [lr_factor(k, dataclasses.replace(s, warmup_steps=2), 3) for k in range(3)]
    assert "warming up for 2 steps instead" in warmup_note(s, 3)
    assert warmup_note(s, 11) is None
