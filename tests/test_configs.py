import os

import pytest
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


@pytest.mark.parametrize("cards", [2, 4])
def test_fsdp2_configs_shard_bf16_weights_per_decoder_layer(cards):
    config = load(f"accelerate_fsdp2_{cards}x24gb.yaml")
    fsdp = config["fsdp_config"]
    assert config["distributed_type"] == "FSDP" and fsdp["fsdp_version"] == 2 and config["num_processes"] == cards
    # No class list: accelerate refuses one the model lacks, and the Transformer baselines' layers are Llama's. It
    # wraps the classes of the model's _no_split_modules, the decoder layers of either.
    assert fsdp["fsdp_auto_wrap_policy"] == "TRANSFORMER_BASED_WRAP" and "fsdp_transformer_layer_cls_to_wrap" not in fsdp
    from hf_recurrent import RecurrentDepthForCausalLM

    assert RecurrentDepthForCausalLM._no_split_modules == ["RecurrentDepthDecoderLayer"]
    # bf16 mixed precision would make accelerate upcast the bf16 weights to fp32 shards before sharding
    assert config["mixed_precision"] == "no"
    # the trainer's memory plan decides what is recomputed; a gathered checkpoint loads with from_pretrained
    assert fsdp["fsdp_activation_checkpointing"] is False and fsdp["fsdp_state_dict_type"] == "FULL_STATE_DICT"


@pytest.mark.parametrize("cards", [2, 4])
def test_ddp_configs_are_plain_data_parallel(cards):
    config = load(f"accelerate_ddp_{cards}x24gb.yaml")
    assert config["distributed_type"] == "MULTI_GPU" and config["num_processes"] == cards
    assert "fsdp_config" not in config and "deepspeed_config" not in config


def test_deepspeed_config_is_zero2():
    config = load("accelerate_deepspeed_zero2.yaml")
    assert config["distributed_type"] == "DEEPSPEED" and config["deepspeed_config"]["zero_stage"] == 2


def test_accelerate_parses_every_config():
    from accelerate.commands.config.config_args import load_config_from_file

    expected = {"single_24gb": "NO", "ddp_2x24gb": "MULTI_GPU", "ddp_4x24gb": "MULTI_GPU", "fsdp2_2x24gb": "FSDP",
                "fsdp2_4x24gb": "FSDP", "deepspeed_zero2": "DEEPSPEED"}
    for name, kind in expected.items():
        config = load_config_from_file(os.path.join(CONFIGS, f"accelerate_{name}.yaml"))
        assert config.distributed_type.value == kind
