import pytest

from trainer_ext.data.prepare import PrepareDataArguments, prepare


@pytest.fixture(scope="session")
def tiny_data_dir(tmp_path_factory):
    """A small prepared corpus: 120 KJV chapters, a 384-token BPE, 32-token samples."""
    out = tmp_path_factory.mktemp("data") / "kjv-tiny"
    prepare(PrepareDataArguments(output_dir=str(out), max_documents=120, vocab_size=384, seq_len=32,
                                 eval_samples=32, shard_size=400))
    return str(out)
