"""The typed configs and the CLI generated from them."""

import json
from dataclasses import dataclass

import pytest

from rlhfkit.config import DataArgs, DeepSpeedArgs, LogArgs, ModelArgs, OptimArgs, check_common, parse_config, require
from rlhfkit.errors import ConfigError


@dataclass
class Cfg(ModelArgs, DataArgs, OptimArgs, DeepSpeedArgs, LogArgs):
    def validate(self):
        require(self, "model_name_or_path", "data_path", "output_dir")
        check_common(self)


BASE = ["--model_name_or_path", "m", "--data_path", "a.jsonl", "b.jsonl", "--output_dir", "o"]


def test_deepspeed_chat_flags_parse():
    cfg = parse_config(Cfg, BASE + ["--zero_stage", "3", "--per_device_train_batch_size", "2", "--gradient_checkpointing",
                                    "--learning_rate", "3e-4", "--data_split", "2,4,4", "--local_rank=1", "--max_steps", "7"])
    assert cfg.zero_stage == 3 and cfg.per_device_train_batch_size == 2 and cfg.gradient_checkpointing is True
    assert cfg.learning_rate == 3e-4 and cfg.data_path == ["a.jsonl", "b.jsonl"] and cfg.local_rank == 1 and cfg.max_steps == 7


def test_every_field_documented():
    import dataclasses

    for f in dataclasses.fields(Cfg):
        assert f.metadata.get("help"), f"{f.name} has no help text"


def test_config_file_json_and_yaml(tmp_path):
    j = tmp_path / "c.json"
    j.write_text(json.dumps({"zero_stage": 2, "learning_rate": 0.5, "output_dir": "from_file"}))
    cfg = parse_config(Cfg, BASE[:5] + ["--config", str(j), "--learning_rate", "0.25"])
    assert cfg.zero_stage == 2 and cfg.learning_rate == 0.25 and cfg.output_dir == "from_file"  # command line wins
    y = tmp_path / "c.yaml"
    y.write_text("zero_stage: 1\ndata_path: [x.jsonl]\n")
    cfg = parse_config(Cfg, ["--config", str(y), "--model_name_or_path", "m", "--output_dir", "o"])
    assert cfg.zero_stage == 1 and cfg.data_path == ["x.jsonl"]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"zero_stag": 2}))
    with pytest.raises(ConfigError, match="unknown field.*zero_stag"):
        parse_config(Cfg, BASE + ["--config", str(bad)])


def test_errors_name_the_flag():
    with pytest.raises(ConfigError, match="--zero_stage 5 is out of range"):
        parse_config(Cfg, BASE + ["--zero_stage", "5"])
    with pytest.raises(ConfigError, match="missing required flag.*--output_dir"):
        parse_config(Cfg, BASE[:5])
    with pytest.raises(SystemExit):  # argparse: "unrecognized arguments: --no_such_flag"
        parse_config(Cfg, BASE + ["--no_such_flag", "1"])
