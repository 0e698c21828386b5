"""Tokenize a corpus and pack it into fixed-length numpy shards with a manifest (trainer_ext.data.prepare).

    hf-recurrent-prepare-data                          # embedded KJV corpus -> outputs/data/kjv
    hf-recurrent-prepare-data --files "data/*.jsonl" notes.txt --output_dir outputs/data/mine
    hf-recurrent-prepare-data --dataset uonlp/CulturaX --dataset_config ja \
        --tokenizer llm-jp/llm-jp-3-1.8b --seq_len 2048 --max_tokens 1_000_000_000 \
        --output_dir outputs/data/culturax-ja
    hf-recurrent-prepare-data --files "data/*.jsonl" --output_dir outputs/data/piece-2 \
        --skip_documents 5120 --skip_tokens 37 --max_tokens 50_000_000 --eval_from outputs/data/heldout

(`python -m trainer_ext.cli.prepare_data ...` is the same command.) Without --tokenizer a byte-level BPE of
--vocab_size entries is trained on the corpus. A rerun with the same arguments finds the manifest and does nothing;
other arguments are refused unless --overwrite. The last example takes the piece of the stream that starts where an
earlier directory's manifest says it ended (its `stream_end`) and shares the held-out set of outputs/data/heldout.
Started by torchrun / accelerate launch (a job that launches each of its commands that way), one process prepares
while the others wait.
"""

from __future__ import annotations

import logging
import sys

from transformers import HfArgumentParser

from trainer_ext.data.prepare import PrepareDataArguments, prepare
from trainer_ext.files import launch_process_group, one_process_writes


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    (args,) = HfArgumentParser(PrepareDataArguments).parse_args_into_dataclasses(args=argv)
    with launch_process_group(), one_process_writes(f"the data in {args.output_dir}") as writes:
        if writes:
            prepare(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
