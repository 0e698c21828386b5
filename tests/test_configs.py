import os

import yaml

CONFIGS = os.path.join(os.path.dirname(__file__), "..", "trainer_ext", "configs")


def load(name):
    with open(os.path.join(CONFIGS, name)) as f:
        return yaml.safe_load(f)


def test_single_card_config_is_one_bf16_process_without_sharding():
    config = load("accelerate_single_24gb.yaml")
    assert config["distributed_type"] == "NO" and config["num_processes"] == 1
    assert config["mixed_precision"] == "bf16"
    assert "deepspeed_config" not in config and "fsdp_config" not in config


def test_fsdp2_config_wraps_the_decoder_layers():
    config = load("accelerate_fsdp2.yaml")
    fsdp = config["fsdp_config"]
    assert config["distributed_type"] == "FSDP" and fsdp["fsdp_version"] == 2
    assert "RecurrentDepthDecoderLayer" in fsdp["fsdp_transformer_layer_cls_to_wrap"].split(",")
    assert fsdp["fsdp_activation_checkpointing"] is True and config["mixed_precision"] == "bf16"


def test_deepspeed_config_is_zero2():
    config = load("accelerate_deepspeed_zero2.yaml")
    assert config["distributed_type"] == "DEEPSPEED" and config["deepspeed_config"]["zero_stage"] == 2


def test_accelerate_parses_every_config():
    from accelerate.commands.config.config_args import load_config_from_file

    expected = {"single_24gb": "NO", "fsdp2": "FSDP", "deepspeed_zero2": "DEEPSPEED"}
    for name, kind in expected.items():
        config = load_config_from_file(os.path.join(CONFIGS, f"accelerate_{name}.yaml"))
        assert config.distributed_type.value == kind
